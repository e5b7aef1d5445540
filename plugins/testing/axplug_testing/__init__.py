"""Conformance kit for plugin authors: subclass one class, override a few fixtures.

```python
import pytest
from axplug_testing import LayerConformance
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

`tiny_trainer_config(tmp_path, "log_every=1", preset="gpt-tiny", max_steps=4)` is the
trainer config a test runs: a preset shrunk to train in seconds; `train_steps(trainer, n)`
calls its built train step without a run;
`tiny_train_args(...)` is the same run as `axplug train` arguments; `random_params(model,
seed)` draws a model's parameters with numpy (no program per op and shape). A summary writer's tests
compare what it received with the run's own metrics.jsonl (`expected_writer_scalars`,
`metrics_as_tags`, `scalars_match`).
"""

import importlib

# Imported on first use: pytest loads `axplug_testing.pytest_plugin` in every session, and a
# test that needs none of the kits pays for none of them (nor for jax).
_MODULES = {
    "_grouped_kernel": "GroupedMatmulConformance group_size_cases",
    "_kernel": "KERNEL_CAPABILITIES KernelConformance abstract_call reference_kernel",
    "_layer": "LAYER_CAPABILITIES LayerConformance",
    "_mesh_rule": "MESH_RULE_CAPABILITIES MeshRuleConformance",
    "_paged_kernel": "PagedKernelConformance make_paged_problem paged_reference",
    "_storage": "STORAGE_CAPABILITIES StorageConformance",
    "_trainer": "tiny_train_args tiny_trainer_config train_steps",
    "_util": "TraceCounter assert_finite random_params sum_of_squares",
    "_writer": "expected_writer_scalars metrics_as_tags scalars_match",
    "_cli": "CliResult cli_main command_parser run_cli train_config",
    "_fake_site": "FakeSite",
    "pytest_plugin": "copy_run production_compiler_options xla_flags",
}
_WHERE = {
    name: f"axplug_testing.{module}" for module, names in _MODULES.items() for name in names.split()
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'axplug_testing' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
