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
trainer config a test runs: a preset shrunk to train in seconds, no compilation cache;
`tiny_train_args(...)` is the same run as `axplug train` arguments. A summary writer's tests
compare what it received with the run's own metrics.jsonl (`expected_writer_scalars`,
`metrics_as_tags`, `scalars_match`).
"""

from axplug.testing._grouped_kernel import GroupedMatmulConformance, group_size_cases
from axplug.testing._hf import HFCheck, check_against_transformers, tiny_transformers_model
from axplug.testing._kernel import (
    KERNEL_CAPABILITIES,
    KernelConformance,
    abstract_call,
    reference_kernel,
)
from axplug.testing._layer import LAYER_CAPABILITIES, LayerConformance
from axplug.testing._mesh_rule import MESH_RULE_CAPABILITIES, MeshRuleConformance
from axplug.testing._paged_kernel import (
    PagedKernelConformance,
    make_paged_problem,
    paged_reference,
)
from axplug.testing._storage import STORAGE_CAPABILITIES, StorageConformance
from axplug.testing._trainer import tiny_train_args, tiny_trainer_config
from axplug.testing._util import TraceCounter, assert_finite, sum_of_squares
from axplug.testing._writer import expected_writer_scalars, metrics_as_tags, scalars_match

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
]
