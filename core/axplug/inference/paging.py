"""Pages of a paged KV cache from the scheduler's side: the free list, the prefix cache over
it, and the pool's shape."""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from axplug.api._errors import AxplugError
from axplug.inference.requests import RequestState
from axplug.layers.kv_cache import PagedKVCache, Paging
from axplug.module import Module

__all__ = ["OutOfPagesError", "PageAllocator", "model_paging"]  # and the Engine's helpers


class OutOfPagesError(AxplugError, RuntimeError):
    """The page pool cannot hold a request."""


class PageAllocator:
    """Free list of a paged KV cache's page ids, reference-counted, and (with `caching`) the
    prefix cache: a full page is named by a digest of its tokens and of every token before
    it, and keeps its keys and values after its last holder releases it, so a request with
    the same prefix shares it instead of computing it again. Cached pages nobody holds are
    evicted least recently used when the free list runs dry. Shared pages are only read: a
    row writes at and after its own length, past its full shared pages."""

    def __init__(self, num_pages: int, page_size: int = 1, *, caching: bool = False):
        self.num_pages, self.page_size, self.caching = num_pages, page_size, caching
        self._free = collections.deque(range(num_pages))
        self._refs = np.zeros((num_pages,), np.int64)
        self._digest_of: dict[int, bytes] = {}  # cached page -> its digest
        self._page_of: dict[bytes, int] = {}  # digest -> cached page
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Pages the prefix cache names (held or not)."""
        return len(self._page_of)

    def allocate(self, count: int, first: int | None = None) -> list[int]:
        """`count` pages, or OutOfPagesError (allocating nothing) when fewer are free: `first`,
        `first + 1`, ... where free (a row's own run: a pool nobody shares stays in row order,
        which paged reads on XLA:CPU take without a gather), else free ones, else evicted
        cached ones nobody holds (the row's own, else the least recently used)."""
        if count > self.num_free:
            free = self.num_free
            raise OutOfPagesError(f"need {count} pages, {free} of {self.num_pages} are free")
        pages = []
        for want in [-1] * count if first is None else range(first, first + count):
            own = 0 <= want < self.num_pages and not self._refs[want]  # unheld: free or idle
            if own and want not in self._digest_of:
                self._free.remove(want)
                page = want
            elif self._free:
                page = self._free.popleft()
            else:  # evict the row's own page if idle, else the least recently used
                page = want if own else next(iter(self._idle))
                del self._idle[page], self._page_of[self._digest_of.pop(page)]
                self.evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drops one hold on each of `pages`: an unheld page is free, or idle if cached."""
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._digest_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def digests(self, tokens: Sequence[int], known: list[bytes],
                salts: Sequence[tuple[int, bytes]] = ()) -> list[bytes]:  # fmt: skip
        """`known` (the digests of the first full pages of `tokens`) extended to every full
        page of `tokens`: each a hash of the digest before it, the `salts` (position, bytes)
        whose position it holds, and its tokens."""
        size = self.page_size
        for start in range(len(known) * size, len(tokens) - size + 1, size):
            page = np.asarray(tokens[start : start + size], np.int64).tobytes()
            salt = b"".join(s for at, s in salts if start <= at < start + size)
            known.append(hashlib.blake2b((known[-1] if known else b"") + salt + page,
                                         digest_size=16).digest())  # fmt: skip
        return known

    def share(self, digests: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of `digests` from the first, each now held
        once more (no longer evictable)."""
        pages = []
        for digest in digests if self.caching else ():
            if (page := self._page_of.get(digest)) is None:
                break
            pages.append(page)
            self._idle.pop(page, None)
            self._refs[page] += 1
        return pages

    def register(self, page: int, digest: bytes) -> None:
        """`page` (held, full) holds the prefix `digest` names: later requests may share it."""
        if self.caching and digest not in self._page_of and page not in self._digest_of:
            self._page_of[digest], self._digest_of[page] = page, digest


def shareable(pool: PageAllocator | None, active: RequestState) -> list[bytes]:
    """Digests of the full pages of `active`'s context it may read from the prefix cache
    (its last token is always fed: its logits give the next token); none for requests that
    score their prompt or use penalties (both need every prompt position)."""
    asked = active.request.sampling
    if not (pool and pool.caching) or asked.penalizes or asked.prompt_logprobs is not None:
        return []
    active.digests = pool.digests(active.context, active.digests, active.prefix_salt)
    return active.digests[: (active.context_len - 1) // pool.page_size]


def prefix_in_flight(allocator, active: RequestState, rows: Sequence) -> bool:
    """Whether one of `rows` is computing the first page of `active`'s prefix the cache lacks."""
    missing = [d for d in shareable(allocator, active) if d not in allocator._page_of]
    return bool(missing) and any(
        missing[0] in other.digests[other.registered :] for other in rows if other is not None
    )


def register_pages(allocator: PageAllocator, active: RequestState, pending=()) -> None:
    """Names `active`'s newly filled pages (of its context and `pending` tokens, cached but
    not yet recorded) in the prefix cache."""
    full = active.cached // allocator.page_size
    if full > active.registered and allocator.caching:
        context = [*active.context, *pending][: full * allocator.page_size]
        active.digests = allocator.digests(context, active.digests, active.prefix_salt)
        for index in range(active.registered, full):
            allocator.register(active.pages[index], active.digests[index])
        active.registered = full


def model_paging(model: Module, batch_size: int, max_len: int) -> Paging | None:
    """The `Paging` of `model`'s paged KV caches (of `batch_size` rows of `max_len` tokens), as
    the first `PagedKVCache` in it declares it; None without one."""
    if isinstance(model, PagedKVCache):
        return model.paging(batch_size, max_len)
    for child in model.children.values():
        if (paging := model_paging(child, batch_size, max_len)) is not None:
            return paging
    return None
