"""Attention against a KV cache: append new keys/values in place, then attend to each valid prefix.

The cache is either contiguous, ``(batch_cache, capacity, nheads_k, headdim)`` (optionally
indexed through ``cache_batch_idx``), or paged, ``(num_pages, page_size, nheads_k, headdim)``
with a ``block_table`` of shape ``(batch, max_pages)`` mapping sequence positions to pages.  The
attention is the forward pass with ``seqlens_k`` = each sequence's valid length, so nothing past
it is read.  On the GPU, paged caches and calls with few query rows run the split-KV decode
kernel; every kernel reads the cache in place, its pages through the block table and its rows
through ``cache_batch_idx``.  The CPU path gathers pages and rows into a contiguous copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import _arrays, _cpu, _guard
from . import _validate as V
from .api import _doc, lse_dtype


@_guard.entry
@_doc
def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    block_table=None,
    cache_batch_idx=None,
    num_splits=0,
    return_lse=False,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    precision=None,
):
    """Decode-style attention: write ``k``, ``v`` into the cache, then attend to the valid prefix.

    Parameters
    ----------
    q : array of shape (batch, seqlen_q, nheads, headdim_qk)
        Queries, usually 1 to a few tokens per sequence (layout "bshd" only).
    k_cache, v_cache : arrays
        Contiguous: (batch_cache, capacity, nheads_k, headdim_qk or headdim_v).  Paged (with
        ``block_table``): (num_pages, page_size, nheads_k, headdim_qk or headdim_v).  Any page size.
        Modified in place when ``k`` and ``v`` are given.
    k, v : arrays of shape (batch, seqlen_new, nheads_k, headdim_qk or headdim_v), optional
        New keys and values, written at positions ``cache_seqlens[b] ...`` of sequence b before
        attending.  Both or neither.
    cache_seqlens : int32/int64 array of shape (batch,), or int
        Valid cache length of each sequence before the new tokens.  Sequence b attends to its
        first ``cache_seqlens[b] + seqlen_new`` keys; entries past that are never read.
    block_table : int32/int64 array (or nested list of ints) of shape (batch, max_pages), optional
        Page of each block of ``page_size`` positions of each sequence.
    cache_batch_idx : int32/int64 array (or list of ints) of shape (batch,), optional
        Row of the contiguous cache that holds sequence b (not with ``block_table``).
    num_splits : int, default 0
        Split-KV hint for the GPU (0 = choose automatically; at most 128 and one split per
        key tile are used); results do not depend on it beyond rounding.  The splits of a row
        are merged by the last of their blocks to finish, through counters and partial results
        kept per device and stream (for the 64 streams used last: 4 * (headdim_v + 1) bytes
        per split and query row).  A call captured into a CUDA graph gets scratch of its own,
        kept for the graph's replays until :func:`cuflash.release_graph_memory`.
    return_lse : bool, default False
        Also return the log-sum-exp, shape (batch, nheads, seqlen_q).
{options}

    Returns
    -------
    out : array of shape (batch, seqlen_q, nheads, headdim_v)
    lse : array of shape (batch, nheads, seqlen_q), float32 (float64 for float64 inputs)
        Only when ``return_lse``; ``-inf`` on rows that see no key (their output is 0).

    Raises
    ------
    TypeError
        As :func:`cuflash.attention`; index arrays that are not int32/int64.
    ValueError
        Shapes that do not match; ``k`` without ``v``; ``block_table`` together with
        ``cache_batch_idx``; cache lengths (plus new tokens) beyond the capacity; page or batch
        indices out of range, two new tokens sent to one cache slot, or a new token sent to a
        slot another position reads (two appending sequences on one ``cache_batch_idx`` row, a
        shared page written where another sequence's keys are, or a page listed twice in one
        sequence's ``block_table`` row and written where its earlier keys are; checked on the
        host for NumPy index arrays, and for GPU ones with ``CUFLASH_DEBUG=1``); when appending,
        a read-only cache, k_cache and v_cache sharing memory, q, k or v inside the cache, or
        a GPU cache whose last axis is strided.  Every check runs before the cache is written,
        so a refused call changes nothing.
    InvalidIndexError
        A ``ValueError``: the same index rules broken by GPU index arrays, which the kernels
        check without a copy to the host.  Whatever the values, nothing outside the arrays is
        read or written and an append past the capacity is refused, never wrapped: a sequence
        with bad metadata gets NaN output rows and LSE and nothing is written to the cache for
        it; the other sequences are appended and computed normally.  The error is raised by the
        next cuflash call, or at once by :func:`cuflash.synchronize`.

    Notes
    -----
    Causal and window rules use each sequence's valid length as Sk (bottom-right alignment:
    the last query is the newest token).  Modelled on FlashAttention's ``flash_attn_with_kvcache``
    (Dao et al.) with these differences: ``cache_seqlens`` is required, the LSE flag is
    ``return_lse`` (there ``return_softmax_lse``), and there is no rotary embedding
    (``rotary_cos``/``rotary_sin``), ``cache_leftpad``, ``layout=`` or ``out=``.  Split-KV
    decoding follows Flash-Decoding (Dao et al., 2023).

    Examples
    --------
    One decode step of two sequences against a paged cache of 4 pages of 16 tokens: the new
    token is written at position ``cache_seqlens[b]`` of each sequence, which then attends to
    ``cache_seqlens[b] + 1`` keys.

    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> k_cache = rng.standard_normal((4, 16, 2, 8)).astype(np.float16)  # (pages, page size, kv heads, d)
    >>> v_cache = rng.standard_normal((4, 16, 2, 8)).astype(np.float16)
    >>> block_table = np.array([[2, 0], [3, 1]], dtype=np.int32)  # sequence 0: pages 2, 0; sequence 1: 3, 1
    >>> cache_seqlens = np.array([20, 5], dtype=np.int32)
    >>> q = rng.standard_normal((2, 1, 4, 8)).astype(np.float16)  # 4 query heads share 2 kv heads
    >>> k, v = (rng.standard_normal((2, 1, 2, 8)).astype(np.float16) for _ in range(2))
    >>> out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
    ...                                      block_table=block_table)
    >>> out.shape, bool((k_cache[0, 4] == k[0, 0]).all())  # position 20 of sequence 0: page 0, slot 4
    ((2, 1, 4, 8), True)
    """
    fast_key = None
    if k is None and v is None and cache_batch_idx is None and alibi_slopes is None and precision is None and _arrays.is_gpu(q):
        from . import _fastpath  # warm decode steps replay an earlier launch

        inputs = (q, k_cache, v_cache, cache_seqlens, block_table)
        fast_key = _fastpath.signature("kvcache", inputs,
                                       (num_splits, return_lse, softmax_scale, causal, window_size, softcap))
        plan = _fastpath.lookup(fast_key)
        result = plan.run(inputs, need_lse=bool(return_lse)) if plan is not None else None
        if result is not None:
            return result if return_lse else result[0]

    c = _check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, num_splits)
    p = V.finish_problem(
        c.q, c.batch, c.q.shape[1], c.capacity, c.q.shape[2], c.k_cache.shape[2], c.q.shape[3], c.v_cache.shape[3],
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, seqlens_k=c.lengths, k_name="k_cache",
    )
    p = V.with_precision(c.q, p, precision)
    return_lse = V.check_bool(return_lse, "return_lse")
    if c.new:
        _check_append_targets(c)
    # Every check comes before the cache is written: a refused call changes nothing.  The CPU
    # path's copies of the positions in use are allocated before the append too, so that running
    # out of memory for them refuses the call before the cache changes.
    gather = _cpu_gather_buffers(c) if not c.gpu else None
    seq_bad = _append(c) if c.new else None
    out, lse = _attend(p, c, gather, seq_bad, num_splits, fast_key)
    return (out, lse) if return_lse else out


@dataclasses.dataclass
class _Call:
    """The checked arrays of one call, and the index values where the host has them (else None)."""

    q: object
    k_cache: object
    v_cache: object
    k: object  # new tokens, or None
    v: object
    cache_seqlens: object  # (batch,) int32/int64, on q's side
    lengths: object  # keys each sequence attends to: cache_seqlens + new
    block_table: object
    cache_batch_idx: object
    batch: int
    new: int
    capacity: int  # positions a sequence can hold
    page_size: int  # page size (paged), or the row length
    host_lengths: object
    host_table: object
    host_rows: object

    @property
    def gpu(self) -> bool:
        return _arrays.is_gpu(self.q)

    @property
    def paged(self) -> bool:
        return self.block_table is not None


def _check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, num_splits) -> _Call:
    """Step 1: shapes, dtypes and (where the host has them) index values; nothing is written."""
    written = None if k is None else "when k and v are appended: new tokens are written into it in place"
    q = _arrays.as_array(q, "q")
    k_cache, v_cache = (_arrays.as_array(x, n, written=written) for x, n in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    V.check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    if _arrays.is_gpu(q):  # a dtype without a GPU kernel is refused before any token is appended
        from . import _gpu

        _gpu._check_gpu_dtype(q, None)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append) or both omitted")
    if not _arrays.is_integer(num_splits):
        raise TypeError(f"num_splits must be an integer >= 0 (0 = automatic); got {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be an integer >= 0 (0 = automatic); got {num_splits!r}")
    batch, _, _, headdim = q.shape
    paged = block_table is not None
    if paged and cache_batch_idx is not None:
        raise ValueError("block_table and cache_batch_idx cannot be combined")
    capacity_rows, row_len = k_cache.shape[0], k_cache.shape[1]
    if paged and row_len == 0:
        raise ValueError(f"k_cache has page size 0 (shape {tuple(k_cache.shape)}); pages must hold at least one token")
    check_cache_pair(k_cache, v_cache, headdim)

    cache_seqlens, host_lengths = check_cache_seqlens(cache_seqlens, q, batch)
    host_table = host_rows = None
    if paged:
        block_table, host_table = V.check_index_array(block_table, "block_table", like=q, ndim=2)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have {batch} rows (q's batch); got {block_table.shape[0]}")
        capacity = block_table.shape[1] * row_len
    else:
        capacity = row_len
        if cache_batch_idx is not None:
            cache_batch_idx, host_rows = V.check_index_array(cache_batch_idx, "cache_batch_idx", like=q, length=batch)
        elif capacity_rows != batch:
            raise ValueError(f"k_cache has {capacity_rows} sequences; q has {batch} (pass cache_batch_idx to pick rows)")

    new = 0
    if k is not None:
        k, v, new = check_new_tokens(q, k, v, k_cache, v_cache)
    _check_ranges(host_lengths, new, capacity, row_len, host_table, capacity_rows, host_rows)
    # Keys each sequence attends to (the caller's int32 array itself when nothing is appended).
    lengths = cache_seqlens if not new and cache_seqlens.dtype == np.int32 else cache_seqlens.astype(np.int64) + new
    return _Call(q, k_cache, v_cache, k, v, cache_seqlens, lengths, block_table, cache_batch_idx, batch, new,
                 capacity, row_len, host_lengths, host_table, host_rows)


def check_cache_pair(k_cache, v_cache, headdim: int):
    """v_cache's first three axes are k_cache's, whose head dim is q's (``headdim``).  Also
    cuflash.parallel's sharded cache."""
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(f"v_cache must match k_cache's first three axes {tuple(k_cache.shape[:3])}; got {tuple(v_cache.shape[:3])}")
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache has head dim {k_cache.shape[3]}; it must equal q's head dim {headdim}")


def check_cache_seqlens(cache_seqlens, q, batch: int):
    """``cache_seqlens`` (an int for every sequence, or an index array of ``batch`` entries) as
    (array on q's side, host values or None): V.check_index_array's.  Also cuflash.parallel's."""
    if isinstance(cache_seqlens, np.ndarray) and cache_seqlens.ndim == 0 and cache_seqlens.dtype.kind in "iu":
        cache_seqlens = cache_seqlens[()]  # a 0-d NumPy integer array: the int it holds
    if _arrays.is_integer(cache_seqlens):
        if not -(2**63) <= int(cache_seqlens) < 2**63:
            raise ValueError(f"cache_seqlens must be >= 0 and within the cache capacity; got {int(cache_seqlens)}")
        cache_seqlens = np.full(batch, int(cache_seqlens), dtype=np.int64)
    return V.check_index_array(cache_seqlens, "cache_seqlens", like=q, length=batch)


def check_new_tokens(q, k, v, k_cache, v_cache):
    """New tokens k, v of q's dtype and batch, the caches' heads and head dims: (k, v, seqlen_new).
    Also cuflash.parallel's sharded cache."""
    k, v = _arrays.as_array(k, "k"), _arrays.as_array(v, "v")
    V.check_qkv(q, k, v)
    batch, new, nheads_k, headdim = q.shape[0], k.shape[1], k_cache.shape[2], q.shape[3]
    if tuple(k.shape) != (batch, new, nheads_k, headdim) or tuple(v.shape) != (batch, new, nheads_k, v_cache.shape[3]):
        raise ValueError(
            f"k and v must have shapes ({batch}, seqlen_new, {nheads_k}, {headdim}) and "
            f"({batch}, seqlen_new, {nheads_k}, {v_cache.shape[3]}); got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    return k, v, new


def _cpu_gather_buffers(c: _Call):
    """The CPU path reads the positions in use only, [0, longest length): (span, rows, slots,
    keys, values), with key/value buffers of the gathered copies for paged or indexed caches
    (None for a contiguous cache, read through views)."""
    span = int(c.lengths.max()) if c.batch else 0
    if not (c.paged or c.cache_batch_idx is not None):
        return span, None, None, None, None
    rows, slots = _cpu_rows_and_slots(c.lengths, span, c.block_table, c.page_size, c.cache_batch_idx)
    keys = np.empty((c.batch, span) + tuple(c.k_cache.shape[2:]), dtype=c.k_cache.dtype)
    values = np.empty((c.batch, span) + tuple(c.v_cache.shape[2:]), dtype=c.v_cache.dtype)
    return span, rows, slots, keys, values


def _append(c: _Call):
    """Step 2: write the new tokens at positions cache_seqlens[b] + t (in place).  The GPU kernel
    checks the index values itself and writes nothing for a sequence whose slots are not legal;
    it returns their flags, for step 3 (None on the CPU, whose values were checked on the host)."""
    if c.gpu:
        from . import _gpu

        return _gpu.append_kv(c.k_cache, c.v_cache, c.k, c.v, c.cache_seqlens, c.capacity, block_table=c.block_table,
                              cache_batch_idx=c.cache_batch_idx)
    pos = c.cache_seqlens.astype(np.int64)[:, None] + np.arange(c.new)[None, :]  # (batch, new)
    if c.paged:
        pages, slots = _page_slots(np, c.block_table, pos, c.page_size)
        c.k_cache[pages, slots] = c.k
        c.v_cache[pages, slots] = c.v
    else:
        rows = np.arange(c.batch) if c.cache_batch_idx is None else c.cache_batch_idx.astype(np.int64)
        c.k_cache[rows[:, None], pos] = c.k
        c.v_cache[rows[:, None], pos] = c.v
    return None


def _attend(p, c: _Call, gather, seq_bad, num_splits, fast_key):
    """Step 3: attention of each sequence to its valid prefix; returns (out, lse)."""
    xp = _arrays.module_of(c.q)
    out = xp.empty((p.batch, p.seqlen_q, p.nheads_q, p.headdim_v), dtype=c.q.dtype)
    lse = xp.empty((p.batch, p.nheads_q, p.seqlen_q), dtype=lse_dtype(c.q.dtype))
    if p.is_empty:
        return out, lse
    if not c.gpu:
        span, rows, slots, keys, values = gather
        if keys is None:
            keys, values = c.k_cache[:, :span], c.v_cache[:, :span]
        else:
            _gather_into(keys, c.k_cache, rows, slots)
            _gather_into(values, c.v_cache, rows, slots)
        _cpu.forward(dataclasses.replace(p, seqlen_k=span), c.q, keys, values, out, lse)
        return out, lse
    from . import _gpu

    record = []
    _gpu.forward(p, c.q, c.k_cache, c.v_cache, out, lse, block_table=c.block_table, cache_batch_idx=c.cache_batch_idx,
                 seq_bad=seq_bad, seqlen_new=c.new, num_splits=int(num_splits), record=record,
                 call="attention_with_kvcache")
    if fast_key is not None and record:
        from . import _fastpath

        _fastpath.remember(fast_key, record[0], ("q", "k", "v", "seqlens_k", "block_table"),
                           (c.q, c.k_cache, c.v_cache, c.cache_seqlens, c.block_table), out, False, lse.shape)
    return out, lse


def _cpu_rows_and_slots(lengths, span, block_table, page_size, cache_batch_idx):
    """(batch, span) cache indices (row or page, slot) of positions [0, span) of each sequence.
    Positions past a sequence's length read row/page 0, slot 0 (never used), so block_table
    entries past the used pages may hold anything."""
    positions = np.arange(span)
    used = positions[None, :] < np.asarray(lengths)[:, None]
    if block_table is None:
        rows = np.broadcast_to(cache_batch_idx.astype(np.int64)[:, None], used.shape)
        return rows, np.broadcast_to(positions, used.shape)
    pages, slots = _page_slots(np, block_table, np.broadcast_to(positions, used.shape), page_size)
    return np.where(used, pages, 0), np.where(used, slots, 0)


def _gather_into(dst, cache, rows, slots):
    """dst[b, t] = cache[rows[b, t], slots[b, t]], straight into dst where the cache's first two
    axes merge without a copy (no temporary the size of dst)."""
    n, s = cache.shape[:2]
    if n > 1 and s > 1 and cache.strides[0] != s * cache.strides[1]:  # reshaping would copy the cache
        dst[...] = cache[rows, slots]
        return
    flat = cache.reshape((-1,) + tuple(cache.shape[2:]))  # a view: the first two axes merge
    np.take(flat, rows * s + slots, axis=0, out=dst, mode="clip")  # "raise" would buffer out


def _check_ranges(lengths, new, capacity, page_size, table, num_rows, rows):
    """Lengths within capacity; used pages and rows within the cache (values known on the host)."""
    if lengths is None or not lengths.size:
        return
    if lengths.min() < 0:
        raise ValueError(f"cache_seqlens must be >= 0; got min {lengths.min()}")
    longest = int(lengths.max()) + new  # a Python int: no wrap-around near the dtype's maximum
    if longest > capacity:
        where = "" if table is None else f" (block_table rows of {table.shape[1]} pages of {page_size} slots)"
        raise ValueError(
            f"cache_seqlens + {new} new tokens exceed the cache capacity {capacity}{where}; got max length {longest}"
        )
    if table is not None:
        table, used = _pages_read(table, lengths.astype(np.int64) + new, page_size)
        bad = used & ((table < 0) | (table >= num_rows))
        if bad.any():
            b, j = np.argwhere(bad)[0]
            pages = f"0..{num_rows - 1}" if num_rows else "it has no pages"
            raise ValueError(f"block_table[{b}, {j}] = {table[b, j]} is not a page of the cache ({pages})")
    if rows is not None and (rows.min() < 0 or rows.max() >= num_rows):
        within = f"[0, {num_rows - 1}]" if num_rows else "the cache's rows, and it has none (batch 0)"
        raise ValueError(f"cache_batch_idx entries must lie in {within}; got min {rows.min()}, max {rows.max()}")


def check_cache_writes(q, k, v, k_cache, v_cache):
    """Appending k, v writes the caches in place: they must be writable, distinct and without
    elements that share memory, q, k and v must not live in them (k_cache is written before v is
    read, and q is read after both), and GPU caches need a contiguous last axis (the append kernel
    copies whole rows).  Also cuflash.parallel's sharded cache."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(cache, np.ndarray) and not cache.flags.writeable:
            raise ValueError(f"{name} is read-only (or a broadcast view); new tokens are written into it in place")
        if cache.size > 1 and not V.elements_apart(cache):
            raise ValueError(f"{name} has elements that share memory (a zero or overlapping stride): a new token "
                             "written at one position would show at another; pass a cache whose elements are distinct")
        if _arrays.is_gpu(q) and cache.size and cache.strides[-1] != cache.itemsize:
            raise ValueError(f"{name} has a strided last axis (stride {cache.strides[-1]} bytes); appending on the "
                             "GPU needs its head dim contiguous (pass a contiguous cache)")
    if V.shares_memory(k_cache, v_cache):
        raise ValueError("k_cache and v_cache share memory; new tokens for both would overwrite each other")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.size and any(V.shares_memory(x, cache) for cache in (k_cache, v_cache) if cache.size):
            raise ValueError(f"{name} shares memory with the cache, which this call writes before it reads {name}")


def _check_append_targets(c: _Call):
    """The caches as check_cache_writes wants them, and (where the index values are on the host)
    no new token may land on a slot that another new token or another sequence's keys occupy."""
    check_cache_writes(c.q, c.k, c.v, c.k_cache, c.v_cache)
    lengths, table, rows, new, page_size = c.host_lengths, c.host_table, c.host_rows, c.new, c.page_size
    if lengths is None or not lengths.size:
        return
    if rows is not None:
        # Two sequences appending to one row always collide: one writes where the other reads.
        if np.unique(rows).size != rows.size:
            raise ValueError("cache_batch_idx sends two sequences to the same cache row; each appending "
                             "sequence needs a row of its own")
        return
    if table is None:
        return  # one cache row per sequence: distinct by construction
    pos = lengths.astype(np.int64)[:, None] + np.arange(new)[None, :]  # (batch, new) positions written
    pages, in_page = _page_slots(np, table, pos, page_size)
    slots = pages * page_size + in_page
    if np.unique(slots).size != slots.size:
        raise ValueError("block_table maps two new tokens to the same page slot; each new token "
                         "needs its own slot")
    _check_shared_pages(table, lengths.astype(np.int64) + new, page_size, pages, pos)


def _page_slots(xp, table, pos, page_size):
    """(page, slot in the page) of position pos[b, t] of sequence b, through its block_table row."""
    return xp.take_along_axis(table, pos // page_size, axis=1).astype(np.int64), pos % page_size


def _pages_read(table, ends, page_size):
    """The block_table columns that positions [0, ends[b]) of some sequence use (a wide table is
    not scanned past them), and the (batch, those columns) mask of the entries each one uses."""
    table = table[:, :-(-int(ends.max(initial=0)) // page_size)]
    return table, np.arange(table.shape[1])[None, :] < -(-ends[:, None] // page_size)  # ceil


def _check_shared_pages(table, ends, page_size, pages, pos):
    """A page may be shared (a common prefix), but no new token may land on a slot that another
    sequence reads, or that its own sequence reads at another position: positions [0, ends[b])
    of sequence b, through its block_table row.

    Counted, not paired (memory in the entries plus the slots written, whatever the batch): entry
    (r, i) of page P reads its slots below ``reach = min(ends[r] - i * page_size, page_size)``, so
    slot o of P has as many readers as P's entries of reach > o; the writer's own entry is one of
    them when it reads the position it writes."""
    table, used = _pages_read(table, ends, page_size)
    owner, index = np.nonzero(used)  # every (sequence, page entry) read
    page = table[owner, index].astype(np.int64)
    reach = np.minimum(ends[owner] - index * page_size, page_size)
    keys = np.sort(page * (page_size + 1) + reach)
    page_w, offset, written = pages.ravel().astype(np.int64), pos.ravel() % page_size, pos.ravel()
    writer = np.repeat(np.arange(pages.shape[0]), pages.shape[1])
    base = page_w * (page_size + 1)
    readers = np.searchsorted(keys, base + page_size, "right") - np.searchsorted(keys, base + offset, "right")
    clash = readers - (written < ends[writer]) > 0
    if clash.any():
        i = int(np.flatnonzero(clash)[0])
        b, t = divmod(i, pages.shape[1])
        read = index * page_size + offset[i]  # each entry's position of the slot
        others = (page == page_w[i]) & (read < ends[owner]) & ((owner != b) | (read != written[i]))
        j = int(np.flatnonzero(others)[0])
        who = f"sequence {owner[j]} reads" if owner[j] != b else f"it also reads as its position {read[j]}"
        raise ValueError(f"block_table: sequence {b}'s new token {t} would overwrite page {pages[b, t]}, "
                         f"slot {offset[i]}, which {who}; each new token needs a slot no other "
                         "position reads")
