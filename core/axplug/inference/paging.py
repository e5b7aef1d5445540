"""Pages of a paged KV cache from the scheduler's side: the free list and the pool's shape."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from axplug.api.errors import AxplugError

__all__ = ["OutOfPagesError", "PageAllocator", "cache_paging"]


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


def cache_paging(cache: Any) -> tuple[int, int, int] | None:
    """(num_pages, page_size, pages_per_row) of the first paged cache in `cache`, else None."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            if "block_table" in node:
                found.append(node)
                return
            for value in node.values():
                visit(value)

    visit(cache)
    if not found:
        return None
    num_pages, page_size = found[0]["positions"].shape[-2:]
    return int(num_pages), int(page_size), int(found[0]["block_table"].shape[-1])
