"""Bad GPU index values: no access outside the arrays, NaN rows, a deferred InvalidIndexError,
appends that are refused instead of wrapped (docs/conventions.md, "Index arrays").

Each bad form runs on the GPU; then ``cuflash.synchronize()`` must raise the documented error
(and the call after it must not), the affected rows must be NaN, and every other row must equal,
bit for bit, the same call with the bad entries repaired (the sequences are computed
independently; backward runs with ``deterministic=True``).  ``out=`` sits between guard regions
of one buffer, which must come back bit-identical; KV caches must change only at the legal
append slots.  Skipped without a CUDA GPU; compute-sanitizer runs the same forms in
scripts/sanitize_run.py.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash

from .conftest import requires_gpu
from .test_gpu_forward import _cp, _rand
from .test_kvcache import _check_per_sequence

pytestmark = [pytest.mark.gpu, requires_gpu]

DTYPES = [np.float16, ml_dtypes.bfloat16]
# the KV-cache tests' dtypes: float32/float64 read their caches (paged too) with the one-pass kernel
CACHE_DTYPES, CACHE_IDS = DTYPES + [np.float32, np.float64], ["fp16", "bf16", "fp32", "fp64"]


def _nan_rows(x):
    """Per leading index: whether every value of that row is NaN (as a NumPy bool array)."""
    a = np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float32)
    return np.isnan(a.reshape(a.shape[0], -1)).all(axis=1)


def _expect_error(*words):
    with pytest.raises(cuflash.InvalidIndexError) as info:
        cuflash.synchronize()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    cuflash.synchronize()  # cleared: nothing more to raise


def _guarded(shape, dtype):
    """(view, buffer): a NaN-poisoned array inside a buffer whose 4096-element margins hold a pattern."""
    cp = _cp()
    n = int(np.prod(shape))
    buf = cp.asarray(np.arange(n + 8192, dtype=np.float32).astype(dtype))
    buf[4096:4096 + n] = np.nan
    return buf[4096:4096 + n].reshape(shape), buf


def _guarded_cache(rng, shape, dtype):
    """(k cache, v cache, k buffer, v buffer): random caches, each inside a buffer of _guarded's margins."""
    cp = _cp()
    (kc, kbuf), (vc, vbuf) = _guarded(shape, dtype), _guarded(shape, dtype)
    kc[...] = cp.asarray(_rand(rng, kc.shape, dtype))
    vc[...] = cp.asarray(_rand(rng, vc.shape, dtype))
    return kc, vc, kbuf, vbuf


def _margins_intact(buf):
    cp = _cp()
    ref = cp.asarray(np.arange(buf.size, dtype=np.float32).astype(buf.dtype))
    n = buf.size - 8192
    return bool((buf[:4096].view(cp.uint16) == ref[:4096].view(cp.uint16)).all()) and \
        bool((buf[4096 + n:].view(cp.uint16) == ref[4096 + n:].view(cp.uint16)).all())


class _GuardedPool:
    """Inside ``with``, every CuPy allocation (a call's outputs, LSE, copies and scratch, and the
    arrays made there) is carved out of one buffer holding a byte pattern: 512-byte aligned, with
    at least 4096 pattern bytes before and after each.  ``intact()``: whether every byte that no
    allocation owns still holds the pattern, i.e. nothing was written outside the arrays.  (An
    allocation that outlives the test, such as a stream's split scratch, keeps the buffer alive.)"""

    def __init__(self, nbytes=1 << 23):
        cp = _cp()
        self.pattern = np.resize(np.arange(251, dtype=np.uint8), nbytes)
        self.buf = cp.asarray(self.pattern)
        self.owned = np.zeros(nbytes, dtype=bool)
        self.next = 4096
        self._using = None

    def _malloc(self, size):
        start = -(-self.next // 512) * 512
        if start + size + 4096 > self.buf.size:
            raise MemoryError(f"_GuardedPool of {self.buf.size} bytes is too small for another {size}")
        self.owned[start:start + size] = True
        self.next = start + size + 4096
        return self.buf.data + start

    def __enter__(self):
        self._using = _cp().cuda.using_allocator(self._malloc)
        self._using.__enter__()
        return self

    def __exit__(self, *exc):
        return self._using.__exit__(*exc)

    def intact(self):
        _cp().cuda.Device().synchronize()
        free = ~self.owned
        return bool(np.array_equal(self.buf.get()[free], self.pattern[free]))


# --- attention_varlen and its backward ----------------------------------------------------------

# (bad cu_seqlens_q, bad cu_seqlens_k, repaired q, repaired k, max_seqlen_q, first affected
# sequence, words of the message); q has 100 rows, k 200.
VARLEN_CASES = {
    "q_past_rows": ([0, 50, 120], [0, 80, 200], [0, 50, 100], [0, 80, 200], 70, 1, ("cu_seqlens_q[2]",)),
    "q_decreasing": ([0, 60, 40, 100], [0, 50, 100, 200], [0, 60, 60, 100], [0, 50, 100, 200], 60, 1, ("cu_seqlens_q[2]",)),
    "q_negative_start": ([-5, 20, 100], [0, 80, 200], [0, 20, 100], [0, 80, 200], 80, 0, ("cu_seqlens_q[0]",)),
    "k_past_rows": ([0, 30, 100], [0, 90, 900], [0, 30, 100], [0, 90, 200], 70, 1, ("cu_seqlens_k[2]",)),
    "k_negative": ([0, 30, 100], [0, -7, 200], [0, 30, 100], [0, 0, 200], 70, 0, ("cu_seqlens_k[1]",)),
    "q_longer_than_max": ([0, 40, 100], [0, 80, 200], [0, 40, 100], [0, 80, 200], 50, 1, ("max_seqlen_q = 50", "sequence 1")),
}


@pytest.mark.parametrize("which", ["q", "k"])
def test_varlen_max_seqlen_zero_still_checks_the_offsets(rng, which):
    """max_seqlen_q (or _k) = 0 launches no attention kernel, but GPU offsets naming longer
    sequences are still an error (session 12 left this returning zeros silently)."""
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, s, np.float16)) for s in ((50, 2, 64), (60, 2, 64), (60, 2, 64)))
    cu_q, cu_k = cp.asarray(np.array([0, 20, 50], np.int32)), cp.asarray(np.array([0, 30, 60], np.int32))
    args = dict(max_seqlen_q=0 if which == "q" else 50, max_seqlen_k=0 if which == "k" else 60)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **args)
    _expect_error("attention_varlen", f"max_seqlen_{which} = 0")
    assert _nan_rows(out).all() and np.isnan(lse.get()).all()  # every sequence is longer than 0
    # Malformed key offsets with max_seqlen_k = 0: sequence 0 (no keys) is fine, sequence 1 on is NaN.
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cp.asarray(np.array([0, 0, -3], np.int32)), return_lse=True,
                                        max_seqlen_q=50, max_seqlen_k=0)
    _expect_error("attention_varlen", "cu_seqlens_k[2]")
    rows = _nan_rows(out)
    assert rows[20:].all() and not rows[:20].any() and not out.get()[:20].astype(np.float32).any()
    # All sequences empty: legal, zeros and -inf, no error.
    empty = cp.zeros(3, np.int32)
    out, lse = cuflash.attention_varlen(q, k, v, empty, empty, return_lse=True, max_seqlen_q=0, max_seqlen_k=0)
    cuflash.synchronize()
    assert not out.get().astype(np.float32).any() and np.isneginf(lse.get()).all()


def test_varlen_backward_with_max_seqlen_zero_still_checks_the_offsets(rng):
    """The backward with max_seqlen_q = 0 launches only the offsets check: sequences longer than
    0 are an error and all their gradients (dq, and through partner_rows dk and dv) NaN;
    malformed key offsets NaN the sequences from their first bad entry on; all-empty offsets
    give zeros and no error."""
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, s, np.float16)) for s in ((50, 2, 64), (60, 2, 64), (60, 2, 64)))
    out, dout = cp.zeros_like(q), cp.asarray(_rand(rng, (50, 2, 64), np.float16))
    lse = cp.zeros((2, 50), dtype=cp.float32)
    cu_q, cu_k = cp.asarray(np.array([0, 20, 50], np.int32)), cp.asarray(np.array([0, 30, 60], np.int32))
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q=0, max_seqlen_k=60)
    _expect_error("attention_varlen_backward", "max_seqlen_q = 0")
    assert _nan_rows(dq).all() and _nan_rows(dk).all() and _nan_rows(dv).all()
    bad_k = cp.asarray(np.array([0, 0, -3], np.int32))  # sequence 0 has no keys: fine; 1 on: NaN
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, bad_k, max_seqlen_q=0,
                                                   max_seqlen_k=0)
    with pytest.raises(cuflash.InvalidIndexError):
        cuflash.synchronize()
    cuflash.synchronize()
    rows = _nan_rows(dq)
    assert rows[20:].all()
    empty = cp.zeros(3, np.int32)
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, empty, empty, max_seqlen_q=0,
                                                   max_seqlen_k=0)
    cuflash.synchronize()
    assert not any(g.get().astype(np.float32).any() for g in (dq, dk, dv))


@pytest.mark.parametrize("dtype", [*DTYPES, np.float32, np.float64], ids=["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_bad_offsets(rng, dtype, index_dtype, case):
    """(float32/float64, branch wide-next: varlen_tail.cuh's rows in bytes of their elements, the
    float64 LSE in double.)"""
    cp = _cp()
    bad_q, bad_k, good_q, good_k, max_q, first, words = VARLEN_CASES[case]
    q, k, v = (cp.asarray(_rand(rng, s, dtype, 3.0)) for s in ((100, 4, 64), (200, 2, 64), (200, 2, 64)))
    args = dict(max_seqlen_q=max_q, max_seqlen_k=200, causal=True)
    ok_out, ok_lse = cuflash.attention_varlen(q, k, v, cp.asarray(np.array(good_q, index_dtype)),
                                              cp.asarray(np.array(good_k, index_dtype)), return_lse=True,
                                              **dict(args, max_seqlen_q=100))
    out, buf = _guarded((100, 4, 64), dtype)
    cu_q, cu_k = (cp.asarray(np.array(c, index_dtype)) for c in (bad_q, bad_k))
    res, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, out=out, return_lse=True, **args)
    _expect_error("attention_varlen", *words)
    assert _margins_intact(buf)
    good_rows = np.arange(100) < good_q[first]  # rows of the unaffected sequences [0, first)
    assert _nan_rows(res)[~good_rows].all() and not np.isnan(res.get()[good_rows].astype(np.float32)).any()
    assert np.array_equal(res.get()[good_rows].view(np.uint16), ok_out.get()[good_rows].view(np.uint16))
    assert np.isnan(lse.get()[:, ~good_rows]).all()
    assert np.array_equal(lse.get()[:, good_rows], ok_lse.get()[:, good_rows])

    dout = cp.asarray(_rand(rng, (100, 4, 64), dtype))
    ok = cuflash.attention_varlen_backward(dout, q, k, v, ok_out, ok_lse, cp.asarray(np.array(good_q, index_dtype)),
                                           cp.asarray(np.array(good_k, index_dtype)), deterministic=True,
                                           **dict(args, max_seqlen_q=100))
    grads = cuflash.attention_varlen_backward(dout, q, k, v, ok_out, ok_lse, cu_q, cu_k, deterministic=True, **args)
    _expect_error("attention_varlen_backward", *words)
    good_k_rows = np.arange(200) < good_k[first]
    for g, g_ok, rows in zip(grads, ok, (good_rows, good_k_rows, good_k_rows)):
        assert _nan_rows(g)[~rows].all()
        assert np.array_equal(g.get()[rows].view(np.uint16), g_ok.get()[rows].view(np.uint16))


# --- attention with seqlens_k -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("bad", [300, -1, 2**40], ids=["past", "negative", "int64-wrap"])
def test_padded_seqlens_k_bad(rng, dtype, headdim, bad):
    cp = _cp()
    q = cp.asarray(_rand(rng, (2, 70, 4, headdim), dtype, 3.0))
    k, v = (cp.asarray(_rand(rng, (2, 200, 2, headdim), dtype)) for _ in range(2))
    ok_out, ok_lse = cuflash.attention(q, k, v, seqlens_k=cp.asarray(np.array([150, 200], np.int64)), return_lse=True)
    out, lse = cuflash.attention(q, k, v, seqlens_k=cp.asarray(np.array([150, bad], np.int64)), return_lse=True)
    _expect_error("attention", "seqlens_k[1]")
    assert np.isnan(out[1].get().astype(np.float32)).all() and np.isnan(lse[1].get()).all()
    assert np.array_equal(out[0].get().view(np.uint16), ok_out[0].get().view(np.uint16))
    dout = cp.asarray(_rand(rng, out.shape, dtype))
    ok = cuflash.attention_backward(dout, q, k, v, ok_out, ok_lse, seqlens_k=cp.asarray(np.array([150, 200])),
                                    deterministic=True)
    grads = cuflash.attention_backward(dout, q, k, v, ok_out, ok_lse, seqlens_k=cp.asarray(np.array([150, bad])),
                                       deterministic=True)
    _expect_error("attention_backward", "seqlens_k[1]")
    for g, g_ok in zip(grads, ok):
        assert np.isnan(g[1].get().astype(np.float32)).all()
        assert np.array_equal(g[0].get().view(np.uint16), g_ok[0].get().view(np.uint16))


# --- attention_with_kvcache ----------------------------------------------------------------------

def _decode(q, kc, vc, lengths, **kw):
    cp = _cp()
    return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=cp.asarray(np.asarray(lengths)), return_lse=True, **kw)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("rows", [1, 20], ids=["decode", "prefill"])
def test_kvcache_lengths_past_capacity(rng, dtype, splits, rows):
    cp = _cp()
    q = cp.asarray(_rand(rng, (2, rows, 8, 128), dtype, 3.0))
    kc, vc = (cp.asarray(_rand(rng, (2, 64, 2, 128), dtype)) for _ in range(2))
    ok_out, _ = _decode(q, kc, vc, [40, 64], num_splits=splits)
    for bad in (200, -3):
        out, lse = _decode(q, kc, vc, [40, bad], num_splits=splits)
        _expect_error("attention_with_kvcache", "cache_seqlens[1]")
        assert np.isnan(out[1].get().astype(np.float32)).all() and np.isnan(lse[1].get()).all()
        assert np.array_equal(out[0].get().view(np.uint16), ok_out[0].get().view(np.uint16))


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_kvcache_append_past_capacity_is_refused_not_wrapped(rng, dtype):
    """Issue 19's case: appending at position 64 of a 64-slot cache changed slot 0."""
    cp = _cp()
    q = cp.asarray(_rand(rng, (3, 1, 4, 64), dtype, 3.0))
    kc, vc = (cp.asarray(_rand(rng, (3, 64, 2, 64), dtype)) for _ in range(2))
    k, v = (cp.asarray(_rand(rng, (3, 1, 2, 64), dtype)) for _ in range(2))
    k0, v0 = kc.copy(), vc.copy()
    out, lse = _decode(q, kc, vc, [10, 64, -1], k=k, v=v)
    _expect_error("attention_with_kvcache", "cache_seqlens[1]")
    changed = (kc != k0).any(axis=(2, 3)).get() | (vc != v0).any(axis=(2, 3)).get()
    expect = np.zeros((3, 64), bool)
    expect[0, 10] = True  # the one legal slot
    assert np.array_equal(changed, expect)
    assert bool((kc[0, 10] == k[0, 0]).all())
    assert _nan_rows(out).tolist() == [False, True, True]


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("splits", [1, 4, 0])
@pytest.mark.parametrize("bad_page", [9, -1, 4])
def test_kvcache_block_table_out_of_range(rng, dtype, splits, bad_page):
    cp = _cp()
    q = cp.asarray(_rand(rng, (3, 1, 4, 64), dtype, 3.0))
    kp, vp = (cp.asarray(_rand(rng, (4, 16, 2, 64), dtype)) for _ in range(2))
    good = np.array([[0, 1], [2, 3], [3, 0]], np.int32)
    table = good.copy()
    table[1, 1] = bad_page  # sequence 1 uses both entries; sequence 2 uses entry 0 only
    table[2, 1] = bad_page  # unused by sequence 2: never read, never an error
    lengths = [20, 30, 5]
    ok_out, _ = _decode(q, kp, vp, lengths, block_table=cp.asarray(good), num_splits=splits)
    out, lse = _decode(q, kp, vp, lengths, block_table=cp.asarray(table), num_splits=splits)
    _expect_error("attention_with_kvcache", "block_table[1, 1]")
    assert _nan_rows(out).tolist() == [False, True, False]
    for b in (0, 2):
        assert np.array_equal(out[b].get().view(np.uint16), ok_out[b].get().view(np.uint16))


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_kvcache_append_conflicts_write_nothing(rng, dtype):
    cp = _cp()
    q = cp.asarray(_rand(rng, (2, 1, 4, 64), dtype, 3.0))
    k, v = (cp.asarray(_rand(rng, (2, 1, 2, 64), dtype)) for _ in range(2))
    # Shared page 0: sequence 0 holds 16 keys there; sequence 1 (5 keys on page 0) would write its slot 5.
    kp, vp = (cp.asarray(_rand(rng, (4, 16, 2, 64), dtype)) for _ in range(2))
    k0 = kp.copy()
    out, _ = _decode(q, kp, vp, [16, 5], k=k, v=v, block_table=cp.asarray(np.array([[0, 1], [0, 2]], np.int32)))
    _expect_error("attention_with_kvcache", "sequence 1's new tokens")
    assert _nan_rows(out).tolist() == [False, True]
    changed = (kp != k0).any(axis=(2, 3)).get()
    assert changed.sum() == 1 and changed[1, 0]  # sequence 0's token at page 1, slot 0
    # Two sequences on one cache_batch_idx row: both refused, nothing written.
    kc, vc = (cp.asarray(_rand(rng, (3, 32, 2, 64), dtype)) for _ in range(2))
    k0 = kc.copy()
    out, _ = _decode(q, kc, vc, [3, 7], k=k, v=v, cache_batch_idx=cp.asarray(np.array([1, 1])))
    _expect_error("attention_with_kvcache")
    assert _nan_rows(out).all() and bool((kc == k0).all())
    # A row index outside the cache.
    out, _ = _decode(q, kc, vc, [3, 7], cache_batch_idx=cp.asarray(np.array([2, 3])))
    _expect_error("attention_with_kvcache", "cache_batch_idx[1]")
    assert _nan_rows(out).tolist() == [False, True]


def test_kvcache_append_inside_guards(rng):
    """The append writes only legal slots of a cache that sits between guard regions."""
    cp = _cp()
    dtype = ml_dtypes.bfloat16
    kc, vc, kbuf, vbuf = _guarded_cache(rng, (2, 32, 2, 64), dtype)
    q = cp.asarray(_rand(rng, (2, 1, 2, 64), dtype))
    k, v = (cp.asarray(_rand(rng, (2, 3, 2, 64), dtype)) for _ in range(2))
    for lengths in ([30, 29], [-2, 40], [2**31 + 5, 0]):
        _decode(q, kc, vc, np.array(lengths, np.int64), k=k, v=v)
        try:
            cuflash.synchronize()
        except cuflash.InvalidIndexError:
            pass
        assert _margins_intact(kbuf) and _margins_intact(vbuf), lengths


def test_error_is_raised_by_the_next_call_and_cleared(rng):
    cp = _cp()
    q = cp.asarray(_rand(rng, (1, 1, 2, 64), np.float16))
    kc = cp.asarray(_rand(rng, (1, 16, 2, 64), np.float16))
    _decode(q, kc, kc, [99])
    cp.cuda.get_current_stream().synchronize()
    with pytest.raises(cuflash.InvalidIndexError, match="cache_seqlens"):
        _decode(q, kc, kc, [3])  # does no work: the earlier call's error comes first
    out, _ = _decode(q, kc, kc, [3])
    cuflash.synchronize()
    assert not np.isnan(out.get().astype(np.float32)).any()
    assert issubclass(cuflash.InvalidIndexError, ValueError)


# --- CUDA graphs --------------------------------------------------------------------------------

def _replay_matches(capture_fn, eager_fn, refill, outputs, replays=100):
    """Capture ``capture_fn`` on a fresh stream, then replay it ``replays`` times with new input
    values (``refill(i)``) while other code allocates, NaN-fills and frees memory of the same
    sizes; each replay's ``outputs()`` must equal ``eager_fn()``'s on the same inputs."""
    cp = _cp()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        refill(0)
        stream.begin_capture()
        captured = capture_fn()
        graph = stream.end_capture()
        sizes = [x.nbytes for x in (captured if isinstance(captured, tuple) else (captured,))]
        for i in range(replays):
            refill(i % 3)
            expect = [x.copy() for x in eager_fn()]
            junk = [cp.full(n, 0xFF, dtype=cp.uint8) for n in sizes for _ in range(2)]  # NaN bytes in any float dtype
            graph.launch(stream)
            del junk
            _ = [cp.full(n, 255, dtype=cp.uint8) for n in sizes]
            got = outputs(captured)
            for g, e in zip(got, expect):
                assert np.array_equal(g.get().view(np.uint8), e.get().view(np.uint8)), i
        stream.synchronize()
    cuflash.release_graph_memory()


def test_graph_replay_attention_and_backward(rng):
    cp = _cp()
    dtype = ml_dtypes.bfloat16
    data = [[_rand(rng, s, dtype, 2.0) for s in ((2, 300, 4, 128), (2, 300, 2, 128), (2, 300, 2, 128), (2, 300, 4, 128))]
            for _ in range(3)]
    q, k, v, dout = (cp.empty(x.shape, dtype) for x in data[0])

    def refill(i):
        for dst, src in zip((q, k, v, dout), data[i]):
            dst[...] = cp.asarray(src)

    def step():
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        return (out, lse) + cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)

    _replay_matches(step, step, refill, lambda c: c)


def test_graph_replay_varlen_merge_softmax(rng):
    cp = _cp()
    dtype = np.float16
    cu = cp.asarray(np.array([0, 37, 37, 160], np.int32))
    data = [[_rand(rng, (160, 4, 64), dtype, 2.0) for _ in range(3)] for _ in range(3)]
    q, k, v = (cp.empty((160, 4, 64), dtype) for _ in range(3))

    def refill(i):
        for dst, src in zip((q, k, v), data[i]):
            dst[...] = cp.asarray(src)

    def step():
        out, lse = cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=123, max_seqlen_k=123, causal=True,
                                            return_lse=True)
        grads = cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu, cu, max_seqlen_q=123, max_seqlen_k=123,
                                                  causal=True, deterministic=True)
        half = 80  # keys [0, 80) and [80, 160) of one sequence, merged
        a = cuflash.attention(q[None], k[None, :half], v[None, :half], return_lse=True)
        b = cuflash.attention(q[None], k[None, half:], v[None, half:], return_lse=True)
        return (out, lse, *grads, *cuflash.merge_states(*a, *b), cuflash.softmax(q, axis=-1))

    _replay_matches(step, step, refill, lambda c: c)


@pytest.mark.parametrize("paged", [False, True])
def test_graph_replay_decode_with_appends(rng, paged):
    """A captured decode step (append one token, attend with split-KV) replayed as a decode loop:
    each replay appends at the new cache_seqlens values; an eager twin on a copy of the cache
    gives bitwise the same outputs and caches."""
    cp = _cp()
    dtype = ml_dtypes.bfloat16
    batch, cap = 2, 256
    if paged:
        shape, table = (2 * cap // 16, 16, 2, 128), cp.asarray(rng.permutation(2 * cap // 16).reshape(2, -1).astype(np.int32))
    else:
        shape, table = (batch, cap, 2, 128), None
    kc, vc = (cp.asarray(_rand(rng, shape, dtype)) for _ in range(2))
    twin_k, twin_v = kc.copy(), vc.copy()
    lengths = cp.asarray(np.array([100, 37], np.int32))
    q = cp.empty((batch, 1, 8, 128), dtype)
    k, v = (cp.empty((batch, 1, 2, 128), dtype) for _ in range(2))
    step_no = [0]

    def refill(_):
        for x in (q, k, v):
            x[...] = cp.asarray(_rand(rng, x.shape, dtype))
        lengths[...] = cp.asarray(np.array([100, 37], np.int32) + step_no[0])
        step_no[0] += 1

    def graph_step():
        return cuflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, block_table=table, num_splits=0,
                                              return_lse=True)

    def eager():
        out = cuflash.attention_with_kvcache(q, twin_k, twin_v, k, v, cache_seqlens=lengths, block_table=table,
                                             num_splits=0, return_lse=True)
        return (*out, twin_k, twin_v)

    _replay_matches(graph_step, eager, refill, lambda c: (*c, kc, vc), replays=100)


def test_strided_index_arrays_live_until_their_launch(rng):
    """A strided GPU cu_seqlens is copied to a contiguous array for the kernels; the copy must
    outlive the launches (found by review: it was freed before them and its pool block reused
    by the per-call scratch)."""
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, (100, 4, 64), np.float16)) for _ in range(3))
    every_other = cp.zeros(6, dtype=cp.int32)
    every_other[::2] = cp.asarray(np.array([0, 30, 100], np.int32))
    cu = every_other[::2]
    dense = cp.asarray(np.array([0, 30, 100], np.int32))
    for _ in range(20):
        out = cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=70, max_seqlen_k=70, causal=True)
        ref = cuflash.attention_varlen(q, k, v, dense, dense, max_seqlen_q=70, max_seqlen_k=70, causal=True)
        cuflash.synchronize()
        assert bool((out == ref).all())


def test_paged_cache_with_no_pages(rng):
    """Found by review: a (0, page_size, ...) cache read page 0 of an empty array."""
    cp = _cp()
    kc = cp.zeros((0, 256, 1, 64), dtype=cp.float16)
    q = cp.asarray(_rand(rng, (1, 1, 1, 64), np.float16))
    out, lse = cuflash.attention_with_kvcache(q, kc, kc.copy(), cache_seqlens=cp.asarray(np.array([300], np.int32)),
                                              block_table=cp.asarray(np.array([[0, 0]], np.int32)), num_splits=3,
                                              return_lse=True)
    _expect_error("attention_with_kvcache", "block_table[0, 0]")
    assert np.isnan(out.get().astype(np.float32)).all() and np.isnan(lse.get()).all()


def test_graph_replay_dropout_with_a_device_seed(rng):
    """dropout_seed as a CuPy (2,) int64 array is read by the kernels on the device: a call equals
    the call with the same (seed, offset) ints, bitwise, forward and backward; a captured forward +
    backward replayed after new values are written into the array equals the eager call with them
    (issue 23: inference and training steps captured once advance their dropout seed in place)."""
    cp = _cp()
    dtype = np.float16
    q, k, v, dout = (cp.asarray(_rand(rng, s, dtype, 1.0)) for s in ((2, 130, 4, 64), (2, 200, 2, 64), (2, 200, 2, 64),
                                                                       (2, 130, 4, 64)))
    seeds = [(11, 4), (12, 4), (2**63 + 3, 2**40 + 1)]
    seed = cp.asarray(np.array(seeds[0], dtype=np.uint64).view(np.int64))

    def run(dropout_seed):
        opts = dict(causal=True, dropout_p=0.2, dropout_seed=dropout_seed, bias=bias)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
        return (out, lse) + cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **opts)[:3]

    bias = cp.asarray(rng.standard_normal((1, 4, 130, 200)).astype(np.float32))
    for got, want in zip(run(seed), run(seeds[0])):
        assert np.array_equal(got.get().view(np.uint8), want.get().view(np.uint8))
    plain = cuflash.attention(q, k, v, causal=True, bias=bias)  # (dropout really ran in both)
    assert not np.array_equal(run(seed)[0].get(), plain.get())
    for deterministic in (False,):  # the Hopper _dkdv_dq form too: dq by atomics, the rest bitwise
        opts = dict(causal=True, dropout_p=0.2, dropout_seed=seed, bias=bias)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
        got = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **opts)
        want = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                          **dict(opts, dropout_seed=seeds[0]))
        assert all(np.array_equal(g.get().view(np.uint8), w.get().view(np.uint8)) for g, w in zip(got[1:], want[1:]))
        np.testing.assert_allclose(got[0].get().astype(np.float32), want[0].get().astype(np.float32), atol=2e-3)
    current = [0]

    def refill(i):
        current[0] = i
        seed[...] = cp.asarray(np.array(seeds[i], dtype=np.uint64).view(np.int64))

    _replay_matches(lambda: run(seed), lambda: run(seeds[current[0]]), refill, lambda c: c, replays=9)
    with pytest.raises(TypeError, match="GPU array"):
        cuflash.attention(q.get(), k.get(), v.get(), dropout_p=0.2, dropout_seed=seed)
    with pytest.raises(ValueError, match="shape"):
        cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=cp.zeros(3, cp.int64))
    with pytest.raises(TypeError, match="int64"):
        cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=cp.zeros(2, cp.int32))
    with pytest.raises(ValueError, match="aligned"):
        cuflash.attention(q, k, v, dropout_p=0.2,
                          dropout_seed=cp.ndarray((2,), dtype=cp.int64, memptr=cp.zeros(24, cp.uint8).data + 4))
    keep = cuflash.dropout_mask(seed, (2, 4, 130, 200), 0.2)  # read to the host: the mask of the seed's values
    assert np.array_equal(keep, cuflash.dropout_mask(seeds[2], (2, 4, 130, 200), 0.2))


# --- attention_with_kvcache: bad metadata with appends ---------------------------------------------

def _changed_slots(cache, before):
    """{(row or page, slot)} whose keys or values differ, bitwise, from ``before``."""
    cp = _cp()
    diff = (cache.view(cp.uint16) != before.view(cp.uint16)).any(axis=(2, 3)).get()
    return {(int(r), int(s)) for r, s in np.argwhere(diff)}


@pytest.mark.parametrize("bad_page, index_dtype", [(-1, np.int32), (6, np.int32), (2**32 + 1, np.int64)],
                         ids=["negative", "num_pages", "int64-high-bits"])
def test_paged_append_with_bad_block_table_writes_only_legal_slots(rng, bad_page, index_dtype):
    """A block_table entry outside the pages, among those a sequence uses, with new tokens: that
    sequence is refused (nothing written to any page for it, NaN rows and LSE); the same entry
    past the pages a sequence uses is never read; the other sequences are appended at their slots
    and attend as with the table repaired.  2**32 + 1 lies outside the 6 pages only in its high 32
    bits (its low word names page 1): the kernels read the whole int64 (metadata.cuh load_index).
    The pools sit between guard regions, the call's other allocations between guard bytes."""
    cp = _cp()
    dtype = np.float16
    kp, vp, kbuf, vbuf = _guarded_cache(rng, (6, 16, 2, 64), dtype)
    q = cp.asarray(_rand(rng, (3, 2, 4, 64), dtype, 3.0))
    k, v = (cp.asarray(_rand(rng, (3, 2, 2, 64), dtype)) for _ in range(2))
    good = np.array([[0, 1], [2, 3], [4, 5]], index_dtype)
    table = good.copy()
    table[1, 1] = bad_page  # sequence 1 (30 keys + 2 new) uses both entries: it would write page entry 1
    table[2, 1] = bad_page  # sequence 2 (5 + 2) uses entry 0 only: never read, never an error
    lengths = [20, 30, 5]
    ok_k, ok_v = kp.copy(), vp.copy()
    ok_out, ok_lse = _decode(q, ok_k, ok_v, lengths, k=k, v=v, block_table=cp.asarray(good))
    cuflash.synchronize()
    k0, v0 = kp.copy(), vp.copy()
    with _GuardedPool() as pool:
        out, lse = _decode(q, kp, vp, lengths, k=k, v=v, block_table=cp.asarray(table))
        _expect_error("attention_with_kvcache", "block_table[1, 1]")
    assert pool.intact() and _margins_intact(kbuf) and _margins_intact(vbuf)
    written = {(1, 4): (0, 0), (1, 5): (0, 1), (4, 5): (2, 0), (4, 6): (2, 1)}  # (page, slot): (sequence, token)
    for cache, before, new in ((kp, k0, k), (vp, v0, v)):
        assert _changed_slots(cache, before) == set(written)
        for (page, slot), (b, t) in written.items():
            assert bool((cache[page, slot].view(cp.uint16) == new[b, t].view(cp.uint16)).all())
    assert _nan_rows(out).tolist() == [False, True, False] and np.isnan(lse[1].get()).all()
    for b in (0, 2):
        assert np.array_equal(out[b].get().view(np.uint16), ok_out[b].get().view(np.uint16))
        assert np.array_equal(lse[b].get(), ok_lse[b].get())


def test_paged_append_past_capacity_is_refused_not_wrapped(rng):
    """Paged form of issue 19's wrap: with 2 pages of 16 slots per table row (capacity 32),
    cache_seqlens 31 + 2 new tokens would write position 32 (entry 2 of row 1: row 2's entry 0 in
    the flat table) and -2 + 2 positions -2, -1 (row 1's last entry); both sequences are refused,
    no page changes for them, and sequence 0's tokens land at their slots."""
    cp = _cp()
    dtype = np.float16
    kp, vp = (cp.asarray(_rand(rng, (6, 16, 2, 64), dtype)) for _ in range(2))
    q = cp.asarray(_rand(rng, (3, 2, 4, 64), dtype, 3.0))
    k, v = (cp.asarray(_rand(rng, (3, 2, 2, 64), dtype)) for _ in range(2))
    table = cp.asarray(np.array([[0, 1], [2, 3], [4, 5]], np.int32))
    k0, v0 = kp.copy(), vp.copy()
    out, lse = _decode(q, kp, vp, [10, 31, -2], k=k, v=v, block_table=table)
    _expect_error("attention_with_kvcache", "cache_seqlens[1]")
    for cache, before, new in ((kp, k0, k), (vp, v0, v)):
        assert _changed_slots(cache, before) == {(0, 10), (0, 11)}
        assert bool((cache[0, 10:12].view(cp.uint16) == new[0].view(cp.uint16)).all())
    assert _nan_rows(out).tolist() == [False, True, True] and np.isnan(lse[1:].get()).all()


@pytest.mark.parametrize("bad_row", [-1, 3])
def test_append_with_bad_cache_batch_idx_writes_nothing_for_it(rng, bad_row):
    """cache_batch_idx outside the 3 cache rows, with new tokens: that sequence writes nothing (no
    row wrapped to, none clamped to) and gets NaN; sequence 0 is appended to its row and attends
    as with the index repaired."""
    cp = _cp()
    dtype = np.float16
    kc, vc = (cp.asarray(_rand(rng, (3, 32, 2, 64), dtype)) for _ in range(2))
    q = cp.asarray(_rand(rng, (2, 1, 4, 64), dtype, 3.0))
    k, v = (cp.asarray(_rand(rng, (2, 1, 2, 64), dtype)) for _ in range(2))
    ok_k, ok_v = kc.copy(), vc.copy()
    ok_out, _ = _decode(q, ok_k, ok_v, [3, 7], k=k, v=v, cache_batch_idx=cp.asarray(np.array([2, 0])))
    cuflash.synchronize()
    k0, v0 = kc.copy(), vc.copy()
    out, lse = _decode(q, kc, vc, [3, 7], k=k, v=v, cache_batch_idx=cp.asarray(np.array([2, bad_row])))
    _expect_error("attention_with_kvcache", "cache_batch_idx[1]")
    for cache, before, new in ((kc, k0, k), (vc, v0, v)):
        assert _changed_slots(cache, before) == {(2, 3)}
        assert bool((cache[2, 3].view(cp.uint16) == new[0, 0].view(cp.uint16)).all())
    assert _nan_rows(out).tolist() == [False, True] and np.isnan(lse[1].get()).all()
    assert np.array_equal(out[0].get().view(np.uint16), ok_out[0].get().view(np.uint16))


def test_paged_append_onto_own_earlier_key_is_refused(rng):
    """GPU form of test_kvcache.py::test_append_onto_own_earlier_key_is_refused: page 0 listed
    twice in sequence 0's row, 5 keys of 4-slot pages: its new token (position 5: entry 1, page 0,
    slot 1) would replace its own key 1.  Refused, nothing written for it, NaN; sequence 1 is
    appended.  The same row read without appending stays legal (a page read twice)."""
    cp = _cp()
    dtype = np.float16
    kp, vp = (cp.asarray(_rand(rng, (4, 4, 2, 64), dtype)) for _ in range(2))
    q = cp.asarray(_rand(rng, (2, 1, 4, 64), dtype, 3.0))
    k, v = (cp.asarray(_rand(rng, (2, 1, 2, 64), dtype)) for _ in range(2))
    table = cp.asarray(np.array([[0, 0], [1, 2]], np.int32))
    k0, v0 = kp.copy(), vp.copy()
    out, lse = _decode(q, kp, vp, [5, 3], k=k, v=v, block_table=table)
    _expect_error("attention_with_kvcache", "sequence 0's new tokens")
    for cache, before, new in ((kp, k0, k), (vp, v0, v)):
        assert _changed_slots(cache, before) == {(1, 3)}
        assert bool((cache[1, 3].view(cp.uint16) == new[1, 0].view(cp.uint16)).all())
    assert _nan_rows(out).tolist() == [True, False] and np.isnan(lse[0].get()).all()
    # Reading only: positions 0..4 of sequence 0 are page 0's slots 0, 1, 2, 3, 0.
    out, lse = _decode(q, kp, vp, [5, 3], block_table=table)
    cuflash.synchronize()
    keys, values = (x.get()[0][[0, 1, 2, 3, 0]][None] for x in (kp, vp))
    _check_per_sequence(out.get()[:1], lse.get()[:1], q.get()[:1], keys, values, [5])


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("splits", [1, 4])
def test_block_table_entry_bad_only_in_its_high_bits(rng, splits, dtype):
    """An int64 entry 2**32 + 1 is not a page of a 25-page cache although its low 32 bits (1) are:
    the split kernel's page check reads the whole value (SeqInfo::check_pages), so sequence 1 gets
    NaN rows and the error names its entry; the same value past the pages sequence 2 uses is never
    read; sequences 0 and 2 equal, bitwise, the call with the table repaired.  (float32: the
    one-pass kernel checks every page of the sequence in each block.)"""
    cp = _cp()
    kp, vp = (cp.asarray(_rand(rng, (25, 16, 2, 64), dtype)) for _ in range(2))
    q = cp.asarray(_rand(rng, (3, 1, 8, 64), dtype, 3.0))
    good = rng.permutation(25)[:24].reshape(3, 8).astype(np.int64)
    table = good.copy()
    table[1, 5] = 2**32 + 1  # sequence 1 (128 keys) uses all 8 entries
    table[2, 3] = 2**32 + 1  # sequence 2 (7 keys) uses entry 0 only
    lengths = [100, 128, 7]
    ok_out, ok_lse = _decode(q, kp, vp, lengths, block_table=cp.asarray(good), num_splits=splits)
    cuflash.synchronize()
    out, lse = _decode(q, kp, vp, lengths, block_table=cp.asarray(table), num_splits=splits)
    _expect_error("attention_with_kvcache", "block_table[1, 5]")
    assert _nan_rows(out).tolist() == [False, True, False] and np.isnan(lse[1].get()).all()
    for b in (0, 2):
        assert np.array_equal(out[b].get().view(np.uint16), ok_out[b].get().view(np.uint16))
        assert np.array_equal(lse[b].get(), ok_lse[b].get())


# --- host checks: CUFLASH_DEBUG=1, and offsets copied for max_seqlen_*=None -----------------------

def test_debug_env_checks_gpu_index_values_at_the_call(rng, monkeypatch):
    """CUFLASH_DEBUG=1, read at every call (cuflash/_validate.py debug_checks_enabled), copies GPU
    index values to the host and raises the host's ValueError at the call, before anything runs:
    out= and the caches are unchanged and cuflash.synchronize() has nothing to raise.  With the
    variable unset again, the same calls return and the error is deferred."""
    cp = _cp()
    dtype = np.float16
    q = cp.asarray(_rand(rng, (100, 4, 64), dtype))
    k, v = (cp.asarray(_rand(rng, (200, 2, 64), dtype)) for _ in range(2))
    decreasing = cp.asarray(np.array([0, 60, 40, 100], np.int32))
    cu_k = cp.asarray(np.array([0, 50, 100, 200], np.int32))
    lse = cp.zeros((4, 100), dtype=cp.float32)
    out, buf = _guarded((100, 4, 64), dtype)
    qd = cp.asarray(_rand(rng, (2, 1, 4, 64), dtype))
    new = cp.asarray(_rand(rng, (2, 1, 2, 64), dtype))
    kc, vc = (cp.asarray(_rand(rng, (2, 64, 2, 64), dtype)) for _ in range(2))
    kp, vp = (cp.asarray(_rand(rng, (4, 4, 2, 64), dtype)) for _ in range(2))
    caches = (kc, vc, kp, vp)
    before = [x.copy() for x in caches]
    varlen = dict(max_seqlen_q=60, max_seqlen_k=100)

    def kvcache(kc_, vc_, lengths, **kw):
        return cuflash.attention_with_kvcache(qd, kc_, vc_, new, new, cache_seqlens=cp.asarray(np.array(lengths)), **kw)

    calls = [
        ("cu_seqlens_q must be non-decreasing",
         lambda: cuflash.attention_varlen(q, k, v, decreasing, cu_k, out=out, **varlen)),
        ("cu_seqlens_q must be non-decreasing",
         lambda: cuflash.attention_varlen_backward(q, q, k, v, q, lse, decreasing, cu_k, **varlen)),
        ("max_seqlen_q = 30 is smaller than the longest sequence 60",
         lambda: cuflash.attention_varlen(q, k, v, cp.asarray(np.array([0, 60, 60, 100], np.int32)), cu_k, out=out,
                                          max_seqlen_q=30, max_seqlen_k=100)),
        (r"seqlens_k values must lie in \[0, 64\]",
         lambda: cuflash.attention(qd, kc, vc, seqlens_k=cp.asarray(np.array([3, 65])))),
        ("exceed the cache capacity 64", lambda: kvcache(kc, vc, [3, 64])),
        ("cache_seqlens must be >= 0", lambda: kvcache(kc, vc, [-1, 3])),
        (r"block_table\[1, 1\] = 4294967297 is not a page of the cache \(0\.\.3\)",
         lambda: kvcache(kp, vp, [2, 5], block_table=cp.asarray(np.array([[0, 1], [2, 2**32 + 1]])))),
        ("cache_batch_idx entries must lie in",
         lambda: kvcache(kc, vc, [2, 5], cache_batch_idx=cp.asarray(np.array([0, -1])))),
        ("which it also reads as its position 1",
         lambda: kvcache(kp, vp, [5, 3], block_table=cp.asarray(np.array([[0, 0], [1, 2]], np.int32)))),
    ]
    monkeypatch.setenv("CUFLASH_DEBUG", "1")
    for words, call in calls:
        with pytest.raises(ValueError, match=words):
            call()
        cuflash.synchronize()  # nothing ran: nothing recorded
        assert np.isnan(out.get().astype(np.float32)).all() and _margins_intact(buf), words
        assert all(bool((x == b).all()) for x, b in zip(caches, before)), words
    monkeypatch.delenv("CUFLASH_DEBUG")
    res = cuflash.attention_varlen(q, k, v, decreasing, cu_k, out=out, **varlen)  # now checked on the device
    _expect_error("attention_varlen", "cu_seqlens_q[2]")
    assert _nan_rows(res)[60:].all() and not _nan_rows(res)[:60].any()
    kvcache(kc, vc, [3, 64])
    _expect_error("attention_with_kvcache", "cache_seqlens[1]")
    assert _changed_slots(kc, before[0]) == {(0, 3)}  # sequence 0's token; sequence 1 refused


@pytest.mark.parametrize("backward", [False, True])
def test_gpu_offsets_copied_for_max_seqlen_none_are_checked_at_the_call(rng, monkeypatch, backward):
    """max_seqlen_q (or _k) = None copies that side's GPU offsets to the host for the maximum;
    they are then checked there, before anything runs, with or without CUFLASH_DEBUG: a
    ValueError at the call, out= unchanged, nothing for cuflash.synchronize() to raise."""
    monkeypatch.delenv("CUFLASH_DEBUG", raising=False)
    cp = _cp()
    dtype = np.float16
    q = cp.asarray(_rand(rng, (100, 4, 64), dtype))
    k, v = (cp.asarray(_rand(rng, (200, 2, 64), dtype)) for _ in range(2))
    lse = cp.zeros((4, 100), dtype=cp.float32)
    out, buf = _guarded((100, 4, 64), dtype)
    cases = [
        ([0, 60, 40, 100], [0, 50, 100, 200], dict(max_seqlen_k=100), "cu_seqlens_q must be non-decreasing"),
        ([-5, 20, 100], [0, 80, 200], dict(max_seqlen_k=120), "cu_seqlens_q must start at 0"),
        ([0, 30, 100], [0, 90, 900], dict(max_seqlen_q=70), r"cu_seqlens_k\[-1\] = 900 exceeds the 200 packed tokens"),
        ([0, 30, 100], [0, 90, 80], dict(), "cu_seqlens_k must be non-decreasing"),
    ]
    for cu_q, cu_k, given, words in cases:
        cu_q, cu_k = (cp.asarray(np.array(c, np.int32)) for c in (cu_q, cu_k))
        with pytest.raises(ValueError, match=words):
            if backward:
                cuflash.attention_varlen_backward(q, q, k, v, q, lse, cu_q, cu_k, **given)
            else:
                cuflash.attention_varlen(q, k, v, cu_q, cu_k, out=out, **given)
        cuflash.synchronize()
        assert np.isnan(out.get().astype(np.float32)).all() and _margins_intact(buf), words


# --- nothing written outside the arrays: every allocation between guard bytes ----------------------

def test_padded_seqlens_k_bad_inside_guards(rng):
    """attention's out= and attention_backward's dq=, dk=, dv= between guard regions, and every
    array the calls allocate (LSE, copies, dQ accumulators) between guard bytes, for seqlens_k
    past k's rows, negative and past 2**32."""
    cp = _cp()
    dtype = ml_dtypes.bfloat16
    q = cp.asarray(_rand(rng, (2, 70, 4, 128), dtype, 3.0))
    k, v = (cp.asarray(_rand(rng, (2, 200, 2, 128), dtype)) for _ in range(2))
    dout = cp.asarray(_rand(rng, q.shape, dtype))
    out, obuf = _guarded(q.shape, dtype)
    grads = [_guarded(x.shape, dtype) for x in (q, k, v)]
    for bad in (300, -1, 2**40):
        for deterministic in (False, True):
            seqlens = cp.asarray(np.array([150, bad], np.int64))
            with _GuardedPool() as pool:
                res, lse = cuflash.attention(q, k, v, seqlens_k=seqlens, causal=True, out=out, return_lse=True)
                _expect_error("attention", "seqlens_k[1]")
                dq, dk, dv = cuflash.attention_backward(dout, q, k, v, res, lse, seqlens_k=seqlens, causal=True,
                                                        deterministic=deterministic,
                                                        **{n: g for n, (g, _) in zip(("dq", "dk", "dv"), grads)})
                _expect_error("attention_backward", "seqlens_k[1]")
            assert pool.intact() and _margins_intact(obuf), (bad, deterministic)
            assert all(_margins_intact(b) for _, b in grads), (bad, deterministic)
            assert _nan_rows(res).tolist() == [False, True] and np.isnan(lse[1].get()).all()
            for g in (dq, dk, dv):
                assert _nan_rows(g).tolist() == [False, True]


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_varlen_bad_offsets_inside_guards(rng, dtype):
    """attention_varlen and its backward (whose dq, dk, dv have no out= of their own) with every
    malformed form of VARLEN_CASES: the inputs, outputs, LSE, gradients and every scratch array
    sit between guard bytes, which stay intact (deterministic and atomic dQ alike; float32's
    atomic dQ is flash_bwd.cu's, in the dtype)."""
    cp = _cp()
    data = [_rand(rng, s, dtype, 3.0) for s in ((100, 4, 64), (200, 2, 64), (200, 2, 64), (100, 4, 64))]
    for case, (bad_q, bad_k, _, _, max_q, _, words) in VARLEN_CASES.items():
        for deterministic in (False, True):
            with _GuardedPool() as pool:
                q, k, v, dout = (cp.asarray(x) for x in data)
                cu_q, cu_k = (cp.asarray(np.array(c, np.int32)) for c in (bad_q, bad_k))
                args = dict(max_seqlen_q=max_q, max_seqlen_k=200, causal=True)
                out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **args)
                _expect_error("attention_varlen", *words)
                grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                          deterministic=deterministic, **args)
                _expect_error("attention_varlen_backward", *words)
            assert pool.intact(), (case, deterministic)
            assert all(_nan_rows(g).any() for g in grads), (case, deterministic)


def test_kvcache_bad_lengths_inside_guards(rng):
    """attention_with_kvcache's out and LSE (it takes no out=), its append flags and split scratch,
    and the cache itself between guard bytes, for cache_seqlens past the capacity, negative and past
    2**31, with and without new tokens, one split, three and automatic: every byte outside them
    stays intact."""
    cp = _cp()
    dtype = np.float16
    data = [_rand(rng, s, dtype) for s in ((2, 64, 2, 128), (2, 64, 2, 128), (2, 1, 2, 128), (2, 1, 2, 128))]
    q_host = _rand(rng, (2, 1, 8, 128), dtype, 3.0)
    for lengths in ([40, 200], [-3, 10], [2**31 + 5, 0]):
        with _GuardedPool() as pool:
            kc, vc, k, v = (cp.asarray(x) for x in data)
            q = cp.asarray(q_host)
            for splits in (1, 3, 0):
                for new in (dict(), dict(k=k, v=v)):
                    out, lse = _decode(q, kc, vc, np.array(lengths, np.int64), num_splits=splits, **new)
                    _expect_error("attention_with_kvcache", "cache_seqlens[")
                    assert _nan_rows(out).any() and np.isnan(lse.get()).any(), (lengths, splits)
        assert pool.intact(), lengths


# --- CUDA graphs: attention_with_kvcache without appends -------------------------------------------

@pytest.mark.parametrize("splits, paged, warm",
                         [(1, False, False), (1, True, True), (0, False, True), (0, True, False)],
                         ids=["splits1", "splits1-paged-warm", "auto-warm", "auto-paged"])
def test_graph_replay_kvcache_without_appends(rng, splits, paged, warm):
    """A captured decode step that only reads the cache, replayed with new q, new cache contents,
    new cache_seqlens values (a full sequence, an empty one) and, paged, a new block_table: each
    replay equals the eager call bitwise.  ``warm``: an eager call with the same signature first, so
    that the capture goes through the fast path's plan (cuflash._fastpath), as a warm decode loop's
    does; otherwise through the full path (the warm-up call differs in return_lse)."""
    cp = _cp()
    dtype = np.float16
    batch, cap, page = 2, 256, 16
    if paged:
        shape, table = (batch * cap // page + 3, page, 2, 64), cp.empty((batch, cap // page), dtype=cp.int32)
    else:
        shape, table = (batch, cap, 2, 64), None
    q = cp.empty((batch, 1, 8, 64), dtype)
    kc, vc = (cp.empty(shape, dtype) for _ in range(2))
    lengths = cp.empty(batch, dtype=cp.int32)
    data = [[_rand(rng, x.shape, dtype, s) for x, s in ((q, 3.0), (kc, 1.0), (vc, 1.0))] for _ in range(3)]
    tables = [rng.permutation(shape[0])[:batch * cap // page].reshape(batch, -1).astype(np.int32) for _ in range(3)]
    sets = [np.array(x, np.int32) for x in ([100, 37], [256, 0], [1, 200])]

    def refill(i):
        for dst, src in zip((q, kc, vc), data[i]):
            dst[...] = cp.asarray(src)
        lengths[...] = cp.asarray(sets[i])
        if paged:
            table[...] = cp.asarray(tables[i])

    def step(return_lse=True):
        return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table, num_splits=splits,
                                              return_lse=return_lse)

    refill(0)
    step(return_lse=warm)  # compiled (and, warm, planned) outside the capture
    cuflash.synchronize()
    _replay_matches(step, step, refill, lambda c: c)


def test_graph_replay_with_bad_cache_seqlens_sets_the_error_word(rng):
    """A replay whose captured cache_seqlens buffer holds a bad value (past the capacity, negative)
    records the error like an eager call: cuflash.synchronize() raises InvalidIndexError naming the
    entry, the sequence's rows are NaN, the other equals the eager call bitwise, and the next call
    (and a replay with good values) raises nothing."""
    cp = _cp()
    dtype = np.float16
    q = cp.asarray(_rand(rng, (2, 1, 8, 64), dtype, 3.0))
    kc, vc = (cp.asarray(_rand(rng, (2, 256, 2, 64), dtype)) for _ in range(2))
    lengths = cp.asarray(np.array([100, 37], np.int32))

    def step(cache_seqlens):
        return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=cache_seqlens, num_splits=3, return_lse=True)

    step(lengths)  # compiled and planned outside the capture
    cuflash.synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out, lse = step(lengths)
        graph = stream.end_capture()
        for bad in (300, -1):
            lengths[...] = cp.asarray(np.array([bad, 37], np.int32))
            graph.launch(stream)
            _expect_error("attention_with_kvcache", "cache_seqlens[0]")
            assert _nan_rows(out).tolist() == [True, False] and np.isnan(lse[0].get()).all()
            ok_out, ok_lse = step(cp.asarray(np.array([0, 37], np.int32)))  # the next call: no error
            cuflash.synchronize()
            assert np.array_equal(out[1].get().view(np.uint16), ok_out[1].get().view(np.uint16))
            assert np.array_equal(lse[1].get(), ok_lse[1].get())
        lengths[...] = cp.asarray(np.array([200, 37], np.int32))
        graph.launch(stream)
        cuflash.synchronize()  # a good replay: nothing to raise
        ok_out, ok_lse = step(lengths)
        cuflash.synchronize()
        assert np.array_equal(out.get().view(np.uint16), ok_out.get().view(np.uint16))
        assert np.array_equal(lse.get(), ok_lse.get())
        stream.synchronize()
    del graph
    cuflash.release_graph_memory()
