"""How `axplug aot` makes a config's compile stand for its target: kernels chosen for the
target platform when it compiles there, and, when it compiles on CPU for an accelerator, the
flash-attention slots as the blockwise kernel and bfloat16 as float16 (see ARCHITECTURE.md)."""

from __future__ import annotations

__all__ = ["plan_flash_attention", "kernels_for", "plan_bfloat16"]


def plan_flash_attention(cfg, platform: str):
    """(config, note): the rule's flash-attention slots as the blockwise kernel, whose memory
    is a flash kernel's, for a CPU compile that plans `platform`."""
    import jax

    from axplug.api.config import find_configs, replace_config
    from axplug.api.layers import BlockwiseAttention, FlashAttention

    where = f"compiled for {jax.default_backend()}, planning {platform}"
    if not find_configs(cfg, FlashAttention):
        note = (
            f"{where}: attention is the plain XLA kernel, as it would be there (no "
            "flash_attention slot), keeping [batch, heads, seq, seq] scores"
        )
        return cfg, note
    new = BlockwiseAttention.default_config()
    cfg = replace_config(cfg, target=FlashAttention, new_cfg=new)
    note = (
        f"{where}: flash attention assumed, compiled as the blockwise XLA kernel (O(seq) "
        f"memory like the {platform} flash kernel; its scratch is one [seq, 512] block of scores)"
    )
    return cfg, note


def kernels_for(cfg, platform: str):
    """`cfg` with its flash-attention slots choosing kernels for `platform`, not this host."""
    from axplug.api.config import find_configs
    from axplug.api.layers import FlashAttention

    cfg = cfg.clone()
    for _, slot in find_configs(cfg, FlashAttention):
        slot.backend = platform
    return cfg


def plan_bfloat16(cfg):
    """(config, note): bfloat16 settings as float16 for a CPU compile that plans an accelerator.

    XLA:CPU cannot update bf16 buffers in place, so it widens every bf16 scan stack (the
    activations a remat policy saves, the stacked gradients) to f32 and doubles their bytes;
    float16 has bf16's width and stays 2 bytes there, as bf16 does on GPU/TPU/Trainium.
    """
    import copy

    from axplug.api.config import ConfigBase

    cfg = copy.deepcopy(cfg)
    changed = []

    def walk(node, path):
        if isinstance(node, list | tuple):
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]")
            return
        if not isinstance(node, ConfigBase):
            return
        for key, value in node.items():
            if isinstance(value, str) and value == "bfloat16":
                setattr(node, key, "float16")
                changed.append(f"{path}.{key}".lstrip("."))
            else:
                walk(value, f"{path}.{key}")

    walk(cfg, "")
    if not changed:
        return cfg, None
    note = (
        f"bfloat16 compiled as float16 ({', '.join(changed)}): the same 2 bytes, which XLA:CPU "
        "would otherwise widen to f32 in scanned activations and gradients"
    )
    return cfg, note
