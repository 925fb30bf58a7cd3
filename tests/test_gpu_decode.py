"""The split-KV decode kernel (few query rows) against the float64 reference (exactness rule).

Every call with at most DECODE_MAX_ROWS query rows runs it: through ``cuflash.attention`` and
``cuflash.attention_with_kvcache`` (paged caches read in place through the block table).  The
split count never changes the answer beyond rounding, GQA heads packed into rows keep their own
masks, and empty rows stay 0 / -inf across splits.  Skipped without a CUDA GPU.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash.reference import assert_exact, attention_ref, naive_attention

from .conftest import requires_gpu
from .test_gpu_forward import _check, _cp, _rand
from .test_kvcache import _check_per_sequence

pytestmark = [pytest.mark.gpu, requires_gpu]

DTYPES = [np.float16, ml_dtypes.bfloat16]


def _kvcache(q, kc, vc, lengths, *, block_table=None, **opts):
    """attention_with_kvcache on the GPU; returns NumPy (out, lse)."""
    cp = _cp()
    extra = {} if block_table is None else dict(block_table=cp.asarray(block_table))
    out, lse = cuflash.attention_with_kvcache(cp.asarray(q), cp.asarray(kc), cp.asarray(vc),
                                              cache_seqlens=cp.asarray(lengths), return_lse=True, **extra, **opts)
    return out.get(), lse.get()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [32, 64, 72, 128, 200, 256])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 16])
def test_attention_few_rows(rng, dtype, headdim, heads, seqlen_q):
    """Sq <= 16 runs the decode variant; GQA packs up to 16 rows, more spill into further blocks."""
    hq, hkv = heads
    q = _rand(rng, (2, seqlen_q, hq, headdim), dtype, 5.0)
    k, v = _rand(rng, (2, 777, hkv, headdim), dtype), _rand(rng, (2, 777, hkv, headdim), dtype)
    _check(q, k, v)
    _check(q, k, v, causal=True)


OPTIONS = [
    dict(causal="top_left"),
    dict(window_size=(5, 0)),
    dict(window_size=(100, 3), causal=False),
    dict(softcap=3.0),
    dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32)),
    dict(softmax_scale=-0.3),
    dict(softmax_scale=0.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}" for k in o))
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_options(rng, dtype, opts, seqlen_q):
    q = _rand(rng, (2, seqlen_q, 4, 64), dtype, 3.0)
    k, v = _rand(rng, (2, 300, 2, 64), dtype), _rand(rng, (2, 300, 2, 64), dtype)
    opts = dict(opts)
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = _cp().asarray(opts["alibi_slopes"])
        out = _cp().full((2, seqlen_q, 4, 64), np.nan, dtype=dtype)
        res, lse = cuflash.attention(*(_cp().asarray(x) for x in (q, k, v)), out=out, return_lse=True, **opts)
        host = dict(opts, alibi_slopes=opts["alibi_slopes"].get())
        ref, ref_lse = attention_ref(q, k, v, **host)
        naive, naive_lse = naive_attention(q, k, v, return_lse=True, **host)
        assert_exact(res.get(), ref, naive, "out")
        assert_exact(lse.get(), ref_lse, naive_lse, "lse")
    else:
        _check(q, k, v, **opts)


def test_long_cache_automatic_split_and_repeatable(rng):
    """One sequence, GQA 32/8, 40k keys: the automatic split spreads it over the GPU."""
    d, hq, hkv, n = 128, 32, 8, 40_000
    kc = _rand(rng, (1, n, hkv, d), ml_dtypes.bfloat16)
    vc = _rand(rng, (1, n, hkv, d), ml_dtypes.bfloat16)
    q = _rand(rng, (1, 1, hq, d), ml_dtypes.bfloat16, 3.0)
    out, lse = _kvcache(q, kc, vc, np.array([n], np.int32))
    _check_per_sequence(out, lse, q, kc, vc, [n])
    again, _ = _kvcache(q, kc, vc, np.array([n], np.int32))
    assert np.array_equal(out.view(np.uint16), again.view(np.uint16))


def _paged(rng, dtype, lengths, page_size, hkv, d):
    """Keys and values of each sequence, and the same in pages scattered through a pool:
    (keys, values, k_pool, v_pool, table); unused table entries are -1, unused slots NaN."""
    batch = len(lengths)
    max_pages = int(-(-lengths.max() // page_size)) + 1
    num_pages = batch * max_pages + 3
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    k_pool = np.full((num_pages, page_size, hkv, d), np.nan, dtype=dtype)
    v_pool = np.full((num_pages, page_size, hkv, d), np.nan, dtype=dtype)
    keys = _rand(rng, (batch, max_pages * page_size, hkv, d), dtype)
    values = _rand(rng, (batch, max_pages * page_size, hkv, d), dtype)
    for b, n in enumerate(lengths):
        for pos in range(n):
            page, slot = table[b, pos // page_size], pos % page_size
            k_pool[page, slot], v_pool[page, slot] = keys[b, pos], values[b, pos]
        table[b, -(-n // page_size):] = -1
    return keys, values, k_pool, v_pool, table


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_paged_in_kernel(rng, page_size, num_splits, seqlen_q):
    """Pages scattered through a pool; unused table entries are -1, unused slots NaN."""
    dtype, hq, hkv, d = ml_dtypes.bfloat16, 8, 2, 128
    lengths = np.array([0, 1, page_size, 3 * page_size + 5, 700], dtype=np.int32)
    keys, values, k_pool, v_pool, table = _paged(rng, dtype, lengths, page_size, hkv, d)
    q = _rand(rng, (len(lengths), seqlen_q, hq, d), dtype, 3.0)
    out, lse = _kvcache(q, k_pool, v_pool, lengths, block_table=table, num_splits=num_splits, causal=True)
    _check_per_sequence(out, lse, q, keys, values, lengths, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [32, 80, 160, 256])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(20, 0)), dict(window_size=(3, 2)), dict(softcap=2.0)],
                         ids=["causal", "window20", "window3-2", "softcap"])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_paged_head_dims_and_masks(rng, dtype, headdim, opts, num_splits):
    """The paged tiles (warps splitting each tile's keys, 16 or 32 keys per warp, two warps
    above head dim 128) at every tile shape, with masks that leave some warps and some splits
    without a visible key, and two GQA query rows per sequence."""
    hq, hkv = 8, 2
    lengths = np.array([0, 1, 17, 129, 300], dtype=np.int32)
    keys, values, k_pool, v_pool, table = _paged(rng, dtype, lengths, 16, hkv, headdim)
    q = _rand(rng, (len(lengths), 2, hq, headdim), dtype, 3.0)
    out, lse = _kvcache(q, k_pool, v_pool, lengths, block_table=table, num_splits=num_splits, **opts)
    _check_per_sequence(out, lse, q, keys, values, lengths, **opts)


def test_prefill_rows_beyond_the_decode_block(rng):
    """Many query rows into a paged cache still run (the decode variant, several row blocks)."""
    dtype, page_size, n = np.float16, 16, 200
    table = np.arange(13, dtype=np.int32)[None, ::-1].copy()
    pool = _rand(rng, (13, page_size, 2, 64), dtype)
    vpool = _rand(rng, (13, page_size, 2, 64), dtype)
    keys = pool[table[0]].reshape(1, -1, 2, 64)
    values = vpool[table[0]].reshape(1, -1, 2, 64)
    q = _rand(rng, (1, 50, 4, 64), dtype, 3.0)
    out, lse = _kvcache(q, pool, vpool, np.array([n], np.int32), block_table=table, causal=True)
    _check_per_sequence(out, lse, q, keys, values, [n], causal=True)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 128, 1000])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (32, 8), (6, 1)], ids=["mha", "gqa", "gqa32-8", "mqa"])
def test_split_counts(rng, num_splits, heads):
    """Any split count (clamped to the key tiles and 128) gives the reference answer.  Lengths
    0..2500 in one batch: with many splits the short sequences leave most split blocks without a
    key (partials 0 / -inf), and tiles end inside and at 32/64-key edges."""
    hq, hkv = heads
    lengths = np.array([0, 1, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 2500], dtype=np.int32)
    batch, capacity, d = len(lengths), 2500, 128
    kc = _rand(rng, (batch, capacity, hkv, d), ml_dtypes.bfloat16)
    vc = _rand(rng, (batch, capacity, hkv, d), ml_dtypes.bfloat16)
    for b, n in enumerate(lengths):
        kc[b, n:], vc[b, n:] = np.nan, np.nan  # never read
    q = _rand(rng, (batch, 1, hq, d), ml_dtypes.bfloat16, 3.0)
    out, lse = _kvcache(q, kc, vc, lengths, num_splits=num_splits)
    _check_per_sequence(out, lse, q, kc, vc, lengths)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)  # no keys: 0 and -inf, whatever the split


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(70, 0)), dict(softcap=2.0)],
                         ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("num_splits", [0, 1, 5, 128])
def test_split_counts_with_masks(rng, opts, num_splits):
    """Windows and caps on a split range: some splits see only masked keys or none at all."""
    hq, hkv, d = 8, 2, 128
    lengths = np.array([0, 5, 100, 1999], dtype=np.int32)
    batch, capacity = len(lengths), 2000
    kc = _rand(rng, (batch, capacity, hkv, d), ml_dtypes.bfloat16)
    vc = _rand(rng, (batch, capacity, hkv, d), ml_dtypes.bfloat16)
    for b, n in enumerate(lengths):
        kc[b, n:], vc[b, n:] = np.nan, np.nan
    q = _rand(rng, (batch, 2, hq, d), ml_dtypes.bfloat16, 3.0)
    out, lse = _kvcache(q, kc, vc, lengths, num_splits=num_splits, **opts)
    _check_per_sequence(out, lse, q, kc, vc, lengths, **opts)


def test_split_counters_between_calls_and_streams(rng):
    """The last block of each row group merges the splits and resets the group's counter: calls
    with other split counts, more row groups than the first counters held (48 x 32 > 1024), one
    after another and on two streams at once, each give the reference answer."""
    cp = _cp()
    cases = []
    for batch, hq, hkv, n, splits in [(2, 8, 2, 3000, 7), (48, 32, 32, 300, 2), (1, 32, 8, 5000, 0), (3, 4, 4, 900, 128)]:
        kc = _rand(rng, (batch, n, hkv, 128), ml_dtypes.bfloat16)
        vc = _rand(rng, (batch, n, hkv, 128), ml_dtypes.bfloat16)
        q = _rand(rng, (batch, 1, hq, 128), ml_dtypes.bfloat16, 3.0)
        lengths = rng.integers(0, n + 1, batch).astype(np.int32)
        cases.append((q, kc, vc, lengths, splits))
    device_cases = [tuple(cp.asarray(x) for x in case[:4]) + (case[4],) for case in cases]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    results = []
    for _ in range(2):
        for stream in streams:
            for i, (q, kc, vc, lengths, splits) in enumerate(device_cases):
                with stream:
                    results.append((i, cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, num_splits=splits,
                                                                       return_lse=True)))
    cp.cuda.Device().synchronize()
    for i, (out, lse) in results:
        q, kc, vc, lengths, _ = cases[i]
        _check_per_sequence(out.get(), lse.get(), q, kc, vc, lengths)


def test_split_scratch_of_many_streams(rng):
    """Each stream keeps its split scratch (counters, partial results) until 64 others were used
    after it: decoding on 70 streams, then again on the first ones (whose scratch was dropped and
    is allocated anew), gives the reference answer every time."""
    from cuflash import _gpu

    cp = _cp()
    q = _rand(rng, (2, 1, 32, 128), ml_dtypes.bfloat16, 3.0)
    kc, vc = (_rand(rng, (2, 2000, 8, 128), ml_dtypes.bfloat16) for _ in range(2))
    lengths = np.array([2000, 1333], dtype=np.int32)
    args = [cp.asarray(x) for x in (q, kc, vc, lengths)]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(70)]
    results = []
    for stream in streams + streams[:3]:
        with stream:
            results.append(cuflash.attention_with_kvcache(*args[:3], cache_seqlens=args[3], num_splits=8, return_lse=True))
    cp.cuda.Device().synchronize()
    assert len(_gpu._STREAM_SCRATCH) <= _gpu._MAX_SCRATCH_STREAMS
    for out, lse in results[::9] + results[-3:]:
        _check_per_sequence(out.get(), lse.get(), q, kc, vc, lengths)
    first = results[0][0].get()
    assert all(np.array_equal(out.get(), first) for out, _ in results)


def test_split_counters_of_per_thread_default_streams(rng):
    """The per-thread default stream has one handle but is a different stream in each host
    thread: calls on it zero counters of their own, so two threads decoding at once on it do not
    share them."""
    import threading

    cp = _cp()
    q = _rand(rng, (2, 1, 32, 128), ml_dtypes.bfloat16, 3.0)
    kc, vc = (_rand(rng, (2, 3000, 8, 128), ml_dtypes.bfloat16) for _ in range(2))
    lengths = np.array([3000, 1777], dtype=np.int32)
    args = [cp.asarray(x) for x in (q, kc, vc, lengths)]
    results, errors = [], []

    def decode():
        try:
            with cp.cuda.Stream.ptds:
                for _ in range(20):
                    results.append(cuflash.attention_with_kvcache(*args[:3], cache_seqlens=args[3], num_splits=16,
                                                                  return_lse=True))
                cp.cuda.Stream.ptds.synchronize()
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=decode) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 40
    for out, lse in results[::7]:
        _check_per_sequence(out.get(), lse.get(), q, kc, vc, lengths)
    first = results[0][0].get()
    assert all(np.array_equal(out.get(), first) for out, _ in results)  # the same answer every time


def test_a_stream_first_used_inside_a_graph_capture_still_gets_zeroed_counters(rng):
    """Counters for a stream are never allocated inside a capture, whose memset would not run:
    after a split decode captured on a fresh stream (over pool memory left holding 1000s), plain
    calls on that stream give the reference answer.  The captured call has scratch of its own
    (counters zeroed by a memset node of the graph, partial results), which cuflash._guard keeps
    alive after the call until cuflash.release_graph_memory(): replaying the graph after those
    calls gives the same answer, bitwise."""
    cp = _cp()
    q = _rand(rng, (2, 1, 32, 128), ml_dtypes.bfloat16, 3.0)
    kc, vc = (_rand(rng, (2, 3000, 8, 128), ml_dtypes.bfloat16) for _ in range(2))
    lengths = np.array([3000, 2100], dtype=np.int32)
    args = [cp.asarray(x) for x in (q, kc, vc, lengths)]

    def decode():
        return cuflash.attention_with_kvcache(*args[:3], cache_seqlens=args[3], num_splits=16, return_lse=True)

    decode()  # compiled and planned on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        poison = [cp.full(n, 1000, dtype=cp.int32) for n in (256, 1024, 4096, 1 << 16) for _ in range(4)]
        del poison  # freed on this stream, for the capture's allocations to take
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        captured = decode()
        graph = stream.end_capture()
        results = [decode() for _ in range(3)]
        for _ in range(2):
            graph.launch(stream)
            stream.synchronize()
            for got, want in zip(captured, results[0]):
                assert np.array_equal(got.get().view(np.uint8), want.get().view(np.uint8))
        stream.synchronize()
    for out, lse in results:
        _check_per_sequence(out.get(), lse.get(), q, kc, vc, lengths)
    del graph, captured
    cuflash.release_graph_memory()
