"""Choosing the next token from logits: greedy, temperature, top-k and top-p, per row; and
the log-probabilities a request asks for."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["SamplingParams", "filtered_logits", "penalized", "sample_tokens", "token_logprobs"]

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_new_tokens: int = 64  # 0: only score the prompt (with `prompt_logprobs`)
    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    min_p: float = 0.0  # 0: no cut; else drop tokens under min_p x the most likely's probability
    stop_tokens: tuple[int, ...] = ()  # generation ends at any of these (not included)
    seed: int = 0  # token t uses fold_in(PRNGKey(seed), t): independent of batching
    # OpenAI's penalties on tokens generated so far: minus presence_penalty once a token
    # appeared, minus frequency_penalty per appearance; vLLM's (Hugging Face's)
    # repetition_penalty on tokens of the prompt or output: positive logits divided by it,
    # negative ones multiplied; logit_bias: (token id, bias) pairs added to the logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities under the model's own distribution (before temperature, top-k and
    # top-p, penalties and bias), each with the N most likely tokens: None off, N >= 0 on.
    logprobs: int | None = None  # of every generated token
    prompt_logprobs: int | None = None  # of every prompt token but the first

    def __post_init__(self):
        problems = []
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and self.prompt_logprobs is None):
            problems.append(
                f"max_new_tokens={self.max_new_tokens} must be at least 1 (0 only to score the "
                "prompt, with prompt_logprobs)"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(
                f"temperature={self.temperature} must be a finite number >= 0 (0: greedy)"
            )
        if not 0 <= self.top_k <= _INT32_MAX:
            problems.append(f"top_k={self.top_k} must be in [0, {_INT32_MAX}] (0: off)")
        if not -(2**63) <= self.seed < 2**64:
            problems.append(f"seed={self.seed} must be a 64-bit integer")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= _INT32_MAX:
                problems.append(f"{name}={value} must be >= 0 (None: off)")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1] (1: off)")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p={self.min_p} must be in [0, 1] (0: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append(f"{name}={getattr(self, name)} must be in [-2, 2] (0: off)")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            problems.append(f"repetition_penalty={self.repetition_penalty} must be > 0 (1: off)")
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        if bad := [(t, b) for t, b in bias if not (t >= 0 and -100.0 <= b <= 100.0)]:
            problems.append(f"logit_bias {bad[0]}: ids must be >= 0, biases in [-100, 100]")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(self, "logit_bias", bias)

    @property
    def penalizes(self) -> bool:
        """Whether penalties or a bias change this request's logits before sampling."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias
        )  # fmt: skip


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array | None = None,
) -> jax.Array:
    """Next token per row [b] from `logits` [b, vocab], each row with its own key and settings
    (see `filtered_logits`); a row with temperature 0 takes the argmax."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        filtered = filtered_logits(logits, temperature, top_k, top_p, min_p)
        sampled = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # Every row greedy (temperature 0): no scaling, sort or Gumbel noise at all.
    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)


def filtered_logits(logits, temperature, top_k, top_p, min_p=None) -> jax.Array:
    """`logits` [b, vocab] over each row's temperature, with what its cuts drop at -inf:
    top-k keeps the k highest logits, top-p then keeps the smallest prefix (by probability)
    whose mass reaches p (tokens tied with the last kept one too), min-p then drops tokens
    less likely than min_p times the most likely one."""
    if min_p is None:
        min_p = jnp.zeros_like(top_p)
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
    # The vocabulary sort of top-k / top-p only when some row asks for either.
    filtering = jnp.any((top_k > 0) | (top_p < 1.0))
    filtered = jax.lax.cond(filtering, _filtered, lambda s, *_: s, scaled, top_k, top_p)
    # min-p in logit space: log p_i - log p_max = scaled_i - max(scaled).
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where((min_p[:, None] > 0) & (scaled < floor), -jnp.inf, filtered)


def _filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`scaled` logits [b, vocab] with what top-k, then top-p, drop set to -inf."""
    vocab = scaled.shape[-1]
    ranked = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)
    ranked = jnp.where(ranked >= kth, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (mass_before < top_p[:, None]) & (ranked > -jnp.inf)
    threshold = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def token_logprobs(logits: jax.Array, targets: jax.Array, top_n: int):
    """Log-softmax of `logits` [..., vocab] at `targets` [...] and their rank (1: the most
    likely), and the `top_n` most likely tokens with theirs ([..., top_n] ids and values;
    empty when `top_n` is 0)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    rank = 1 + jnp.sum(logp > chosen[..., None], axis=-1, dtype=jnp.int32)
    top_values, top_ids = jax.lax.top_k(logp, top_n)
    return chosen, rank, top_ids.astype(jnp.int32), top_values


def penalized(logits: jax.Array, state: dict) -> jax.Array:
    """`logits` [b, vocab] with each row's penalties and bias applied (`SamplingParams`):
    `state` holds per row `counts` of generated tokens [b, vocab], `seen` (prompt or output)
    [b, vocab], `presence`, `frequency`, `repetition` [b] and `bias` [b, vocab]."""
    logits = logits.astype(jnp.float32)
    counts = state["counts"].astype(jnp.float32)
    logits = (
        logits - state["presence"][:, None] * (counts > 0) - state["frequency"][:, None] * counts
    )
    repetition = state["repetition"][:, None]
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(state["seen"], repeated, logits)
    return logits + state["bias"]
