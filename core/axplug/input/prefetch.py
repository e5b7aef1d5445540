"""Batches made ahead of the step that needs them, in threads, in order."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["prefetched"]


def prefetched(make: Callable[[int], dict], step: int, depth: int) -> Iterator[tuple[int, dict]]:
    """`(step, make(step))` for step, step + 1, ...; with `depth` > 0 the next `depth`
    batches are being made in as many threads while the caller uses this one (reads from a
    remote store overlap each other and the step). An error surfaces at its step."""
    if depth == 0:
        while True:
            yield step, make(step)
            step += 1
    with ThreadPoolExecutor(depth, thread_name_prefix="axplug-input") as pool:
        queue: collections.deque[tuple[int, Future]] = collections.deque()
        try:
            while True:
                while len(queue) < depth + 1:
                    at = step + len(queue)
                    queue.append((at, pool.submit(make, at)))
                at, future = queue.popleft()
                yield at, future.result()
                step = at + 1
        finally:
            for _, future in queue:
                future.cancel()
