"""The conformance kit `axplug_testing`: adopted for core components, and catching broken ones."""

import jax
import jax.numpy as jnp
import pytest
from axplug_testing import (
    KernelConformance,
    LayerConformance,
    MeshRuleConformance,
    StorageConformance,
    reference_kernel,
)
from axplug_testing._kernel import CASES, make_problem

from axplug.api import ParameterSpec
from axplug.config import config_class
from axplug.layers import DotProductKernel, FeedForward
from axplug.layers.base import BaseLayer

# -- adoption: what a plugin author writes -------------------------------------------------


class TestFeedForwardConformance(LayerConformance):
    @pytest.fixture
    def layer_config(self):
        return FeedForward.default_config().set(input_dim=16, hidden_dim=32)


class TestUngatedFeedForwardConformance(LayerConformance):
    capabilities = ("differentiable", "shardable")  # declared: no llama-tiny training run

    @pytest.fixture
    def layer_config(self):
        return FeedForward.default_config().set(
            input_dim=8, hidden_dim=16, gated=False, activation="gelu"
        )


class CoreKernel:
    """The core DotProductKernel behind the `axplug.kernels` protocol."""

    def __call__(self, query, key, value, mask, *, scale):
        from axplug.context import functional

        layer = DotProductKernel.default_config().set(name="k", scale=scale)
        out, _ = functional(
            layer.instantiate(parent=None), prng_key=None, state={},
            inputs=(query, key, value, mask), is_training=False,
        )  # fmt: skip
        return out


class TestCoreKernelConformance(KernelConformance):
    @pytest.fixture
    def kernel(self):
        return CoreKernel()


class TestLocalStorageConformance(StorageConformance):
    @pytest.fixture
    def storage(self):
        from axplug.checkpoint.storage import LocalStorage

        return LocalStorage()


# -- the kit catches broken components ------------------------------------------------------


class WrongShapeLayer(BaseLayer):
    """Its spec says [d, d] but it initializes [d, d + 1]."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: int = 4
        mesh_axis: str | None = "embed"

    def _create_layer_parameter_specs(self):
        d = self._config.input_dim
        init = jax.nn.initializers.normal()
        return {"w": ParameterSpec((d, d), jnp.float32, (self._config.mesh_axis, None), init)}

    def initialize_parameters_recursively(self, prng_key):
        d = self._config.input_dim
        return {"w": jax.random.normal(prng_key, (d, d + 1))}

    def forward(self, x):
        return x @ self.parameters["w"][:, : self._config.input_dim]


class NaNGradLayer(BaseLayer):
    """Finite outputs, NaN gradients: sqrt of an exact zero."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: int = 4

    def _create_layer_parameter_specs(self):
        d = self._config.input_dim
        return {"w": ParameterSpec((d, d), jnp.float32, ("embed", "mlp"), jax.nn.initializers.ones)}

    def forward(self, x):
        w = self.parameters["w"]
        return x @ w * jnp.sqrt(jnp.sum(w - w))


class Kit(LayerConformance):
    """Calls the kit's checks directly, with the fixtures' values passed by hand."""


def _inputs(d=4):
    return (jax.random.normal(jax.random.PRNGKey(0), (4, 8, d)),)


def test_kit_rejects_specs_that_do_not_match_parameters():
    cfg = WrongShapeLayer.default_config()
    with pytest.raises(AssertionError, match=r"params\['w'\]: initialized shape \(4, 5\)"):
        Kit().test_parameter_specs_match_initialized_shapes(cfg)


def test_kit_rejects_unknown_mesh_axes():
    class GoodShape(WrongShapeLayer):
        initialize_parameters_recursively = BaseLayer.initialize_parameters_recursively

    cfg = GoodShape.default_config().set(mesh_axis="hidden")
    with pytest.raises(AssertionError, match="mesh axis 'hidden' is not a logical axis"):
        Kit().test_parameter_specs_match_initialized_shapes(cfg)


def test_kit_rejects_nan_gradients():
    cfg = NaNGradLayer.default_config()
    Kit().test_jit_forward_traces_once(cfg, _inputs(), {"rtol": 1e-5})  # forward is fine
    with pytest.raises(AssertionError, match=r"grad\['w'\] is not finite"):
        Kit().test_gradients_are_finite(cfg, _inputs())


def test_trace_counter_sees_retraces():
    from axplug_testing import TraceCounter

    counter = TraceCounter(lambda x: x * 2)
    fn = jax.jit(counter)
    fn(jnp.ones(3))
    fn(jnp.zeros(3))
    assert counter.count == 1
    fn(jnp.ones(4))  # a new shape: what the kit's trace-count check fails on
    assert counter.count == 2


def test_kit_rejects_a_kernel_that_ignores_the_mask():
    class NoMask:
        def __call__(self, q, k, v, mask, *, scale):
            mask = mask.__class__(
                q_positions=mask.q_positions, kv_positions=mask.kv_positions, causal=False
            )
            return CoreKernel()(q, k, v, mask, scale=scale)

    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        KernelConformance().test_matches_reference(
            NoMask(), reference_kernel(), "mha_causal", jnp.float32, {"rtol": 1e-5, "atol": 1e-5}
        )


def test_paged_kit_rejects_a_kernel_that_ignores_lengths_or_reads_every_page():
    from axplug_testing import PagedKernelConformance

    from axplug.kernels import paged_attention_xla

    class WholeRows:  # attends over every slot of its pages, whatever the length
        paged = True

        def __call__(self, query, paged, *, scale):
            full = paged._replace(lengths=jnp.full_like(paged.lengths, 10**6))
            return paged_attention_xla(query, full, scale=scale)

    class EveryPage:  # reads the whole pool: a NaN in a page nobody owns spoils it
        paged = True

        def __call__(self, query, paged, *, scale):
            out = paged_attention_xla(query, paged, scale=scale)
            return out + 0 * paged.value_pages.sum()

    kit = PagedKernelConformance()
    tolerance = {"rtol": 1e-4, "atol": 1e-4}
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        kit.test_matches_attention_over_the_gathered_rows(
            WholeRows(), jnp.float32, tolerance, {}, "gqa"
        )
    with pytest.raises(AssertionError):
        kit.test_reads_only_the_pages_its_table_names(EveryPage(), jnp.float32, {})


def test_undeclared_capabilities_skip_with_the_reason():
    class NoGQA(KernelConformance):
        capabilities = ("non_causal",)

    with pytest.raises(pytest.skip.Exception, match="does not declare capability 'gqa'"):
        NoGQA()._case("gqa")


def test_unknown_capabilities_are_an_error():
    class Typo(LayerConformance):
        capabilities = ("sharable",)

    with pytest.raises(AssertionError, match="unknown capabilities"):
        Typo().test_capabilities_are_known()


def test_kernel_problems_are_valid():
    for case in CASES.values():
        q, k, v, mask = make_problem(case)
        assert mask.dense().any(axis=-1).all(), "every query must see at least one key"


def test_kit_rejects_storage_whose_delete_leaves_files(tmp_path):
    from axplug.checkpoint.storage import LocalStorage

    class NoRecursiveDelete(LocalStorage):
        def delete(self, url):
            import os

            if os.path.isfile(self._local(url)):
                os.remove(self._local(url))

    with pytest.raises(AssertionError):
        StorageConformance().test_delete_file_tree_and_missing(NoRecursiveDelete(), str(tmp_path))


# -- mesh rules ------------------------------------------------------------------------------


class TestCpuMeshRuleConformance(MeshRuleConformance):
    capabilities = ("registered",)  # the core's CPU rule carries no DeviceSpec

    @pytest.fixture
    def rule(self):
        from axplug.mesh_rules import cpu_rule

        return cpu_rule

    @pytest.fixture
    def rule_name(self):
        return "cpu"

    @pytest.fixture
    def selectors(self):
        return ["cpu-1", "cpu-8"]


def _rule(pattern="gpu-*l40s*-8", modifiers=("mesh:fsdp=8",), description="L40S, one host"):
    from axplug.mesh_rules import MeshRule

    return lambda: MeshRule.default_config().set(
        pattern=pattern, modifiers=list(modifiers), description=description
    )


def test_kit_rejects_a_rule_that_claims_every_machine():
    with pytest.raises(AssertionError, match=r"also matches \['cpu-1', 'cpu-8'"):
        MeshRuleConformance().test_matches_no_other_selector(_rule(pattern="*"), ["cpu-1", "cpu-8"])


def test_kit_rejects_a_rule_that_misses_its_selectors():
    with pytest.raises(AssertionError, match=r"does not match \['gpu-nvidia-l40s-8x2'\]"):
        MeshRuleConformance().test_matches_its_selectors(
            _rule(), ["gpu-l40s-8", "gpu-nvidia-l40s-8x2"]
        )


def test_kit_rejects_unregistered_modifiers_and_meshes_that_do_not_fit():
    kit = MeshRuleConformance()
    with pytest.raises(AssertionError, match="modifier spec 'flash_atention'"):
        kit.test_modifiers_are_registered(_rule(modifiers=("mesh:fsdp=8", "flash_atention")))
    with pytest.raises(AssertionError, match=r"does not fit the 16 devices of 'gpu-l40s-16'"):
        kit.test_mesh_fits_the_selector_device_count(_rule(), ["gpu-l40s-16"], ["gpt-tiny"])


SHADOWED_RULE = """
from axplug.mesh_rules import MeshRule

def my_cpu():
    return MeshRule.default_config().set(pattern="cpu-*", modifiers=["mesh:fsdp=-1"])
"""


def test_kit_rejects_a_rule_another_installed_rule_shadows(plugin_site):
    plugin_site.add(
        "fake-rules", {"axplug.mesh_rules": {"my-cpu": "fake_rules:my_cpu"}},
        modules={"fake_rules": SHADOWED_RULE},
    )  # fmt: skip

    class Registered(MeshRuleConformance):
        capabilities = ("registered",)

    with pytest.raises(AssertionError, match="'no-such-rule' is not installed"):
        Registered().test_selected_among_installed_rules("no-such-rule", ["cpu-4"])
    # Rules are tried by name: the core's `cpu` comes first and also matches `cpu-4`.
    with pytest.raises(AssertionError, match="picks installed rule 'cpu', not 'my-cpu'"):
        Registered().test_selected_among_installed_rules("my-cpu", ["cpu-4"])


class ShardedGradBugLayer(BaseLayer):
    """Same forward everywhere, but its gradient is 1.5x once traced for a second input layout
    (a stand-in for a custom VJP that mishandles sharded operands)."""

    traces = 0

    @config_class
    class Config(BaseLayer.Config):
        input_dim: int = 8

    def _create_layer_parameter_specs(self):
        d = self._config.input_dim
        return {"w": ParameterSpec((d, d), jnp.float32, ("embed", "mlp"), jax.nn.initializers.ones)}

    def forward(self, x):
        y = x @ self.parameters["w"]
        ShardedGradBugLayer.traces += 1
        if ShardedGradBugLayer.traces > 2:  # the sharded forward and grad traces
            y = y + 0.5 * (y - jax.lax.stop_gradient(y))
        return y


def test_kit_compares_sharded_gradients_not_only_outputs():
    ShardedGradBugLayer.traces = 0
    cfg = ShardedGradBugLayer.default_config()
    with pytest.raises(AssertionError, match=r"sharded grad\['w'\]"):
        Kit().test_sharded_matches_one_device(
            cfg, (jnp.ones((4, 8, 8)),), (2, 2, 1, 1, 2), {"rtol": 1e-5, "atol": 1e-5}
        )
    assert ShardedGradBugLayer.traces == 4, "one-device and sharded forward and grad"


def test_default_swap_target_is_refused_for_a_layer_that_is_not_a_feed_forward():
    # A norm plugin forgetting `swap_target` would otherwise "train in its preset" by
    # replacing every FeedForward with a norm.
    from axplug.layers import FeedForward, RMSNorm

    swap_target = LayerConformance.swap_target.__wrapped__
    norm = RMSNorm.default_config().set(input_dim=16)
    with pytest.raises(NotImplementedError, match=r"lacks its required fields \['hidden_dim'\]"):
        swap_target(LayerConformance(), norm)
    ffn = FeedForward.default_config().set(input_dim=16, hidden_dim=32)
    assert swap_target(LayerConformance(), ffn) is FeedForward


def test_a_swap_modifier_that_adds_nothing_fails_the_training_check(tmp_path):
    from axplug.layers import RMSNorm

    class InLlama(LayerConformance):
        swap_preset = "llama-tiny"

    norm = RMSNorm.default_config().set(input_dim=16)
    with pytest.raises(AssertionError, match="swap_modifier left no RMSNorm in llama-tiny"):
        InLlama().test_trains_in_the_swap_preset(norm, lambda cfg: _without_norms(cfg), tmp_path)


def _without_norms(cfg):
    from axplug.config import replace_config
    from axplug.layers import LayerNorm, RMSNorm

    return replace_config(cfg, target=RMSNorm, new_cfg=LayerNorm.default_config())
