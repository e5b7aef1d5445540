"""The `llguidance` guide: JSON schemas, regular expressions, choices and grammars compiled by
llguidance (a Rust parser whose token masks take tens of microseconds), one matcher per
request walking the tokens it samples."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np

from axplug.api.config import config_class
from axplug.api.run import Guide, TokenConstraint
from axplug_structured.tokens import llg_tokenizer

__all__ = ["GuidedConstraint", "LLGuidanceGuide"]


class GuidedConstraint(TokenConstraint):
    """One request's llguidance matcher: the tokens its grammar allows next."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._mask = np.zeros((tokenizer.vocab_size + 31) // 32, np.int32)

    def fill(self, words: np.ndarray) -> None:
        # The matcher's vocabulary may hold one more token, an end of text the model lacks.
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        words[:] = self._mask[: words.size]

    def accept(self, token: int) -> bool:
        # A token the mask did not allow cannot come; were it to, the request ends there.
        return not self._matcher.consume_token(token) or self._matcher.is_stopped()


class LLGuidanceGuide(Guide):
    """Structured outputs with llguidance: `json_schema` (draft 2020-12, most keywords; see
    llguidance's docs/json_schema.md), `json_object`, `regex` (Rust regex syntax), `choice`
    and `grammar` (Lark-like or GBNF). JSON comes compact with OpenAI's separators (`, ` and
    `: `) unless `whitespace_flexible`."""

    kinds = ("json_schema", "json_object", "regex", "choice", "grammar")

    @config_class
    class Config(Guide.Config):
        whitespace_flexible: bool = False  # JSON: any whitespace between tokens

    def bind(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = llg_tokenizer(tokenizer, vocab_size)

    def compile(self, kind: str, spec: Any) -> Callable[[], TokenConstraint]:
        grammar = self._grammar(kind, spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if failed:
            raise ValueError(f"{kind}: {messages[0]}")
        return functools.partial(GuidedConstraint, self._tokenizer, grammar)

    def _grammar(self, kind: str, spec: Any) -> str:
        matcher = llguidance.LLMatcher
        flexible = self.config.whitespace_flexible
        options: Any = {"whitespace_flexible": flexible}
        if not flexible:
            options.update(item_separator=", ", key_separator=": ")
        if kind == "json_schema":
            if not isinstance(spec, dict):
                raise ValueError(f"json_schema: a schema is a JSON object, not {spec!r:.60}")
            return matcher.grammar_from_json_schema(json.dumps(spec), defaults=options)
        if kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if kind == "choice":
            if not (spec and isinstance(spec, list) and all(isinstance(c, str) for c in spec)):
                raise ValueError(f"choice: give a non-empty list of strings, not {spec!r:.60}")
            return matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec)))
        if not isinstance(spec, str):
            raise ValueError(f"{kind}: give the {kind} as a string, not {spec!r:.60}")
        if kind == "regex":
            return matcher.grammar_from_regex(spec)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
        raise ValueError(f"the llguidance guide compiles {', '.join(self.kinds)}, not {kind!r}")
