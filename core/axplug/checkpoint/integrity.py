"""What a step holds against what was saved or is asked for: the comparisons behind
`Checkpointer.restore` and `verify`, as messages (None when nothing differs)."""

from __future__ import annotations

from typing import Any

import jax

from axplug.checkpoint.checksum import leaf_names

__all__ = ["checksum_mismatch", "layout_mismatch", "first_line"]


def first_line(exc: BaseException) -> str:
    """`Type: first line` of an error whose message may run to a TensorStore dump."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def checksum_mismatch(saved: dict[str, str], actual: dict[str, str]) -> str | None:
    """The leaves whose checksum differs from the saved one, or None."""
    bad = [name for name, value in actual.items() if saved.get(name, value) != value]
    if not bad:
        return None
    shown = ", ".join(f"{n} (saved {saved[n]}, read {actual[n]})" for n in bad[:3])
    return shown + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        n: (tuple(x.shape), str(x.dtype))
        for n, x in zip(leaf_names(tree), jax.tree.leaves(tree), strict=True)
    }


def layout_mismatch(saved_tree: Any, abstract: Any) -> str | None:
    """Where the arrays `abstract` asks for differ from a step's (array metadata tree), params
    first, or None."""
    saved, wanted = _shapes(saved_tree), _shapes(abstract)
    if saved == wanted:
        return None

    def order(names):
        return sorted(names, key=lambda n: (not n.startswith("params/"), n))

    problems = [
        f"{n}: saved {saved[n][1]}{list(saved[n][0])}, here {wanted[n][1]}{list(wanted[n][0])}"
        for n in order(saved.keys() & wanted.keys())
        if saved[n] != wanted[n]
    ]
    problems += [f"missing here: {n}" for n in order(saved.keys() - wanted.keys())]
    problems += [f"not in the checkpoint: {n}" for n in order(wanted.keys() - saved.keys())]
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    return "; ".join(problems[:4]) + more
