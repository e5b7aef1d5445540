"""Pages of a paged KV cache from the scheduler's side: the free list and the pool's shape."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from axplug.api._errors import AxplugError
from axplug.layers.kv_cache import PagedKVCache, Paging
from axplug.module import Module

__all__ = ["OutOfPagesError", "PageAllocator", "model_paging"]


class OutOfPagesError(AxplugError, RuntimeError):
    """The page pool cannot hold a request."""


class PageAllocator:
    """Free list of a paged KV cache's page ids."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free pages, or OutOfPagesError (allocating nothing) when fewer are free."""
        if count > len(self._free):
            raise OutOfPagesError(
                f"need {count} pages, {len(self._free)} of {self.num_pages} are free"
            )
        return [self._free.popleft() for _ in range(count)]

    def release(self, pages: Sequence[int]) -> None:
        """Returns `pages` to the pool."""
        self._free.extend(pages)


def model_paging(model: Module, batch_size: int, max_len: int) -> Paging | None:
    """The `Paging` of `model`'s paged KV caches (of `batch_size` rows of `max_len` tokens), as
    the first `PagedKVCache` in it declares it; None without one."""
    if isinstance(model, PagedKVCache):
        return model.paging(batch_size, max_len)
    for child in model.children.values():
        if (paging := model_paging(child, batch_size, max_len)) is not None:
            return paging
    return None
