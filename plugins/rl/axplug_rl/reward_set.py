"""`RewardSet`: rewards named by specs, weighted and summed over a batch of completions; a
reward that fails on a sample scores it 0 and never stops training."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from axplug.api.config import ConfigError, parse_spec
from axplug_rl.code_reward import CodeReward
from axplug_rl.math_reward import MathReward
from axplug_rl.rewards import ExactMatch, RegexReward, Reward

__all__ = ["BUILTIN_REWARDS", "RewardSet"]

logger = logging.getLogger("axplug.rl")

BUILTIN_REWARDS: dict[str, type[Reward]] = {
    "exact_match": ExactMatch,
    "regex": RegexReward,
    "math": MathReward,
    "code": CodeReward,
}


Lookup = Mapping[str, type[Reward]] | Callable[[str], type[Reward]]


def _reward_class(name: str, lookup: Lookup) -> type[Reward]:
    if isinstance(lookup, Mapping):
        if name not in lookup:
            raise ConfigError(
                f"reward {name!r} is unknown; known rewards: {', '.join(sorted(lookup))}"
            )
        cls = lookup[name]
    else:
        try:
            cls = lookup(name)
        except LookupError as exc:
            raise ConfigError(f"reward {name!r} is unknown: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise ConfigError(f"reward {name!r}: {cls!r} is not a Reward subclass")
    return cls


class RewardSet:
    """Rewards named by specs (`NAME[:key=value,...]`, e.g. "math:field='solution'"),
    weighted and summed. A reward that raises on a sample scores 0.0 there and counts a
    failure (one warning per batch and reward); it never stops training."""

    def __init__(
        self,
        specs: Sequence[str],
        weights: Sequence[float] | None = None,
        *,
        lookup: Lookup = BUILTIN_REWARDS,
    ):
        if isinstance(specs, str) or not specs:
            raise ConfigError(
                f"rewards: expected a list of reward specs, got {specs!r}; "
                'e.g. ["exact_match", "regex:pattern=\'<answer>\'"]'
            )
        weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(specs):
            raise ConfigError(
                f"rewards: {len(specs)} rewards but {len(weights)} weights; "
                "give one weight per reward (or none: all 1.0)"
            )
        if not all(math.isfinite(w) for w in weights):
            raise ConfigError(f"rewards: weights {weights}: must be finite numbers")
        self.rewards: dict[str, Reward] = {}
        self.weights: dict[str, float] = {}
        for spec, weight in zip(specs, weights, strict=True):
            name, options = parse_spec(spec, "reward")
            reward = _reward_class(name, lookup)(**options)
            key, n = name, 1
            while key in self.rewards:  # the same reward twice: regex, regex_2
                n += 1
                key = f"{name}_{n}"
            self.rewards[key], self.weights[key] = reward, weight

    @property
    def names(self) -> list[str]:
        """The rewards' names, in order: the keys of `score`'s dicts."""
        return list(self.rewards)

    def score(
        self, completions: list[str], samples: list[dict]
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int]]:
        """(the weighted total per completion [N] float32, each reward's scores by name,
        each reward's number of failed samples by name)."""
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions for {len(samples)} samples")
        total = np.zeros(len(completions), np.float32)
        scores, failures = {}, {}
        for key, reward in self.rewards.items():
            scores[key], failures[key] = _safe_scores(key, reward, completions, samples)
            total += np.float32(self.weights[key]) * scores[key]
        return total, scores, failures


def _checked(value: Any) -> float:
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"scored {score}")
    return score


def _safe_scores(
    key: str, reward: Reward, completions: list[str], samples: list[dict]
) -> tuple[np.ndarray, int]:
    """The reward's scores, a failed sample's 0.0, and how many failed."""
    try:
        batch = [_checked(s) for s in reward.score_batch(list(completions), list(samples))]
        if len(batch) != len(completions):
            raise ValueError(f"score_batch gave {len(batch)} scores for {len(completions)}")
        return np.asarray(batch, np.float32), 0
    except Exception:
        pass  # one bad sample must not zero the batch: score each alone
    out, failed, first = np.zeros(len(completions), np.float32), 0, None
    for i, (completion, sample) in enumerate(zip(completions, samples, strict=True)):
        try:
            out[i] = _checked(reward.score(completion, sample))
        except Exception as exc:
            failed += 1
            first = first or f"{type(exc).__name__}: {exc}"
    if failed:
        logger.warning(
            "reward %r failed on %d of %d samples (scored 0); first error: %s",
            key,
            failed,
            len(completions),
            first,
        )
    return out, failed
