"""`Kernel`, the base every `axplug.kernels` entry is read through, and `Unsupported`.

A kernel is registered under the `axplug.kernels` entry-point group; the entry loads a class
(instantiated with no arguments) or an instance. `Kernel` declares every optional member with
its default; dispatch reads them directly. An entry that does not derive from `Kernel` (plugin
API before 1.13) is given it as a last base when loaded (`axplug.registry.conformed`), so the
members it leaves out read these defaults. A dense attention kernel has:

- `priority: int` - higher is tried first (reference 0, xla 10; hardware kernels use 100+);
- `is_supported(query, key, value, mask, backend) -> True | Unsupported(reason)` - decides from
  shapes, dtypes, the mask's static fields, the backend name and the sharding scope only
  (arguments may be `jax.ShapeDtypeStruct`s), so the choice is made once at trace time;
- `__call__(query, key, value, mask, *, scale) -> out` - query [b, sq, h, d],
  key/value [b, skv, kvh, d] with h % kvh == 0, mask an `axplug.api.AttentionMask`;
  returns [b, sq, h, d] in value's dtype, differentiable;
- `supports_linear_bias: bool` (optional, plugin API 1.1) - True when the kernel adds
  `mask.bias()` (ALiBi) to its scores; dispatch never gives a mask with bias slopes to a
  kernel without it;
- `supports_logit_softcap: bool` (optional) - True when the kernel soft-caps its scaled
  scores by `mask.logit_softcap` (`cap * tanh(s / cap)`, before bias and mask: Gemma 2);
  dispatch never gives a mask with a cap to a kernel without it, and `AttentionKernel`'s
  own `is_supported` answers Unsupported for one;
- `supports_causal_limits: bool` (optional) - True when the kernel lets a query see the
  keys up to `mask.q_causal_limits` (an image's tokens bidirectionally); dispatch never
  gives a mask with limits to a kernel without it;
- `supports_lse: bool` (optional) - True when the kernel also has `forward_lse(query, key,
  value, mask, *, scale) -> (out, lse)` (float32 [b, sq, h, dv] and the scores' log-sum-exp
  [b, sq, h]) and `backward_lse(query, key, value, mask, out, lse, d_out, *, scale) ->
  (dq, dk, dv)` (float32), given the `out` and `lse` of attention over a larger key set: the
  per-block work of attention split over devices (ring context parallelism).
"""

from __future__ import annotations

__all__ = ["AttentionKernel", "Kernel", "Unsupported", "check_shapes", "why_unsupported"]


class Unsupported:
    """A false `is_supported` answer that says why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Unsupported({self.reason!r})"


class Kernel:
    """Base of every `axplug.kernels` entry: the optional members and their defaults."""

    priority: int = 0  # higher is tried first
    paged: bool = False  # a paged-attention kernel (axplug.kernels.paged)
    grouped_matmul: bool = False  # a grouped matmul (axplug.kernels.grouped)
    supports_linear_bias: bool = False
    supports_logit_softcap: bool = False
    supports_causal_limits: bool = False
    supports_lse: bool = False

    def availability(self, backend: str | None = None) -> str | None:
        """Why the kernel cannot run on this machine (`axplug list`), or None when it can."""
        return None

    def is_supported(self, *args, **kwargs):
        """True, or `Unsupported(reason)` for a call it cannot run (signature per family)."""
        return True

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(type(self).__qualname__)


def why_unsupported(answer: object) -> str:
    """Why an `is_supported` answer is false, in words."""
    return answer.reason if isinstance(answer, Unsupported) else "not supported"


class AttentionKernel(Kernel):
    """Base of dense attention kernels: `is_supported` checks shapes and the soft-cap."""

    def is_supported(self, query, key, value, mask, backend: str):
        problem = check_shapes(query, key, value)
        capped = mask.logit_softcap is not None
        if problem is None and capped and not self.supports_logit_softcap:
            problem = Unsupported("logit soft-capping (supports_logit_softcap is False)")
        return True if problem is None else problem


def check_shapes(query, key, value) -> Unsupported | None:
    """None when q/k/v have the shapes every kernel expects, else why not."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return Unsupported("q, k, v must be [batch, seq, heads, head_dim]")
    if key.shape != value.shape:
        return Unsupported(f"key {key.shape} and value {value.shape} shapes differ")
    h, kvh = query.shape[2], key.shape[2]
    if h % kvh:
        return Unsupported(f"{h} query heads not divisible by {kvh} kv heads")
    if query.shape[-1] != key.shape[-1]:
        return Unsupported(f"query head_dim {query.shape[-1]} != key head_dim {key.shape[-1]}")
    return None
