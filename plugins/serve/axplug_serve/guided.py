"""Structured outputs in requests: OpenAI's `response_format` (`json_schema`, `json_object`)
and vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`, compiled by an
`axplug.guides` plugin (axplug-structured's `llguidance`) into a constraint per generation."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from collections.abc import Callable
from typing import Any

from axplug.api import registry
from axplug_serve.protocol import invalid

__all__ = ["Guides", "guide_spec"]

_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_KEPT = 64  # compiled specs kept: a client sending one schema with each request compiles once


def guide_spec(body: Any) -> tuple[str, Any, str] | None:
    """(kind, spec, field) of what `body` asks its text to match; None for free text. One
    400 for a malformed spec or for two at once."""
    asked: list[tuple[str, Any, str]] = []
    if (fmt := body.response_format) is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append(("json_object", None, "response_format"))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise invalid(
                    "response_format.json_schema.schema: give the schema as a JSON object, as "
                    "in {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                    "response_format",
                )
            asked.append(("json_schema", schema, "response_format"))
        elif kind != "text":
            raise invalid(
                f"response_format.type: {kind!r:.40} is not 'text', 'json_object' or 'json_schema'",
                "response_format",
            )
    for field, kind in _GUIDED.items():
        if (value := getattr(body, field)) is None:
            continue
        if field == "guided_json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid("guided_json: not valid JSON; give a JSON schema", field) from None
        asked.append((kind, value, field))
    if len(asked) > 1:
        raise invalid(
            f"{asked[0][2]} and {asked[1][2]}: ask for one structured output at a time",
            asked[1][2],
        )
    return asked[0] if asked else None


class Guides:
    """The server's guide (`name`, or llguidance's when installed, else the first installed),
    bound to the model's tokenizer on first use, and the last specs it compiled."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, name: str | None = None):
        self.name, self._tokenizer, self._vocab_size = name, tokenizer, vocab_size
        self._guide: Any = None
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # requests compile on worker threads

    async def constraints(self, body: Any) -> Callable | None:
        """A maker of `body`'s constraint, one per generation; None for free text. Compiling
        runs off the event loop; a request without a spec never leaves it."""
        if (spec := guide_spec(body)) is None:
            return None
        return await asyncio.to_thread(self.compiled, *spec)

    def compiled(self, kind: str, value: Any, field: str) -> Callable:
        """A maker of constraints for `value` of `kind`; 400s name `field`."""
        key = (kind, json.dumps(value, sort_keys=True))
        with self._lock:
            if (made := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
                return made
            guide = self._bound(field)
            if kind not in guide.kinds:
                raise invalid(f"{field}: the {self.name} guide does not compile {kind}", field)
            try:
                made = guide.compile(kind, value)
            except ValueError as exc:
                raise invalid(f"{field}: {exc}", field) from None
            self._compiled[key] = made
            if len(self._compiled) > _KEPT:
                self._compiled.popitem(last=False)
            return made

    def _bound(self, field: str) -> Any:
        if self._guide is not None:
            return self._guide
        names = registry.names("guides")
        if not names:
            raise invalid(
                f"{field}: structured outputs need a guide plugin, and none is installed: "
                "pip install axplug-structured",
                field,
            )
        self.name = self.name or ("llguidance" if "llguidance" in names else sorted(names)[0])
        guide = registry.load("guides", self.name).default_config().instantiate()
        try:
            guide.bind(self._tokenizer, self._vocab_size or self._tokenizer.vocab_size)
        except ValueError as exc:
            raise invalid(f"{field}: {exc}", field) from None
        self._guide = guide
        return guide
