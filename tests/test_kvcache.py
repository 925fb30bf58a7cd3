"""attention_with_kvcache: in-place append, contiguous and paged caches, against the reference.

Shared bodies: NumPy (CPU path) and CuPy (GPU kernels).  Cache entries past each valid length
hold NaN, so any read of them shows.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _arrays
from cuflash.reference import assert_exact, attention_ref, naive_attention

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
DTYPE_IDS = ["fp16", "bf16", "fp32", "fp64"]


def _check_per_sequence(out, lse, q, keys, values, lengths, **opts):
    """Each sequence against the reference over its own valid keys (exactness rule)."""
    out, lse = _arrays.to_numpy(out), _arrays.to_numpy(lse)
    for b, n in enumerate(lengths):
        args = (q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n])
        ref, ref_lse = attention_ref(*args, **opts)
        naive, naive_lse = naive_attention(*args, return_lse=True, **opts)
        assert_exact(out[b:b + 1], ref, naive, f"out of sequence {b}")
        assert_exact(lse[b:b + 1], ref_lse, naive_lse, f"lse of sequence {b}")


def _poisoned_cache(rng, dtype, batch, capacity, hkv, d, lengths):
    cache = rng.standard_normal((batch, capacity, hkv, d)).astype(dtype)
    for b, n in enumerate(lengths):
        cache[b, n:] = np.nan
    return cache


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("new", [0, 1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_cache(xp, rng, dtype, heads, new, causal):
    hq, hkv = heads
    lengths = np.array([0, 1, 17, 64 - new], dtype=np.int32)
    batch, capacity, d = len(lengths), 64, 64
    kc = _poisoned_cache(rng, dtype, batch, capacity, hkv, d, lengths)
    vc = _poisoned_cache(rng, dtype, batch, capacity, hkv, d, lengths)
    q = rng.standard_normal((batch, max(new, 1), hq, d)).astype(dtype)
    k_new = rng.standard_normal((batch, new, hkv, d)).astype(dtype)
    v_new = rng.standard_normal((batch, new, hkv, d)).astype(dtype)
    kd, vd = xp.asarray(kc), xp.asarray(vc)
    extra = dict(k=xp.asarray(k_new), v=xp.asarray(v_new)) if new else {}
    out, lse = cuflash.attention_with_kvcache(xp.asarray(q), kd, vd, cache_seqlens=xp.asarray(lengths),
                                              causal=causal, return_lse=True, **extra)
    for b, n in enumerate(lengths):  # the cache now holds the new tokens, the rest is untouched
        kc[b, n:n + new], vc[b, n:n + new] = k_new[b], v_new[b]
    np.testing.assert_array_equal(_arrays.to_numpy(kd).view(np.uint16), kc.view(np.uint16))
    np.testing.assert_array_equal(_arrays.to_numpy(vd).view(np.uint16), vc.view(np.uint16))
    _check_per_sequence(out, lse, q, kc, vc, lengths + new, causal=causal)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["fp16", "fp32", "fp64"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_cache(xp, rng, page_size, causal, dtype):
    """(float32/float64: the one-pass kernel reads the pages, flash_fwd.cu's kPagedForm.)"""
    hq, hkv, d, new = 8, 2, 64, 2
    lengths = np.array([0, 1, page_size, 3 * page_size + 5], dtype=np.int64)
    batch = len(lengths)
    max_pages = int(-(-(lengths.max() + new) // page_size)) + 1
    num_pages = batch * max_pages + 3
    perm = rng.permutation(num_pages)  # pages scattered through the pool
    table = perm[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    logical = [rng.standard_normal((max_pages * page_size, hkv, d)).astype(dtype) for _ in range(batch)]
    k_pool = np.full((num_pages, page_size, hkv, d), np.nan, dtype=dtype)
    v_pool = np.full((num_pages, page_size, hkv, d), np.nan, dtype=dtype)
    v_logical = [rng.standard_normal(x.shape).astype(dtype) for x in logical]
    for b, n in enumerate(lengths):
        for pos in range(n):
            page, slot = table[b, pos // page_size], pos % page_size
            k_pool[page, slot], v_pool[page, slot] = logical[b][pos], v_logical[b][pos]
    for b, n in enumerate(lengths):  # entries past the used pages may hold anything
        table[b, -(-(n + new) // page_size):] = -1
    q = rng.standard_normal((batch, new, hq, d)).astype(dtype)
    k_new = rng.standard_normal((batch, new, hkv, d)).astype(dtype)
    v_new = rng.standard_normal((batch, new, hkv, d)).astype(dtype)
    out, lse = cuflash.attention_with_kvcache(
        xp.asarray(q), xp.asarray(k_pool), xp.asarray(v_pool), xp.asarray(k_new), xp.asarray(v_new),
        cache_seqlens=xp.asarray(lengths), block_table=xp.asarray(table), causal=causal, return_lse=True)
    keys = np.stack([np.concatenate([lg[:n], k_new[b], lg[n + new:]]) for b, (lg, n) in enumerate(zip(logical, lengths))])
    values = np.stack([np.concatenate([lg[:n], v_new[b], lg[n + new:]]) for b, (lg, n) in enumerate(zip(v_logical, lengths))])
    _check_per_sequence(out, lse, q, keys, values, lengths + new, causal=causal)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float64], ids=["bf16", "fp32", "fp64"])
def test_cache_batch_idx_and_options(xp, rng, dtype):
    d = 128
    lengths = np.array([5, 40, 0], dtype=np.int64)
    rows = np.array([3, 0, 1], dtype=np.int64)
    kc = rng.standard_normal((4, 48, 2, d)).astype(dtype)
    vc = rng.standard_normal((4, 48, 2, d)).astype(dtype)
    q = rng.standard_normal((3, 2, 4, d)).astype(dtype)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32)
    opts = dict(causal=True, window_size=(8, 0), softcap=20.0)
    out, lse = cuflash.attention_with_kvcache(
        xp.asarray(q), xp.asarray(kc), xp.asarray(vc), cache_seqlens=xp.asarray(lengths),
        cache_batch_idx=xp.asarray(rows), alibi_slopes=xp.asarray(slopes), return_lse=True, **opts)
    _check_per_sequence(out, lse, q, kc[rows], vc[rows], lengths, alibi_slopes=slopes, **opts)


def test_decode_equals_full_attention_over_the_prefix(xp, rng):
    """One new token attending to cache + itself = the last row of causal attention."""
    d, n = 64, 30
    seq = rng.standard_normal((1, n + 1, 2, d)).astype(np.float16)
    kc = np.zeros((1, 64, 2, d), np.float16)
    vc = np.zeros((1, 64, 2, d), np.float16)
    kc[0, :n], vc[0, :n] = seq[0, :n], seq[0, :n]
    out = cuflash.attention_with_kvcache(xp.asarray(seq[:, n:]), xp.asarray(kc), xp.asarray(vc),
                                         xp.asarray(seq[:, n:]), xp.asarray(seq[:, n:]), cache_seqlens=n, causal=True)
    full = cuflash.attention(xp.asarray(seq), xp.asarray(seq), xp.asarray(seq), causal=True)
    np.testing.assert_allclose(_arrays.to_numpy(out)[0, 0].astype(np.float32),
                               _arrays.to_numpy(full)[0, n].astype(np.float32), atol=2e-3)


def test_errors(rng):
    q = np.zeros((2, 1, 4, 8), np.float16)
    kc = np.zeros((2, 16, 2, 8), np.float16)
    new = np.zeros((2, 1, 2, 8), np.float16)
    call = cuflash.attention_with_kvcache
    with pytest.raises(ValueError, match="exceed the cache capacity 16"):
        call(q, kc, kc.copy(), new, new, cache_seqlens=np.array([3, 16]))
    with pytest.raises(ValueError, match="k and v must be given together"):
        call(q, kc, kc.copy(), new, cache_seqlens=np.array([3, 4]))
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        call(q, kc, kc.copy(), cache_seqlens=np.array([-1, 4]))
    with pytest.raises(TypeError, match="cache_seqlens must have dtype int32 or int64"):
        call(q, kc, kc.copy(), cache_seqlens=np.array([1.0, 4.0]))
    with pytest.raises(ValueError, match="num_splits"):
        call(q, kc, kc.copy(), cache_seqlens=np.array([1, 4]), num_splits=-1)
    with pytest.raises(ValueError, match="cannot be combined"):
        call(q, kc, kc.copy(), cache_seqlens=np.array([1, 4]), block_table=np.zeros((2, 1), np.int32),
             cache_batch_idx=np.array([0, 1]))
    pool = np.zeros((3, 4, 2, 8), np.float16)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 7 is not a page"):
        call(q, pool, pool.copy(), cache_seqlens=np.array([2, 6]), block_table=np.array([[0, -1], [1, 7]]))
    with pytest.raises(ValueError, match=r"exceed the cache capacity 8 \(block_table rows of 2 pages of 4 slots\)"):
        call(q, pool, pool.copy(), cache_seqlens=np.array([2, 9]), block_table=np.array([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match="cache_batch_idx entries must lie in"):
        call(q, kc, kc.copy(), cache_seqlens=np.array([1, 4]), cache_batch_idx=np.array([0, 2]))
    with pytest.raises(ValueError, match="k_cache has 2 sequences; q has 3"):
        call(np.zeros((3, 1, 4, 8), np.float16), kc, kc.copy(), cache_seqlens=np.array([1, 1, 1]))


def test_numpy_index_arrays_are_checked_with_gpu_data_too(xp):
    """Values of NumPy index arrays are checked before they move to the GPU (no device copy)."""
    q = xp.zeros((2, 1, 4, 8), np.float16)
    kc = xp.zeros((2, 16, 2, 8), np.float16)
    with pytest.raises(ValueError, match="exceed the cache capacity 16"):
        cuflash.attention_with_kvcache(q, kc, kc.copy(), cache_seqlens=np.array([3, 17]))
    with pytest.raises(ValueError, match="seqlens_k values must lie in"):
        cuflash.attention(q, kc, kc, seqlens_k=np.array([3, 17]))
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        cuflash.attention_varlen(q[:, 0], kc[0], kc[0], np.array([0, 2, 1]), np.array([0, 8, 16]))


def _small(dtype=np.float32, hq=2):
    q = np.ones((2, 1, hq, 8), dtype)
    kc, vc = np.zeros((2, 8, 2, 8), dtype), np.zeros((2, 8, 2, 8), dtype)
    k = np.ones((2, 1, 2, 8), dtype)
    return q, kc, vc, k


@pytest.mark.parametrize("bad", [dict(causal="yes"), dict(return_lse=1), dict(softcap=-1.0), dict(window_size=(1,)),
                                 dict(alibi_slopes=np.ones(5, np.float32)), dict(hq=3)],
                         ids=["causal", "return_lse", "softcap", "window", "alibi", "heads"])
def test_refused_call_leaves_the_cache_untouched(bad):
    bad = dict(bad)
    q, kc, vc, k = _small(hq=bad.pop("hq", 2))
    with pytest.raises((TypeError, ValueError)):
        cuflash.attention_with_kvcache(q, kc, vc, k, 2 * k, cache_seqlens=2, **bad)
    assert not kc.any() and not vc.any()


def test_list_caches_take_no_append():
    """A list cache would be copied and the appended tokens lost: a TypeError says so; without new
    tokens a list cache is read as NumPy reads it."""
    q, kc, vc, k = _small()
    with pytest.raises(TypeError, match=r"k_cache must be a writable array .* when k and v are appended"):
        cuflash.attention_with_kvcache(q, kc.tolist(), vc, k, k, cache_seqlens=2)
    with pytest.raises(TypeError, match=r"v_cache must be a writable array"):
        cuflash.attention_with_kvcache(q, kc, vc.tolist(), k, k, cache_seqlens=2)
    assert not kc.any() and not vc.any()
    q, kc, vc, k = _small(np.float64)  # (a list is taken as float64)
    out = cuflash.attention_with_kvcache(q, kc.tolist(), vc.tolist(), cache_seqlens=2)
    assert np.array_equal(out, cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=2))


def test_append_targets_are_checked_before_writing():
    q, kc, vc, k = _small()
    ro = vc.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="v_cache is read-only"):
        cuflash.attention_with_kvcache(q, kc, ro, k, k, cache_seqlens=2)
    assert not kc.any()
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        cuflash.attention_with_kvcache(q, kc, kc, k, k, cache_seqlens=2)
    with pytest.raises(ValueError, match="q shares memory with the cache"):
        cuflash.attention_with_kvcache(kc[:, 3:4], kc, vc, k, k, cache_seqlens=2)
    with pytest.raises(ValueError, match="same cache row"):
        cuflash.attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=2, cache_batch_idx=np.array([1, 1]))
    pool_k, pool_v = np.zeros((4, 4, 2, 8), np.float32), np.zeros((4, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="same page slot"):
        cuflash.attention_with_kvcache(q, pool_k, pool_v, k, k, cache_seqlens=np.array([2, 2]),
                                       block_table=np.array([[0, 1], [0, 2]]))
    assert not (kc.any() or vc.any() or pool_k.any() or pool_v.any())
    # The same page shared read-only (no new tokens written to it) stays allowed: prefix sharing.
    out = cuflash.attention_with_kvcache(q, pool_k, pool_v, cache_seqlens=np.array([2, 2]),
                                         block_table=np.array([[0, 1], [0, 2]]))
    assert out.shape == (2, 1, 2, 8)


def test_cache_edge_shapes_and_lengths():
    q, _, _, _ = _small()
    empty_pool = np.zeros((0, 4, 2, 8), np.float32)
    out, lse = cuflash.attention_with_kvcache(q, empty_pool, empty_pool.copy(), cache_seqlens=0,
                                              block_table=np.zeros((2, 1), np.int64), return_lse=True)
    assert not out.any() and np.all(lse == -np.inf)
    with pytest.raises(ValueError, match="page size 0"):
        cuflash.attention_with_kvcache(q, np.zeros((3, 0, 2, 8), np.float32), np.zeros((3, 0, 2, 8), np.float32),
                                       cache_seqlens=0, block_table=np.zeros((2, 1), np.int64))
    _, kc, vc, _ = _small()
    for huge in (2**63, 2**70):
        with pytest.raises(ValueError, match="cache_seqlens"):
            cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=huge)
    big_endian = np.array([3, 4], dtype=">i8")
    out = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=big_endian)
    assert out.shape == (2, 1, 2, 8)
    with pytest.raises(TypeError, match="k_cache float16"):
        cuflash.attention_with_kvcache(q, kc.astype(np.float16), vc, cache_seqlens=1)


def test_cpu_reads_only_the_positions_in_use(rng):
    """Hostile pass 3: the NumPy path gathered block_table width x page size positions after
    appending (a table 10^7 pages wide: MemoryError with the cache already written) and
    converted the whole capacity of a contiguous cache on every call."""
    q, kc, vc, k = _small()
    table = np.zeros((2, 10**7), np.int32)  # entries past the used pages may hold anything
    table[1, 0] = 1
    pages_k, pages_v = kc.copy(), vc.copy()  # 2 pages of 8 slots
    out, lse = cuflash.attention_with_kvcache(q, pages_k, pages_v, k, 2 * k, cache_seqlens=np.array([2, 3]),
                                             block_table=table, return_lse=True)
    ref_k, ref_v = kc.copy(), vc.copy()
    plain, plain_lse = cuflash.attention_with_kvcache(q, ref_k, ref_v, k, 2 * k, cache_seqlens=np.array([2, 3]),
                                                      return_lse=True)
    np.testing.assert_array_equal(pages_k, ref_k)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)
    # A contiguous cache far longer than its lengths (converted in full before: ~1 s per call).
    big = rng.standard_normal((1, 1 << 20, 1, 8)).astype(np.float16)
    qb = rng.standard_normal((1, 1, 2, 8)).astype(np.float16)
    _check_per_sequence(cuflash.attention_with_kvcache(qb, big, big, cache_seqlens=7),
                        cuflash.attention_with_kvcache(qb, big, big, cache_seqlens=7, return_lse=True)[1],
                        qb, big, big, [7])


def test_head_count_error_names_k_cache():
    q, kc, vc, _ = _small(hq=3)
    with pytest.raises(ValueError, match="^k_cache has 2 heads"):
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=2)


def test_append_onto_own_earlier_key_is_refused():
    """Hostile pass 3: a page listed twice in one block_table row let the new token replace the
    sequence's own key 1 silently; now refused, with the cache untouched."""
    rng = np.random.default_rng(0)
    kc = rng.random((2, 4, 1, 4)).astype(np.float32)
    vc, before = kc.copy(), kc.copy()
    q, kn = np.zeros((1, 1, 1, 4), np.float32), np.full((1, 1, 1, 4), 9, np.float32)
    with pytest.raises(ValueError, match=r"page 0, slot 1, which it also reads as its position 1"):
        cuflash.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=5, block_table=np.array([[0, 0]]))
    np.testing.assert_array_equal(kc, before)
    np.testing.assert_array_equal(vc, before)


def test_head_count_error_points_a_torch_ordered_cache_to_swapaxes():
    """A (batch, nheads, capacity, headdim) cache is read as capacity-many heads: the error says how
    to reorder it (attention_with_kvcache has no layout= argument to point to)."""
    q = np.zeros((1, 1, 4, 8), np.float32)
    cache = np.zeros((1, 2, 64, 8), np.float32)  # (batch, nheads_k, capacity, headdim)
    with pytest.raises(ValueError, match=r"k_cache has 64 heads; .*\.swapaxes\(1, 2\)") as info:
        cuflash.attention_with_kvcache(q, cache, cache, cache_seqlens=1)
    assert "layout" not in str(info.value)


@pytest.mark.parametrize("case", ["past-capacity", "negative", "table-int64-high-bits", "table-negative",
                                  "row-negative", "row-past"])
def test_bad_index_values_with_appends_leave_the_cache_untouched(case):
    """NumPy index arrays are checked on the host before the append: a ValueError naming the
    argument, and no slot of the cache written, not even those of the sequences whose values are
    fine (the GPU forms, checked on the device, append those: tests/test_gpu_index_safety.py).
    2**32 + 1 is out of range only in its high 32 bits (its low word, 1, is a page)."""
    q, kc, vc, k = _small()  # 2 sequences; contiguous rows of 8 slots
    pool_k, pool_v = np.zeros((4, 4, 2, 8), np.float32), np.zeros((4, 4, 2, 8), np.float32)  # 4 pages of 4 slots
    table = np.array([[0, 1], [2, 3]], np.int64)
    bad_table = table.copy()
    bad_table[1, 1] = 2**32 + 1 if case == "table-int64-high-bits" else -1
    paged = dict(k_cache=pool_k, v_cache=pool_v)
    contiguous = dict(k_cache=kc, v_cache=vc)
    args, pattern = {
        "past-capacity": (dict(paged, cache_seqlens=np.array([2, 8]), block_table=table),
                          r"exceed the cache capacity 8 \(block_table rows of 2 pages of 4 slots\)"),
        "negative": (dict(paged, cache_seqlens=np.array([2, -1]), block_table=table), "cache_seqlens must be >= 0"),
        "table-int64-high-bits": (dict(paged, cache_seqlens=np.array([2, 5]), block_table=bad_table),
                                  r"block_table\[1, 1\] = 4294967297 is not a page of the cache \(0\.\.3\)"),
        "table-negative": (dict(paged, cache_seqlens=np.array([2, 5]), block_table=bad_table),
                           r"block_table\[1, 1\] = -1 is not a page"),
        "row-negative": (dict(contiguous, cache_seqlens=np.array([2, 5]), cache_batch_idx=np.array([0, -1])),
                         r"cache_batch_idx entries must lie in \[0, 1\]"),
        "row-past": (dict(contiguous, cache_seqlens=np.array([2, 5]), cache_batch_idx=np.array([1, 2])),
                     r"cache_batch_idx entries must lie in \[0, 1\]"),
    }[case]
    with pytest.raises(ValueError, match=pattern):
        cuflash.attention_with_kvcache(q, k=k, v=2 * k, **args)
    assert not (kc.any() or vc.any() or pool_k.any() or pool_v.any())


def test_cache_seqlens_as_a_zero_dimensional_array_is_the_int_it_holds():
    """Fresh-user report (session 38): 3 and np.int64(3) were taken for every sequence, np.array(3)
    was refused ("must have 1 dimension(s)")."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    kc, vc = (rng.standard_normal((2, 6, 2, 8)).astype(np.float32) for _ in range(2))
    want = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=3)
    for lens in (np.array(3), np.array(3, np.uint32)):
        np.testing.assert_array_equal(cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens), want)
