"""Verifiable rewards for GRPO: the `Reward` base, exact answers and formats (math
equivalence and code that passes its tests are `math_reward` and `code_reward`)."""

from __future__ import annotations

import inspect
import re
from typing import Any

from axplug.api.config import ConfigError

__all__ = ["Reward", "ExactMatch", "RegexReward", "option_error"]


class Reward:
    """A verifiable reward: `score(completion, sample)` -> a float, `sample` being the
    prompt's record (e.g. {"prompt": ..., "answer": "42"}).

    A reward declares its options as keyword arguments with defaults, e.g.
    `def __init__(self, *, field="answer", **options)`, passing the rest on to this class,
    which refuses them by name. Rewards are registered under the `axplug.rewards`
    entry-point group (name -> the Reward subclass), so a third party adds its own:
    `[project.entry-points."axplug.rewards"] my_reward = "my_pkg.rewards:MyReward"`.
    """

    name: str = "reward"

    def __init__(self, **options: Any):
        if options:
            known = ", ".join(self.known_options()) or "none"
            raise ConfigError(
                f"reward {self.name!r}: unknown option {', '.join(map(repr, options))}; "
                f"its options are: {known}"
            )

    @classmethod
    def known_options(cls) -> list[str]:
        """The option names `__init__` takes."""
        params = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]

    def score(self, completion: str, sample: dict) -> float:
        """The reward of one completion of `sample`'s prompt."""
        raise NotImplementedError(f"reward {self.name!r} does not define score()")

    def score_batch(self, completions: list[str], samples: list[dict]) -> list[float]:
        """The reward of each completion (of the prompt of the sample at the same index)."""
        return [self.score(c, s) for c, s in zip(completions, samples, strict=True)]

    def _field(self, sample: dict, field: str, what: str) -> Any:
        if not isinstance(sample, dict) or field not in sample:
            raise ValueError(
                f"{self.name}: the sample has no {field!r} field ({what}); "
                f"set {self.name}:field=NAME to the field that has it"
            )
        return sample[field]


def option_error(reward: str, option: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"reward {reward!r}: {option}={value!r}: must be {want}")


# ---- exact_match


_BOXED = "\\boxed"
_ANSWER_MARKER = re.compile(r"(?:answer\s*:|####)", re.IGNORECASE)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_SURROUNDING = " \t\r\n.,;:!?$*`'\""


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind(_BOXED + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(_BOXED)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin + 1 : i]
    return None  # unclosed: the completion was cut off


def _extract_answer(text: str) -> str:
    """The last \\boxed{...}, else what follows the last "answer:" (or "####") on its line,
    else the last non-empty line."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        after = text[markers[-1].end() :].strip()
        if after:
            return after.splitlines()[0]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class ExactMatch(Reward):
    """1.0 when the completion's answer equals `sample[field]` (a string, or a list of
    acceptable ones) once both are normalised: whitespace collapsed, surrounding punctuation
    and `$` stripped, thousands separators removed, and case ignored unless `case_sensitive`.
    `extract="last"`: the answer is the last \\boxed{...}, else what follows the last
    "Answer:", else the last non-empty line; `extract="full"`: the whole completion."""

    name = "exact_match"

    def __init__(
        self,
        *,
        field: str = "answer",
        extract: str = "last",
        case_sensitive: bool = False,
        **options: Any,
    ):
        super().__init__(**options)
        if extract not in ("last", "full"):
            raise option_error(self.name, "extract", extract, '"last" or "full"')
        self.field, self.extract, self.case_sensitive = field, extract, bool(case_sensitive)

    def normalise(self, text: str) -> str:
        """The form answers are compared in."""
        text = _THOUSANDS.sub("", " ".join(str(text).split())).strip(_SURROUNDING)
        return text if self.case_sensitive else text.lower()

    def score(self, completion: str, sample: dict) -> float:
        gold = self._field(sample, self.field, "the expected answer")
        golds = gold if isinstance(gold, list | tuple) else [gold]
        answer = completion if self.extract == "full" else _extract_answer(completion)
        return float(self.normalise(answer) in {self.normalise(g) for g in golds})


# ---- regex


class RegexReward(Reward):
    """`score` when the completion matches `pattern` (searched anywhere, or the whole of it
    with `full_match`; `.` matches newlines), else 0.0: a format reward, e.g.
    `pattern='<think>.*</think>\\s*<answer>.*</answer>'`."""

    name = "regex"

    def __init__(
        self,
        *,
        pattern: str | None = None,
        full_match: bool = False,
        score: float = 1.0,
        **options: Any,
    ):
        super().__init__(**options)
        if pattern is None:
            raise ConfigError(
                f"reward {self.name!r}: needs a pattern, e.g. regex:pattern='<answer>.*</answer>'"
            )
        try:
            self.pattern = re.compile(str(pattern), re.DOTALL)
        except re.error as exc:
            raise ConfigError(
                f"reward {self.name!r}: pattern {pattern!r} is not a regular expression ({exc})"
            ) from None
        self.full_match, self.value = bool(full_match), float(score)

    def score(self, completion: str, sample: dict) -> float:
        match = self.pattern.fullmatch if self.full_match else self.pattern.search
        return self.value if match(completion) else 0.0
