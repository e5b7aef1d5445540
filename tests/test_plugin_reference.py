"""docs/plugin-reference.md checked against the code: every entry-point group and hook with its
signature, the slot contracts and the attention mask's fields as coded."""

from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "plugin-reference.md"


def test_plugin_reference_covers_every_group_and_hook():
    import inspect

    from axplug import hookspecs
    from axplug.api.registry import KINDS as GROUPS
    from axplug.api.registry import SUPPORTED_PLUGIN_API

    text = REFERENCE.read_text()
    for group in ("plugin_api", *GROUPS):
        assert f"### `axplug.{group}`" in text or group == "plugin_api", group
        assert f"`axplug.{group}`" in text, group
    rows = {line.split("`")[1].split("(")[0]: line.split("`")[1] for line in text.splitlines()
            if line.startswith("| `") and "(" in line.split("`")[1]}  # fmt: skip
    for name in hookspecs.__all__:
        if not hasattr(getattr(hookspecs, name), "axplug_spec"):
            continue  # not a hook
        assert name in rows, f"hook {name} is not documented"
        documented = [
            arg.split(":")[0].strip() for arg in rows[name][len(name) + 1 : -1].split(",")
        ]
        actual = list(inspect.signature(getattr(hookspecs, name)).parameters)
        assert documented == actual, f"hook {name}: documented {documented}, defined {actual}"
    lo, hi = SUPPORTED_PLUGIN_API
    assert f"loads **{lo} to {hi}**" in text, "update the documented window"


def _signature(method) -> str:
    """`name(a, b, *, c)`: parameter names and kinds as the contract tables write them."""
    import inspect

    parts, star = [], False
    for p in list(inspect.signature(method).parameters.values())[1:]:  # not self
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name)
    return f"{method.__name__}({', '.join(parts)})"


def test_slot_contracts_and_attention_mask_are_documented_as_coded():
    import dataclasses

    from axplug.api import AttentionMask
    from axplug.api.layers import (
        ContiguousKVCache,
        DotProductKernel,
        FeedForward,
        FlashAttention,
        IdentityPositionTransform,
        PagedKVCache,
        QKVLinear,
    )

    text = REFERENCE.read_text()
    table = text[text.index("#### Slot contracts") : text.index("`AttentionMask` (`axplug")]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    documented = [(r[0].strip("| `"), r[2].split("`")[1]) for r in rows]
    fillers = {  # the core default first, then the first-party alternatives
        "Attention.qkv": [QKVLinear],
        "Attention.position": [IdentityPositionTransform],
        "Attention.kernel": [DotProductKernel, FlashAttention],
        "Attention.kv_cache": [ContiguousKVCache, PagedKVCache],
        "TransformerLayer.feed_forward": [FeedForward],
    }
    try:
        from axplug_attention.gqa import GroupedQKVLinear
        from axplug_attention.rope import RotaryPositionTransform

        fillers["Attention.qkv"].append(GroupedQKVLinear)
        fillers["Attention.position"].append(RotaryPositionTransform)
    except ImportError:
        pass
    try:
        from axplug_moe import MoEFeedForward

        fillers["TransformerLayer.feed_forward"].append(MoEFeedForward)
    except ImportError:
        pass
    assert {slot for slot, _ in documented} == set(fillers)
    for slot, contract in documented:
        method = contract.split("(")[0]
        for cls in fillers[slot]:
            assert _signature(getattr(cls, method)) == contract, (slot, cls.__name__)
    assert "num_kv_heads" in dir(QKVLinear) and "num_kv_heads" in dir(GroupedQKVLinear)

    mask_table = text[text.index("`AttentionMask` (`axplug") : text.index("`mask.dense()`")]
    mask_rows = [line.split(" | ") for line in mask_table.splitlines() if line.startswith("| `")]
    fields = dataclasses.fields(AttentionMask)
    assert [r[0].strip("| `") for r in mask_rows] == [f.name for f in fields]
    for row, field in zip(mask_rows, fields, strict=True):
        assert ("static" in row[1]) == bool(field.metadata.get("static")), field.name
