"""ALiBi (Press et al., 2022): per-head linear distance biases on the attention scores."""

from __future__ import annotations

import math

__all__ = ["alibi_slopes"]


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> tuple[float, ...]:
    """The paper's geometric slopes: 2^(-max_bias * i / n) for i = 1..n when n is a power of
    two; otherwise those of the nearest lower power of two, then every other slope of the
    next power of two (the reference implementation's interpolation)."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-max_bias * i / n) for i in range(1, n + 1)]

    low = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(low)
    if low < num_heads:
        slopes += power_of_two(2 * low)[0::2][: num_heads - low]
    return tuple(slopes)
