"""The `quantize` modifier: swaps the float projections for `QuantizedLinear` (or back)."""

from __future__ import annotations

from axplug.api.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    config_class,
    find_configs,
    replace_config,
)
from axplug.api.layers import Linear
from axplug_quantize.layer import QUANTIZE_MODES, QuantizedLinear

__all__ = ["QuantizeModifier"]


def _pipelined(cfg: ConfigBase) -> bool:
    """Whether a pipelined stack (axplug-pipeline's `pipelined_transformer`) is in `cfg`;
    named through the registry, so this plugin works with or without that one."""
    try:
        return bool(find_configs(cfg, "pipelined_transformer"))
    except ConfigError:  # axplug-pipeline is not installed: nothing is pipelined
        return False


class QuantizeModifier(ConfigModifier):
    """Quantized matmuls in the layers' projections: `quantize:int8`, `quantize:fp8`,
    `quantize:fp8_tensorwise`, `quantize:fp8_rowwise`, `quantize:mxfp8`, or `quantize:none`
    (back to float).

    int8: dynamic per-token x per-channel scales, int32 accumulation, int8 gradient matmuls
    unless `int8_backward=false`. fp8: e4m3 inputs and weights, e5m2 gradients, delayed
    scaling from `amax_history_length`-step histories. The current-scaling recipes take
    their scales from this step's tensors (axplug_quantize.recipes); mxfp8 needs the tokens
    and widths multiples of 32. `targets` names the sub-layers whose
    Linear layers are quantized (path components; MoE experts and the LM head stay float).
    """

    positional_option = "mode"

    @config_class
    class Config(ConfigModifier.Config):
        mode: str | None = "int8"  # None or "none": float
        targets: tuple[str, ...] = ("attention", "feed_forward")
        int8_backward: bool = True
        amax_history_length: int = 16

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        mode = "none" if c.mode is None else c.mode
        if mode not in (*QUANTIZE_MODES, "none"):
            raise ConfigError(
                f"modifier quantize: unknown mode {mode!r}; choose from {[*QUANTIZE_MODES, 'none']}"
            )
        if mode == "fp8" and _pipelined(cfg):
            raise ConfigError(
                "modifier quantize: fp8 amax histories are not kept per microbatch in a "
                "pipelined stack; use quantize:int8 or no `pipeline` modifier"
            )
        targets = set(c.targets)

        def under_targets(path, _old):
            return bool(targets & set(path.split(".")))

        # Back to float first, so re-applying with other options replaces them all.
        cfg = replace_config(
            cfg, target=QuantizedLinear, new_cfg=Linear.default_config(), missing_ok=True
        )
        if mode == "none":
            return cfg
        new = QuantizedLinear.default_config().set(
            mode=mode, int8_backward=c.int8_backward, amax_history_length=c.amax_history_length
        )
        return replace_config(cfg, target=Linear, new_cfg=new, where=under_targets)
