"""KV caches: the `kv_cache` slot of Attention, used only when decoding.

A cache's state is an explicit dict of arrays that the caller carries between decode steps, so
decoding works under jit. Every cache state has a `length` [batch] int32 leaf: the number of
tokens cached per row. `extend` writes the valid new tokens of each row after its cached ones
and returns the keys, values and positions to attend to, with every slot at or past `length`
reported as `EMPTY_POSITION` (so a causal mask hides it). A row is released by setting its
`length` to 0: nothing else needs clearing, which is what lets a batching scheduler reuse rows.

New tokens whose position is `EMPTY_POSITION` are padding: they are never written, and they
must come after the valid tokens of their row (right padding). That is how one call prefills
prompts of different lengths, or decodes some rows while others sit idle.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from axplug.api import EMPTY_POSITION, PagedKV
from axplug.config import ConfigValueError, config_class
from axplug.layers.base import BaseLayer
from axplug.sharding import constrain

__all__ = [
    "EMPTY_POSITION",
    "PagedKV",
    "assigning_pages",
    "KVCache",
    "ContiguousKVCache",
    "PagedKVCache",
    "Paging",
    "restart_rows",
    "set_block_tables",
    "read_row",
    "write_row",
]

_KV_AXES = ("heads", "batch", None, None)  # [kv_heads, rows x pages, page, head_dim]
_PAGE = 16  # tokens per page when a contiguous cache is read as pages
# Head-major, as the Pallas paged-attention kernels read it: [kv_heads, pages, page, head_dim].
_POOL_AXES = ("heads", None, None, None)
# Per row: `length` [b], and the block table or a contiguous row's positions [b, ...]. A cache's
# init_state lays its arrays out as its writes do: a step's cache is the next step's input.
_LENGTH_AXES, _ROW_AXES = ("batch",), ("batch", None)

_ASSIGNING_PAGES = contextvars.ContextVar("axplug_assigning_pages", default=False)


@contextlib.contextmanager
def assigning_pages() -> Iterator[None]:
    """Paged caches made inside may have fewer pages than rows x pages per row: the caller
    (a scheduler such as the inference Engine) writes the block tables itself."""
    token = _ASSIGNING_PAGES.set(True)
    try:
        yield
    finally:
        _ASSIGNING_PAGES.reset(token)


def _write_indices(length: jax.Array, positions: jax.Array, capacity: int) -> jax.Array:
    """Logical cache index of each new token [b, s]; `capacity` (out of range) for padding."""
    valid = positions != EMPTY_POSITION
    index = length[:, None] + jnp.arange(positions.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(valid, index, capacity)


def _visible(positions: jax.Array, new_length: jax.Array) -> jax.Array:
    """`positions` [b, n] with every slot at index >= new_length [b] set to EMPTY_POSITION."""
    index = jnp.arange(positions.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(index < new_length[:, None], positions, EMPTY_POSITION)


def _new_length(length: jax.Array, positions: jax.Array) -> jax.Array:
    return length + jnp.sum(positions != EMPTY_POSITION, axis=1, dtype=jnp.int32)


def _row_pages(max_len: int) -> tuple[int, int]:
    """(page size, pages per row) of a contiguous cache's rows read as pages."""
    page = _PAGE if max_len % _PAGE == 0 else max_len
    return page, max_len // page


def _paged_view(cache: dict) -> tuple[jax.Array, jax.Array]:
    """(positions pool [..., pages, page], block table [..., batch, pages per row]) of a cache
    of either kind: a contiguous cache's rows are runs of pages its table never changes."""
    if "block_table" in cache:
        return cache["positions"], cache["block_table"]
    *lead, b, max_len = cache["positions"].shape
    page, per_row = _row_pages(max_len)
    table = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)
    pool = cache["positions"].reshape(*lead, b * per_row, page)
    return pool, jnp.broadcast_to(table, (*lead, b, per_row))


def _write_pages(state: dict, key, value, positions, page_size: int, axes=_POOL_AXES) -> dict:
    """`state` (a pool, its block table, length) with the valid new tokens written; the pool
    laid out by the logical `axes`."""
    table = state["block_table"]
    num_pages = state["key"].shape[1]
    capacity = table.shape[1] * page_size
    index = _write_indices(state["length"], positions, capacity)  # logical, [b, s]
    logical_page = jnp.minimum(index // page_size, table.shape[1] - 1)
    page = jnp.take_along_axis(table, logical_page, axis=1)
    page = jnp.where(index < capacity, page, num_pages)  # padding: out of range, dropped
    offset = index % page_size

    def write(pool, new):  # new [b, s, kvh, d] into the head-major pool
        new = jnp.moveaxis(new.astype(pool.dtype), 2, 0)
        return pool.at[:, page, offset].set(new, mode="drop")

    return {
        "key": constrain(write(state["key"], key), axes),
        "value": constrain(write(state["value"], value), axes),
        "positions": state["positions"].at[page, offset].set(positions, mode="drop"),
        "block_table": constrain(table, _ROW_AXES),
        "length": constrain(_new_length(state["length"], positions), _LENGTH_AXES),
    }


class KVCache(BaseLayer):
    """Base of attention's kv_cache slot (decoding only): a state per row, written by each step."""

    def init_state(
        self, *, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
    ) -> dict:
        """An empty cache for `batch_size` rows of up to `max_len` tokens."""
        raise NotImplementedError(type(self).__qualname__)

    def extend(self, state: dict, key: jax.Array, value: jax.Array, positions: jax.Array):
        """(new state, keys [b, t, kvh, d], values, their positions [b, t]) to attend to, with
        the new `key`/`value` [b, new, kvh, d] at `positions` written."""
        raise NotImplementedError(type(self).__qualname__)

    def extend_paged(self, state: dict, key: jax.Array, value: jax.Array, positions: jax.Array):
        """(new state, a `PagedKV` over the rows in place) for a decode step of one token."""
        raise NotImplementedError(type(self).__qualname__)


class ContiguousKVCache(KVCache):
    """Keys and values in one max_len row per sequence.

    Stored head-major as pages: `key`/`value` [kv_heads, batch * P, page, head_dim], row b
    being pages b * P .. b * P + P - 1 (P pages of 16 tokens, or one page when max_len is not
    a multiple of 16); `positions` [batch, max_len]; `length` [batch]. A decode step reads the
    rows in place with a paged-attention kernel (`extend_paged`), as a `PagedKVCache` whose
    block table never changes.
    """

    def init_state(
        self, *, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
    ) -> dict[str, jax.Array]:
        page, per_row = _row_pages(max_len)
        shape = (num_kv_heads, batch_size * per_row, page, head_dim)
        return {  # laid out as `extend_paged` writes it
            "key": constrain(jnp.zeros(shape, dtype), _KV_AXES),
            "value": constrain(jnp.zeros(shape, dtype), _KV_AXES),
            "positions": constrain(
                jnp.full((batch_size, max_len), EMPTY_POSITION, jnp.int32), _ROW_AXES
            ),
            "length": constrain(jnp.zeros((batch_size,), jnp.int32), _LENGTH_AXES),
        }

    def extend(self, state: dict, key: jax.Array, value: jax.Array, positions: jax.Array):
        """(new_state, key_all, value_all, kv_positions) after appending the valid tokens of
        `key`/`value` [b, s, kvh, d] at `positions` [b, s]; *_all are [b, max_len, kvh, d].

        Tokens past `max_len` are dropped: size the cache for prompt plus generated tokens.
        """
        new_state, _ = self.extend_paged(state, key, value, positions)
        b, max_len = new_state["positions"].shape
        kv_positions = _visible(new_state["positions"], new_state["length"])

        def rows(pages):  # [kvh, b * P, page, d] -> [b, max_len, kvh, d]
            return jnp.moveaxis(pages.reshape(pages.shape[0], b, max_len, pages.shape[-1]), 0, 2)

        return new_state, rows(new_state["key"]), rows(new_state["value"]), kv_positions

    def extend_paged(self, state: dict, key: jax.Array, value: jax.Array, positions: jax.Array):
        """(new_state, PagedKV): the write of `extend`, with the rows handed to a
        paged-attention kernel as the pages they are stored in."""
        b, max_len = state["positions"].shape
        positions_pool, table = _paged_view(state)
        # Rows over the batch axes and kv heads over `model`, like the activations: on a mesh
        # each device keeps its rows' and heads' share of the cache.
        written = _write_pages(dict(state, positions=positions_pool, block_table=table), key,
                               value, positions, _row_pages(max_len)[0], _KV_AXES)  # fmt: skip
        new_state = {
            "key": written["key"],
            "value": written["value"],
            "positions": constrain(written["positions"].reshape(b, max_len), _ROW_AXES),
            "length": written["length"],
        }
        return new_state, PagedKV(new_state["key"], new_state["value"], table, new_state["length"])


class Paging(NamedTuple):
    """A paged cache's pool and block table: `num_pages` of `page_size` tokens, and the
    `pages_per_row` a row of the block table names."""

    num_pages: int
    page_size: int
    pages_per_row: int


class PagedKVCache(KVCache):
    """Keys and values in a pool of fixed-size pages; a block table maps each row's logical
    pages to pool pages, so rows share one pool and hold only the pages they use.

    State: `key`/`value` [kv_heads, num_pages, page_size, head_dim] (head-major, the layout of
    the Pallas paged-attention kernels), `positions` [num_pages, page_size], `block_table`
    [batch, max_len // page_size] and `length` [batch]. The default
    block table gives row b the pages b * P .. b * P + P - 1, which needs `batch * P` pages
    (P = pages per row); fewer is an error, except for a scheduler that allocates pages itself
    (`axplug.inference.PageAllocator`): it makes the cache inside `assigning_pages()` and
    writes the block table; an entry equal to `num_pages` means "no page" (writes dropped,
    reads empty). Entries past a row's length are never read.
    """

    @config_class
    class Config(BaseLayer.Config):
        page_size: int = 16
        num_pages: int | None = None  # None: enough for every row to reach max_len

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.page_size < 1:
            raise cfg.field_error("page_size", f"must be at least 1, got {cfg.page_size}")
        if cfg.num_pages is not None and cfg.num_pages < 1:
            raise cfg.field_error("num_pages", f"must be at least 1, got {cfg.num_pages}")

    def paging(self, batch_size: int, max_len: int) -> Paging:
        """The pool and block table of a cache of `batch_size` rows of `max_len` tokens."""
        per_row = math.ceil(max_len / self._config.page_size)
        return Paging(self._config.num_pages or batch_size * per_row, self._config.page_size,
                      per_row)  # fmt: skip

    def init_state(
        self, *, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
    ) -> dict[str, jax.Array]:
        cfg = self._config
        num_pages, _, per_row = self.paging(batch_size, max_len)
        if num_pages < batch_size * per_row and not _ASSIGNING_PAGES.get():
            # Rows past the pool would have no pages, and their tokens would be dropped.
            raise ConfigValueError(
                f"{self.path}.num_pages={num_pages}: {batch_size} rows of up to {max_len} "
                f"tokens need {batch_size * per_row} pages of {cfg.page_size}; raise num_pages "
                "(or leave it unset), or decode through axplug.inference.Engine, which gives "
                "pages to rows as they need them"
            )
        shape = (num_kv_heads, num_pages, cfg.page_size, head_dim)
        table = jnp.arange(batch_size * per_row, dtype=jnp.int32).reshape(batch_size, per_row)
        return {  # the pool laid out as `_write_pages` writes it
            "key": constrain(jnp.zeros(shape, dtype), _POOL_AXES),
            "value": constrain(jnp.zeros(shape, dtype), _POOL_AXES),
            "positions": jnp.full((num_pages, cfg.page_size), EMPTY_POSITION, jnp.int32),
            # Entries past the pool (num_pages too small for every row) are `num_pages`: no
            # page. Writes through them are dropped and reads see empty slots, so a row without
            # pages never touches another row's (it pointed at page 0 and overwrote row 0).
            "block_table": constrain(jnp.where(table < num_pages, table, num_pages), _ROW_AXES),
            "length": constrain(jnp.zeros((batch_size,), jnp.int32), _LENGTH_AXES),
        }

    def extend(self, state: dict, key: jax.Array, value: jax.Array, positions: jax.Array):
        """As `ContiguousKVCache.extend`; *_all are the row's pages gathered in logical order,
        [b, pages_per_row * page_size, kvh, d]."""
        new_state = self._write(state, key, value, positions)
        table, length = new_state["block_table"], new_state["length"]

        def gather(pool):  # [kvh, num_pages, page, d] -> [b, pages_per_row * page, kvh, d]
            rows = jnp.take(pool, table, axis=1, mode="fill", fill_value=0)
            rows = rows.reshape(rows.shape[0], table.shape[0], -1, rows.shape[-1])
            return jnp.moveaxis(rows, 0, 2)

        kv_positions = jnp.take(new_state["positions"], table, axis=0, mode="fill",
                                fill_value=EMPTY_POSITION)  # fmt: skip
        kv_positions = _visible(kv_positions.reshape(table.shape[0], -1), length)
        return new_state, gather(new_state["key"]), gather(new_state["value"]), kv_positions

    def extend_paged(self, state: dict, key: jax.Array, value: jax.Array, positions: jax.Array):
        """(new_state, PagedKV): the write of `extend`, with the pages handed to a
        paged-attention kernel instead of gathered into rows (plugin API 1.3)."""
        new_state = self._write(state, key, value, positions)
        paged = PagedKV(new_state["key"], new_state["value"], new_state["block_table"],
                        new_state["length"])  # fmt: skip
        return new_state, paged

    def _write(self, state: dict, key: jax.Array, value: jax.Array, positions: jax.Array):
        # The pool's pages are shared by all rows: only the kv heads split (over `model`).
        return _write_pages(state, key, value, positions, self._config.page_size)


def restart_rows(cache_state, start: jax.Array):
    """`cache_state` (any pytree of cache states) with each row's `length` set to `start`
    [batch] where that is >= 0 (0 empties a row), and its `position_offset` (a model's per-row
    state: how far the rotary positions after a prompt's images are from the sequence's) 0."""

    def reset(path, leaf):
        last = path[-1] if path else None
        if isinstance(last, jax.tree_util.DictKey) and last.key == "length":
            return jnp.where(start >= 0, start, leaf)
        if isinstance(last, jax.tree_util.DictKey) and last.key == "position_offset":
            return jnp.where(start >= 0, 0, leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(reset, cache_state)


def set_block_tables(cache_state, table: jax.Array):
    """`cache_state` with every `block_table` leaf set to `table` [batch, pages_per_row]."""

    def put(path, leaf):
        last = path[-1] if path else None
        if isinstance(last, jax.tree_util.DictKey) and last.key == "block_table":
            return jnp.broadcast_to(jnp.asarray(table, leaf.dtype), leaf.shape)
        return leaf

    return jax.tree_util.tree_map_with_path(put, cache_state)


def _is_cache(node) -> bool:
    return isinstance(node, dict) and "length" in node and "key" in node


def has_row_state(cache_state) -> bool:
    """Whether the model keeps per-row state beside its caches (`position_offset`), which a
    restart zeroes: a row rewound mid-decode or moved to another engine would lose it."""
    paths, _ = jax.tree_util.tree_flatten_with_path(cache_state)
    return any(getattr(k, "key", None) == "position_offset" for path, _ in paths for k in path)


def read_row(cache_state, row):
    """One row of every cache in `cache_state`, in a layout-free form: per cache `key`/`value`
    [..., capacity, kv_heads, head_dim], `positions` [..., capacity] and `length` [...]
    ("..." = the leading axes of a scanned stack): the row's pages in logical order."""

    def one(cache):
        lead = (slice(None),) * (cache["length"].ndim - 1)
        positions_pool, table = _paged_view(cache)
        table = table[(*lead, row)]  # [..., pages_per_row]

        def gather(pool, heads: bool, empty=0):
            # [kvh, num_pages, page, d] -> [pages * page, kvh, d]; [num_pages, page] -> [t]
            def take(p, t):
                rows = jnp.take(p, t, axis=1 if heads else 0, mode="fill", fill_value=empty)
                if not heads:
                    return rows.reshape(-1)
                return jnp.moveaxis(rows.reshape(rows.shape[0], -1, rows.shape[-1]), 0, 1)

            return jax.vmap(take)(pool, table) if lead else take(pool, table)

        return {"key": gather(cache["key"], True), "value": gather(cache["value"], True),
                "positions": gather(positions_pool, False, EMPTY_POSITION),
                "length": cache["length"][(*lead, row)]}  # fmt: skip

    return jax.tree.map(one, cache_state, is_leaf=_is_cache)


def write_row(cache_state, row, row_state):
    """`cache_state` with `row` holding `row_state` (from `read_row`, maybe of another
    engine's cache of the same model and capacity). A paged cache writes the row's tokens
    into the pages its block table names for `row` (set it first); the rest are dropped."""

    def one(cache, new):
        lead = (slice(None),) * (cache["length"].ndim - 1)
        at = (*lead, row)
        positions_pool, table = _paged_view(cache)
        table = table[at]  # [..., pages_per_row]
        page = positions_pool.shape[-1]

        def scatter(pool, rows, heads: bool):  # a row [t, (kvh, d)] into its pages
            def put(p, t, r):
                if not heads:
                    return p.at[t].set(r.reshape(-1, page), mode="drop")
                r = jnp.moveaxis(r, 1, 0).reshape(r.shape[1], -1, page, r.shape[-1])
                return p.at[:, t].set(r.astype(p.dtype), mode="drop")

            return jax.vmap(put)(pool, table, rows) if lead else put(pool, table, rows)

        positions = scatter(positions_pool, new["positions"], False)
        return dict(
            cache,
            key=scatter(cache["key"], new["key"], True),
            value=scatter(cache["value"], new["value"], True),
            positions=positions.reshape(cache["positions"].shape),
            length=cache["length"].at[at].set(new["length"]),
        )

    return jax.tree.map(one, cache_state, row_state, is_leaf=_is_cache)
