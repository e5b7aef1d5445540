"""Host-side rollout scoring: group-relative advantages, DAPO's dynamic-sampling filter and soft
overlong punishment, and the unbiased pass@k."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["SCALES", "group_advantages", "varied_groups", "overlong_penalty", "pass_at_k"]

SCALES = ("std", "none")


def _groups(rewards: ArrayLike, group_size: int) -> np.ndarray:
    """The rewards as float64 [P, group_size], consecutive rows forming a group."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D; got shape {r.shape}")
    if group_size < 1 or r.size % group_size:
        raise ValueError(
            f"group_size must be >= 1 and divide the {r.size} rewards; got {group_size}"
        )
    return r.reshape(-1, group_size)


def group_advantages(
    rewards: ArrayLike, group_size: int, *, scale: str = "std", eps: float = 1e-4
) -> np.ndarray:
    """float32 [N]: each reward minus its group's mean, over (the group's std + eps) if "std".

    The std is the unbiased one (ddof=1), as in TRL's GRPOTrainer (torch's default) and
    DeepSeekMath's implementation; a group of one has std 0. scale="none" leaves the difference
    unscaled (Dr. GRPO, Liu et al. 2025).
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    groups = _groups(rewards, group_size)
    adv = groups - groups.mean(axis=1, keepdims=True)
    if scale == "std":
        std = groups.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else 0.0
        adv = adv / (std + eps)
    return adv.reshape(-1).astype(np.float32)


def varied_groups(rewards: ArrayLike, group_size: int) -> np.ndarray:
    """bool [P]: the groups whose rewards are not all equal (what DAPO's dynamic sampling keeps)."""
    groups = _groups(rewards, group_size)
    return groups.max(axis=1, initial=-np.inf) != groups.min(axis=1, initial=np.inf)


def overlong_penalty(lengths: ArrayLike, max_tokens: int, cache_tokens: int) -> np.ndarray:
    """float32 [N]: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of each length."""
    if not 0 <= cache_tokens <= max_tokens:
        raise ValueError(
            f"cache_tokens must be in [0, max_tokens={max_tokens}]; got {cache_tokens}"
        )
    length = np.asarray(lengths, np.float64)
    soft = max_tokens - cache_tokens
    ramp = (soft - length) / max(cache_tokens, 1)
    return np.where(length <= soft, 0.0, np.where(length <= max_tokens, ramp, -1.0)).astype(
        np.float32
    )


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), as a stable product."""
    n, c = num_samples, num_correct
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, num_samples={n}]; got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"num_correct must be in [0, num_samples={n}]; got {c}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod over i in (n-c, n] of (1 - k / i): no huge binomials.
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))
