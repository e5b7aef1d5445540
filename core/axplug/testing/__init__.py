"""Conformance kit for plugin authors: subclass one class, override a few fixtures.

```python
import pytest
from axplug.testing import LayerConformance
from my_plugin import MyFeedForward

class TestMyFeedForward(LayerConformance):
    @pytest.fixture
    def layer_config(self):
        return MyFeedForward.default_config().set(input_dim=16, hidden_dim=32)
```

The other kinds: `KernelConformance` (override `kernel`), `PagedKernelConformance` (`kernel`,
a paged-attention kernel), `GroupedMatmulConformance` (`kernel`, a grouped matmul),
`MeshRuleConformance` (`rule`,
`selectors`) and `StorageConformance` (`storage`). Capabilities are declared, not skipped: a
class attribute `capabilities` names what the component supports, and checks for capabilities
it lacks report as skipped with the reason.

`tiny_trainer_config(tmp_path, "log_every=1", preset="llama-tiny", max_steps=4)` is the
trainer config a test runs: a preset shrunk to train in seconds; `train_steps(trainer, n)`
calls its built train step without a run;
`tiny_train_args(...)` is the same run as `axplug train` arguments. A summary writer's tests
compare what it received with the run's own metrics.jsonl (`expected_writer_scalars`,
`metrics_as_tags`, `scalars_match`).
"""

import importlib

# Imported on first use: pytest loads `axplug.testing.pytest_plugin` in every session, and a
# test that needs none of the kits pays for none of them (nor for jax).
_WHERE = {
    "GroupedMatmulConformance": "axplug.testing._grouped_kernel",
    "group_size_cases": "axplug.testing._grouped_kernel",
    "HFCheck": "axplug.testing._hf",
    "check_against_transformers": "axplug.testing._hf",
    "tiny_transformers_model": "axplug.testing._hf",
    "KERNEL_CAPABILITIES": "axplug.testing._kernel",
    "KernelConformance": "axplug.testing._kernel",
    "abstract_call": "axplug.testing._kernel",
    "reference_kernel": "axplug.testing._kernel",
    "LAYER_CAPABILITIES": "axplug.testing._layer",
    "LayerConformance": "axplug.testing._layer",
    "MESH_RULE_CAPABILITIES": "axplug.testing._mesh_rule",
    "MeshRuleConformance": "axplug.testing._mesh_rule",
    "PagedKernelConformance": "axplug.testing._paged_kernel",
    "make_paged_problem": "axplug.testing._paged_kernel",
    "paged_reference": "axplug.testing._paged_kernel",
    "STORAGE_CAPABILITIES": "axplug.testing._storage",
    "StorageConformance": "axplug.testing._storage",
    "tiny_train_args": "axplug.testing._trainer",
    "tiny_trainer_config": "axplug.testing._trainer",
    "train_steps": "axplug.testing._trainer",
    "TraceCounter": "axplug.testing._util",
    "assert_finite": "axplug.testing._util",
    "sum_of_squares": "axplug.testing._util",
    "expected_writer_scalars": "axplug.testing._writer",
    "metrics_as_tags": "axplug.testing._writer",
    "scalars_match": "axplug.testing._writer",
    "CliResult": "axplug.testing._cli",
    "run_cli": "axplug.testing._cli",
    "FakeSite": "axplug.testing._fake_site",
}

__all__ = [
    "HFCheck",
    "check_against_transformers",
    "tiny_transformers_model",
    "LAYER_CAPABILITIES",
    "KERNEL_CAPABILITIES",
    "MESH_RULE_CAPABILITIES",
    "STORAGE_CAPABILITIES",
    "LayerConformance",
    "KernelConformance",
    "GroupedMatmulConformance",
    "MeshRuleConformance",
    "PagedKernelConformance",
    "StorageConformance",
    "TraceCounter",
    "abstract_call",
    "assert_finite",
    "make_paged_problem",
    "paged_reference",
    "reference_kernel",
    "sum_of_squares",
    "group_size_cases",
    "expected_writer_scalars",
    "metrics_as_tags",
    "scalars_match",
    "tiny_train_args",
    "tiny_trainer_config",
    "train_steps",
    "CliResult",
    "run_cli",
    "FakeSite",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'axplug.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
