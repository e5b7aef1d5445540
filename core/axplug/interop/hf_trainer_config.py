"""An axplug trainer config for a Hugging Face model: a stock preset's recipe, the HF shapes, and
the installed plugins' modifiers (`rope`, `gqa`, `moe`) set to the HF hyperparameters."""

from __future__ import annotations

from collections.abc import Sequence

from axplug.config import apply_overrides, replace_config
from axplug.interop.hf_config import HFImportError, HFModelConfig
from axplug.layers import RepeatedTransformer, StackedTransformer
from axplug.presets import Preset, llama2_7b, mixtral_8x7b
from axplug.trainer import Trainer

__all__ = ["hf_modifier_specs", "hf_trainer_config"]

# The preset whose recipe (learner, input, layer composition) an imported model starts from.
_PRESETS: dict[str, Preset] = {
    "LlamaForCausalLM": llama2_7b,
    "MixtralForCausalLM": mixtral_8x7b,
}


def hf_modifier_specs(hf: HFModelConfig) -> list[str]:
    """The modifier specs that give the stock layers the HF model's attention and FFN."""
    rope = f"rope:theta={hf.rope_theta!r},interleaved=False"
    if hf.rope_llama3 is not None:
        s = hf.rope_llama3
        rope += (
            f",scaling_factor={float(s['factor'])!r}"
            f",low_freq_factor={float(s['low_freq_factor'])!r}"
            f",high_freq_factor={float(s['high_freq_factor'])!r}"
            f",original_max_position={int(s['original_max_position_embeddings'])}"
        )
    specs = [rope]
    if hf.num_kv_heads != hf.num_heads:
        specs.append(f"gqa:num_kv_heads={hf.num_kv_heads}")
    if hf.is_moe:
        # Hugging Face's Mixtral: softmax over all experts, top-k, renormalized, no drops, no
        # z-loss; its balance loss counts every one of the k choices, axplug's their mean.
        balance = hf.router_aux_loss_coef * hf.top_k
        specs.append(
            f"moe:num_experts={hf.num_experts},top_k={hf.top_k},capacity_factor=None,"
            f"renormalize=True,load_balance_coefficient={balance!r},z_loss_coefficient=0.0"
        )
    return specs


def _check_installed(hf: HFModelConfig, preset: Preset, specs: Sequence[str]) -> None:
    from axplug import registry
    from axplug.modifiers import parse_modifier_spec

    for spec in specs:
        name, _ = parse_modifier_spec(spec)
        try:
            component = registry.entry("modifiers", name)
        except LookupError:
            package = preset.providers.get(name)
            hint = f": pip install {package}" if package else "; see `axplug list --kind modifiers`"
            raise HFImportError(
                f"importing a {hf.architecture} needs modifier {name!r}{hint}"
            ) from None
        if not component.loadable:
            raise HFImportError(
                f"importing a {hf.architecture} needs modifier {name!r} from "
                f"{component.distribution}, which is {component.status}: {component.reason}"
            )


def hf_trainer_config(
    hf: HFModelConfig,
    *,
    output_dir: str,
    modifiers: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> Trainer.Config:
    """The trainer config of the imported model, then `modifiers`, then `overrides`.

    The layer stack is unrolled (`StackedTransformer`); `scan_layers` in `modifiers` scans it.
    """
    from axplug.modifiers import make_modifier

    preset = _PRESETS[hf.architecture]
    specs = hf_modifier_specs(hf)
    _check_installed(hf, preset, specs)
    cfg = preset.build()
    cfg.model.compute_dtype = hf.compute_dtype
    decoder = cfg.model.decoder
    decoder.set(
        vocab_size=hf.vocab_size, dim=hf.hidden_size, tie_word_embeddings=hf.tie_word_embeddings
    )
    decoder.output_norm.eps = hf.rms_norm_eps
    transformer = decoder.transformer.set(num_layers=hf.num_layers)
    layer = transformer.layer
    layer.norm.eps = hf.rms_norm_eps
    layer.attention.set(num_heads=hf.num_heads)
    if hf.head_dim * hf.num_heads != hf.hidden_size:
        layer.attention.head_dim = hf.head_dim
    layer.feed_forward.hidden_dim = hf.intermediate_size
    cfg = replace_config(
        cfg,
        target=RepeatedTransformer,
        new_cfg=StackedTransformer.default_config(),
        carry=["layer", "num_layers"],
        missing_ok=True,
    )
    if hf.max_position_embeddings:
        cfg.input.seq_len = min(cfg.input.seq_len, hf.max_position_embeddings)
    cfg.output_dir = output_dir
    for spec in (*specs, *modifiers):
        cfg = make_modifier(spec)(cfg)
    return apply_overrides(cfg, overrides)
