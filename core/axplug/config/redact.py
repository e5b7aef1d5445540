"""URIs without their user info (`https://user:token@host/x` -> `https://host/x`), for every
file a run writes: config.txt, config.json, checkpoint metadata."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["has_userinfo", "strip_userinfo", "strip_userinfo_tree"]

# `scheme://` then an authority holding `@` before any `/`, `?`, `#`, space or quote. A path's
# `@` (`s3://bucket/tok@v1`) is left alone.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s\"'\\]*@")


def has_userinfo(text: str) -> bool:
    """True when `text` holds a URI with user info (`user:password@`, a token)."""
    return _USERINFO.search(text) is not None


def strip_userinfo(text: str) -> str:
    """`text` with the user info of each URI in it removed."""
    return _USERINFO.sub(r"\g<scheme>", text)


def strip_userinfo_tree(tree: Any) -> Any:
    """A copy of a JSON-like tree (dicts, lists, strings) with every string's URIs stripped."""
    if isinstance(tree, str):
        return strip_userinfo(tree)
    if isinstance(tree, dict):
        return {key: strip_userinfo_tree(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(strip_userinfo_tree(value) for value in tree)
    return tree
