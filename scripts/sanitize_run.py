"""A small sweep of every kernel feature, for compute-sanitizer (memcheck, racecheck).

CuPy's memory pool is switched off so that each array is its own allocation and an
out-of-bounds access is reported instead of landing in a neighbouring pool block.
SANITIZE_PARTS=fwd runs the forward calls only (racecheck on the Hopper forward takes minutes
for the whole sweep); SANITIZE_PARTS=varlen the packed calls with hostile and well-formed offsets only;
SANITIZE_PARTS=wide the float32 and float64 calls only (named f64 in session 22, before float32); widefwd
their forward calls only; widekv their KV-cache calls only; half the float16/bfloat16 calls only; bwdsm90 the
Hopper backward's calls only.  SANITIZE_WIDE_DTYPES (e.g. "float64") narrows the float32/float64 calls to those dtypes.
"""

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

import cuflash  # noqa: E402

cp.cuda.set_allocator(None)
rng = np.random.default_rng(0)
FORWARD_ONLY = os.environ.get("SANITIZE_PARTS", "all") in ("fwd", "widefwd")
VARLEN_ONLY = os.environ.get("SANITIZE_PARTS", "all") == "varlen"
HALF_ONLY = os.environ.get("SANITIZE_PARTS") in ("half", "bwdsm90")  # the float16/bfloat16 calls only
KV_ONLY = os.environ.get("SANITIZE_PARTS") == "widekv"  # the float32/float64 KV-cache calls only  # the packed calls' hostile offsets only


def rand(shape, dtype):
    return cp.asarray(rng.standard_normal(shape).astype(dtype))


# The float32 and float64 forwards and backwards (issue 24, flash_fwd.cu's and flash_bwd.cu's TF32
# and FP64 tensor-core forms): partial tiles of rows, keys and head dims, the options they take, GQA,
# Dv != Dqk, both float32 precisions.
from cuflash import _gpu  # noqa: E402

wide_cases = ((1, 1, 8, 8, {}), (65, 129, 64, 64, dict(causal=True)), (129, 65, 128, 40, dict(softcap=3.0)),
              (100, 300, 100, 100, dict(window_size=(7, 2))), (33, 97, 1, 1, dict(causal=True, seqlens_k=True)),
              (70, 90, 256, 256, dict(causal=True)), (50, 70, 64, 64, dict(alibi=True, softcap=2.0)),
              (37, 45, 192, 130, dict(window_size=(20, 3))))
WIDE_DTYPES = os.environ.get("SANITIZE_WIDE_DTYPES", "float64,float32").split(",")
for dtype, precision in () if VARLEN_ONLY or HALF_ONLY else ((np.float64, None), (np.float32, None), (np.float32, "tf32")):
    name = np.dtype(dtype).name
    if name not in WIDE_DTYPES:
        continue
    for sq, sk, d, dv, opts in () if KV_ONLY else wide_cases:
        if d > _gpu._wide_limit(name, backward=False):
            continue
        if opts.get("seqlens_k"):
            opts = dict(opts, seqlens_k=cp.asarray(np.array([sk, sk // 3], dtype=np.int32)))
        if opts.get("alibi"):
            opts = {**{n: o for n, o in opts.items() if n != "alibi"}, "alibi_slopes": cp.asarray(np.linspace(0.1, 1.0, 4))}
        q, k, v = rand((2, sq, 4, d), dtype), rand((2, sk, 2, d), dtype), rand((2, sk, 2, dv), dtype)
        out, lse = cuflash.attention(q, k, v, precision=precision, return_lse=True, **opts)
        assert not bool(cp.isnan(out).any()), (dtype, sq, sk, d, opts)
        if d <= _gpu._wide_limit(name, True, _gpu._smem_limit(cp.cuda.Device().id)) and not FORWARD_ONLY:
            for deterministic in (False, True):  # (atomic dQ in the dkdv kernel, or the dq kernel)
                grads = cuflash.attention_backward(rand(out.shape, dtype), q, k, v, out, lse, precision=precision,
                                                   deterministic=deterministic, **opts)
                assert not any(bool(cp.isnan(g).any()) for g in grads), (dtype, sq, sk, d, opts)
    # Bias, mask and dropout (their one modifier form): a reversed strided bias (float64 read as
    # double by the float64 kernels), a mask with an empty row, dropout; dbias by atomics and in full.
    for sq, sk, d in () if KV_ONLY else ((65, 129, 64), (70, 90, 256)):
        if d > _gpu._wide_limit(name, True, _gpu._smem_limit(cp.cuda.Device().id)):
            continue
        q, k, v = rand((2, sq, 4, d), dtype), rand((2, sk, 2, d), dtype), rand((2, sk, 2, d), dtype)
        mask = cp.asarray(rng.random((2, 1, sq, sk)) < 0.8)
        mask[0, 0, 3] = False
        bias = rand((2, 4, sq, 2 * sk), dtype)[..., ::-2]
        for mods in (dict(bias=bias, mask=mask, causal=True), dict(bias=bias[:1, :, :1], dropout_p=0.3, dropout_seed=4)):
            out, lse = cuflash.attention(q, k, v, precision=precision, return_lse=True, **mods)
            for deterministic in () if FORWARD_ONLY else (False, True):
                grads = cuflash.attention_backward(rand(out.shape, dtype), q, k, v, out, lse, precision=precision,
                                                   deterministic=deterministic, return_dbias=True, **mods)
                assert not any(bool(cp.isnan(g).any()) for g in grads), (dtype, sq, sk, d, mods.keys())

    def reported(call, cu):  # the call, then whether its indices were reported bad (as they should be)
        good = bool(cu) if isinstance(cu, (bool, np.bool_)) else bool((np.diff(cu) >= 0).all())
        try:
            call()
            cuflash.synchronize()
        except cuflash.InvalidIndexError:
            assert not good, "well-formed indices reported"
            return
        assert good, "malformed indices not reported"

    # KV caches (the one-pass kernel): contiguous with an append, paged (scattered pages, one bad
    # entry: its sequence gets NaN rows and the error is reported, no read outside the pool)
    kc, vc = rand((3, 64, 2, 64), dtype), rand((3, 64, 2, 64), dtype)
    cuflash.attention_with_kvcache(rand((3, 2, 4, 64), dtype), kc, vc, rand((3, 2, 2, 64), dtype), rand((3, 2, 2, 64), dtype),
                                   cache_seqlens=cp.asarray(np.array([0, 17, 62], np.int32)), causal=True, precision=precision)
    pool_k, pool_v = rand((9, 16, 2, 64), dtype), rand((9, 16, 2, 64), dtype)
    for table in (np.array([[3, 0, 7], [1, 8, 2], [4, 5, 6]], np.int32), np.array([[3, 0, 7], [1, 9, 2], [4, 5, 6]], np.int32)):
        reported(lambda: cuflash.attention_with_kvcache(rand((3, 1, 4, 64), dtype), pool_k, pool_v, block_table=cp.asarray(table),
                                                        cache_seqlens=cp.asarray(np.array([40, 30, 5], np.int32)),
                                                        precision=precision), (table < 9).all())
    # packed rows (attention_varlen): well-formed offsets with rows past the last sequence, then a
    # malformed entry (varlen_tail.cuh fills those rows with NaN in 4- and 8-byte elements)
    for cu in () if KV_ONLY else (np.array([0, 0, 33, 70], dtype=np.int32), np.array([0, 33, 20, 70], dtype=np.int32)):
        q, k, v = rand((75, 4, 64), dtype), rand((70, 2, 64), dtype), rand((70, 2, 40), dtype)
        cud = cp.asarray(cu)
        res = {}
        reported(lambda: res.update(fwd=cuflash.attention_varlen(q, k, v, cud, cud, max_seqlen_q=40, max_seqlen_k=40,
                                                                 causal=True, precision=precision, return_lse=True)), cu)
        out, lse = res["fwd"]
        if not FORWARD_ONLY:
            reported(lambda: cuflash.attention_varlen_backward(rand(out.shape, dtype), q, k, v, out, lse, cud, cud,
                                                               max_seqlen_q=40, max_seqlen_k=40, causal=True,
                                                               precision=precision), cu)
cp.cuda.Device().synchronize()
if os.environ.get("SANITIZE_PARTS") in ("wide", "widefwd", "widekv"):
    print("sanitize sweep done")
    sys.exit(0)


# SANITIZE_PARTS=bwdsm90: the Hopper backward's calls only (padded and packed, head dims 64, 128
# and the column split's 200, 256), for racecheck with --kernel-name kns=cuflash_bwd_sm90 (the whole
# half sweep does not finish under racecheck).
if os.environ.get("SANITIZE_PARTS") == "bwdsm90":
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for d in (64, 128, 256):  # packed sequences whose last query tiles end inside the next sequence
            cu_q, cu_k = (cp.asarray(np.array(c, dtype=np.int32)) for c in ([0, 5, 70, 170], [0, 9, 100, 150]))
            q, k, v = rand((170, 4, d), dtype), rand((150, 2, d), dtype), rand((150, 2, d), dtype)
            out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=100, max_seqlen_k=91, causal=True,
                                                return_lse=True)
            for deterministic in (False, True):
                cuflash.attention_varlen_backward(rand(out.shape, dtype), q, k, v, out, lse, cu_q, cu_k, max_seqlen_q=100,
                                                  max_seqlen_k=91, causal=True, deterministic=deterministic)
        for sq, sk, d, opts in ((300, 700, 64, dict(causal=True)), (65, 129, 128, dict(window_size=(17, 5))),
                                (130, 70, 256, dict(causal=True, softcap=5.0)), (129, 257, 200, dict(causal=True)),
                                (70, 100, 256, dict(bias=rand((2, 4, 70, 100), np.float32), dropout_p=0.3, dropout_seed=(3, 1))),
                                (70, 100, 256, dict(mask=cp.asarray(rng.random((70, 100)) < 0.8), causal=True))):
            q, k, v = rand((2, sq, 4, d), dtype), rand((2, sk, 2, d), dtype), rand((2, sk, 2, d), dtype)
            out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
            grads = cuflash.attention_backward(rand(out.shape, dtype), q, k, v, out, lse, return_dbias="bias" in opts, **opts)
            assert not any(bool(cp.isnan(g.astype(cp.float32)).any()) for g in grads), (sq, sk, d, opts.keys())
    cp.cuda.Device().synchronize()
    print("sanitize sweep done")
    sys.exit(0)

cases = [
    dict(sq=1, sk=1, d=64, opts={}),
    dict(sq=7, sk=63, d=40, opts=dict(causal=True)),
    dict(sq=65, sk=129, d=128, opts=dict(window_size=(17, 5))),
    dict(sq=130, sk=70, d=256, opts=dict(causal=True, softcap=5.0)),
    dict(sq=63, sk=200, d=59, opts=dict(causal="top_left")),
    dict(sq=100, sk=100, d=96, opts=dict(alibi_slopes=True)),
    dict(sq=33, sk=97, d=32, opts=dict(seqlens_k=True, causal=True)),
    dict(sq=300, sk=700, d=64, opts=dict(causal=True, seqlens_k=True)),  # several key tiles and stages (Hopper kernel)
    dict(sq=129, sk=257, d=200, opts=dict(causal=True)),  # the Hopper d256 tile, columns past 200 zero-filled
]
for dtype in () if VARLEN_ONLY else (np.float16, ml_dtypes.bfloat16):
    for c in cases:
        b, h, hk = 2, 4, 2
        opts = dict(c["opts"])
        if opts.get("alibi_slopes"):
            opts["alibi_slopes"] = cp.asarray(np.linspace(0.1, 1, h, dtype=np.float32))
        if opts.get("seqlens_k"):
            opts["seqlens_k"] = cp.asarray(np.array([c["sk"], c["sk"] // 2], dtype=np.int32))
        q, k, v = rand((b, c["sq"], h, c["d"]), dtype), rand((b, c["sk"], hk, c["d"]), dtype), rand((b, c["sk"], hk, c["d"]), dtype)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
        assert not bool(cp.isnan(out.astype(cp.float32)).any()), c
        for deterministic in () if FORWARD_ONLY else (False, True):  # Hopper: atomic dQ, or the _dq + _dkdv kernels
            grads = cuflash.attention_backward(rand(out.shape, dtype), q, k, v, out, lse, deterministic=deterministic, **opts)
            assert not any(bool(cp.isnan(g.astype(cp.float32)).any()) for g in grads), c
    # Bias, mask and dropout (issue 23): broadcast, strided, reversed views; the Hopper forward
    # (d64/d128/d256), the sm_80 one (d32) and split-KV decode (9 query rows); the Hopper backward
    # (d64/d128/d256) and flash_bwd.cu's (d32).
    for sq, sk, d in ((130, 257, 64), (65, 129, 128), (70, 100, 256), (33, 97, 32), (9, 1000, 128)):
        q, k, v = rand((2, sq, 4, d), dtype), rand((2, sk, 2, d), dtype), rand((2, sk, 2, d), dtype)
        wide = rand((2, 4, sq, 2 * sk), np.float32)
        for mods in (dict(bias=rand((1, 1, sq, sk), np.float32)), dict(bias=wide[..., ::-2]),
                     dict(bias=rand((2, 1, 1, sk), np.float16), mask=cp.asarray(rng.random((sq, sk)) < 0.8)),
                     dict(mask=cp.broadcast_to(cp.asarray(rng.random((1, 4, 1, sk)) < 0.5), (2, 4, sq, sk))),
                     # tile-scale masks (mask_tiles.cu): key padding, and documents (all-False tiles in a row)
                     dict(mask=cp.asarray((np.arange(sk) < np.array([sk, sk // 3])[:, None])[:, None, None, :])),
                     dict(mask=cp.asarray((np.arange(sq)[:, None] * 3 // sq == np.arange(sk)[None, :] * 3 // sk)[None, None]))):
            for causal in (False, True):
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, **mods)
                if not FORWARD_ONLY:  # flash_bwd.cu's CUFLASH_MODS kernels, dbias by atomics
                    cuflash.attention_backward(rand(out.shape, dtype), q, k, v, out, lse, causal=causal,
                                               return_dbias="bias" in mods, **mods)
        # Dropout with a host seed and with a device seed array; both dQ schemes of the Hopper backward.
        for seed in ((3, 1), cp.asarray(np.array([3, 1], dtype=np.int64))):
            drop = dict(dropout_p=0.3, dropout_seed=seed, bias=rand((1, 4, sq, sk), np.float32))
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **drop)
            for deterministic in () if FORWARD_ONLY else (False, True):
                cuflash.attention_backward(rand(out.shape, dtype), q, k, v, out, lse, causal=True, return_dbias=True,
                                           dlse=rand(lse.shape, np.float32), deterministic=deterministic, **drop)
    cu_q = cp.asarray(np.array([0, 5, 5, 70], dtype=np.int32))
    cu_k = cp.asarray(np.array([0, 9, 20, 150], dtype=np.int32))
    q, k, v = rand((70, 4, 64), dtype), rand((150, 2, 64), dtype), rand((150, 2, 64), dtype)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=65, max_seqlen_k=130, causal=True,
                                        return_lse=True)
    if FORWARD_ONLY:
        continue
    cuflash.attention_varlen_backward(rand(out.shape, dtype), q, k, v, out, lse, cu_q, cu_k,
                                      max_seqlen_q=65, max_seqlen_k=130, causal=True)
    # Decode variant: split key ranges, GQA packing, paged cache with a page size that splits tiles.
    lengths = cp.asarray(np.array([0, 1, 37, 300], dtype=np.int32))
    kc, vc = rand((4, 320, 2, 128), dtype), rand((4, 320, 2, 128), dtype)
    for splits in (1, 3, 0):
        cuflash.attention_with_kvcache(rand((4, 2, 8, 128), dtype), kc, vc, cache_seqlens=lengths, num_splits=splits, causal=True)
    table = cp.asarray(rng.permutation(4 * 28).reshape(4, 28).astype(np.int32))
    kp, vp = rand((4 * 28, 12, 2, 64), dtype), rand((4 * 28, 12, 2, 64), dtype)
    cuflash.attention_with_kvcache(rand((4, 1, 4, 64), dtype), kp, vp, rand((4, 1, 2, 64), dtype), rand((4, 1, 2, 64), dtype),
                                   cache_seqlens=lengths, block_table=table, num_splits=4)
for dtype in () if VARLEN_ONLY else (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
    cuflash.softmax(rand((3, 1000), dtype))
cp.cuda.Device().synchronize()


# Hostile index values (issue 19): every call must stay inside its arrays (memcheck, with the
# pool off so that each array is its own allocation) and report through cuflash.synchronize().
def expect_bad(call):
    call()
    try:
        cuflash.synchronize()
    except cuflash.InvalidIndexError:
        return
    raise AssertionError("no InvalidIndexError")


def idx(values, dtype=np.int32):
    return cp.asarray(np.array(values, dtype=dtype))


for dtype in () if FORWARD_ONLY else (np.float16, ml_dtypes.bfloat16):
    q, k, v = rand((100, 4, 64), dtype), rand((150, 2, 64), dtype), rand((150, 2, 64), dtype)
    for bad_q, bad_k in (([0, 50, 120], [0, 9, 150]), ([0, 60, 40, 100], [0, 9, 20, 150]), ([-8, 60, 100], [0, 9, 150]),
                         ([0, 50, 100], [0, 900, 150]), ([0, 50, 100], [0, -9, 150])):
        for it in (np.int32, np.int64):
            cu_q, cu_k = idx(bad_q, it), idx(bad_k, it)
            expect_bad(lambda: cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=100, max_seqlen_k=150, causal=True))
            out = rand((100, 4, 64), dtype)
            lse = cp.zeros((4, 100), cp.float32)
            expect_bad(lambda: cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q=100,
                                                                 max_seqlen_k=150))
    expect_bad(lambda: cuflash.attention_varlen(q, k, v, idx([0, 30, 100]), idx([0, 9, 150]), max_seqlen_q=40,
                                                max_seqlen_k=150))
    # Well formed with rows past the last sequence (written 0 by the tail code), d64 and d128 (Hopper)
    # and d32 (the sm_80 forward with its tail kernel).
    for d in (32, 64, 128):
        qd, kd = rand((100, 4, d), dtype), rand((150, 2, d), dtype)
        cuflash.attention_varlen(qd, kd, kd, idx([0, 50, 90]), idx([0, 9, 140]), max_seqlen_q=50, max_seqlen_k=131)
        expect_bad(lambda: cuflash.attention_varlen(qd, kd, kd, idx([0, 60, 40, 100]), idx([0, 9, 20, 150]), max_seqlen_q=100,
                                                    max_seqlen_k=150))
    if VARLEN_ONLY:
        continue
    qb, kb = rand((2, 33, 4, 128), dtype), rand((2, 70, 2, 128), dtype)
    for bad in ([5, 71], [-1, 3], [2**40, 3]):
        lengths = idx(bad, np.int64)
        expect_bad(lambda: cuflash.attention(qb, kb, kb, seqlens_k=lengths))
        out, lse = cuflash.attention(qb, kb, kb, return_lse=True)
        expect_bad(lambda: cuflash.attention_backward(out, qb, kb, kb, out, lse, seqlens_k=lengths))
    # KV caches: contiguous (64 slots), paged (4 pages of 16), indexed rows; decode and prefill rows.
    kc, vc = rand((2, 64, 2, 64), dtype), rand((2, 64, 2, 64), dtype)
    kn, vn = rand((2, 1, 2, 64), dtype), rand((2, 1, 2, 64), dtype)
    for rows in (1, 20):
        qd = rand((2, rows, 4, 64), dtype)
        for bad in ([10, 200], [-1, 3]):
            for splits in (1, 0):
                expect_bad(lambda: cuflash.attention_with_kvcache(qd, kc, vc, cache_seqlens=idx(bad), num_splits=splits))
            expect_bad(lambda: cuflash.attention_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=idx([bad[0], 64])))
        expect_bad(lambda: cuflash.attention_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=idx([3, 4]),
                                                          cache_batch_idx=idx([1, 2])))
        expect_bad(lambda: cuflash.attention_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=idx([3, 4]),
                                                          cache_batch_idx=idx([-1, 0])))
    kp, vp = rand((4, 16, 2, 64), dtype), rand((4, 16, 2, 64), dtype)
    qd = rand((2, 1, 4, 64), dtype)
    for table in ([[0, 9], [1, 2]], [[0, -1], [1, 2]], [[0, 1], [0, 3]]):
        for splits in (1, 3, 0):
            expect_bad(lambda: cuflash.attention_with_kvcache(qd, kp, vp, kn, vn, cache_seqlens=idx([20, 5]),
                                                              block_table=idx(table), num_splits=splits))
    # A paged cache with no pages at all, and strided (copied) offsets.
    empty = rand((0, 256, 1, 64), dtype)
    expect_bad(lambda: cuflash.attention_with_kvcache(rand((1, 1, 1, 64), dtype), empty, empty.copy(),
                                                      cache_seqlens=idx([300]), block_table=idx([[0, 0]]), num_splits=3))
    strided = cp.zeros(6, dtype=cp.int32)
    strided[::2] = idx([0, 50, 120])
    expect_bad(lambda: cuflash.attention_varlen(q, k, v, strided[::2], idx([0, 9, 150]), max_seqlen_q=100,
                                                max_seqlen_k=150))
# The Hopper forward with one block per tile (CUFLASH_SM90_PERSISTENT=0; the default persistent
# grid ran above), its ablation without the intra-warpgroup overlap (CUFLASH_SM90_OVERLAP=0), and
# with three consumer warpgroups at d64 (a tile under measurement), with tensor-map replays: the
# same forward cases, packed sequences and hostile offsets.
from cuflash import _fastpath, _kernels  # noqa: E402

d64_tile = _kernels.SM90_FWD_TILES[64]
for overlap, persistent, tile in (("", "0", d64_tile), ("0", "", d64_tile), ("", "", (96, 2, 3))):
    os.environ["CUFLASH_SM90_OVERLAP"], os.environ["CUFLASH_SM90_PERSISTENT"] = overlap, persistent
    _kernels.SM90_FWD_TILES[64] = tile
    _kernels.sm90_fwd_variant.cache_clear()
    _fastpath.PLANS.clear()
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for c in cases:
            opts = dict(c["opts"])
            if opts.get("alibi_slopes"):
                opts["alibi_slopes"] = cp.asarray(np.linspace(0.1, 1, 4, dtype=np.float32))
            if opts.get("seqlens_k"):
                opts["seqlens_k"] = cp.asarray(np.array([c["sk"], c["sk"] // 2], dtype=np.int32))
            q, k, v = rand((2, c["sq"], 4, c["d"]), dtype), rand((2, c["sk"], 2, c["d"]), dtype), rand((2, c["sk"], 2, c["d"]), dtype)
            for _ in range(2):  # the second call replays with re-pointed tensor maps
                out = cuflash.attention(q, k, v, **opts)
            assert not bool(cp.isnan(out.astype(cp.float32)).any()), (overlap, persistent, tile, c)
        q, k, v = rand((100, 4, 64), dtype), rand((150, 2, 64), dtype), rand((150, 2, 64), dtype)
        cuflash.attention_varlen(q, k, v, idx([0, 5, 5, 70]), idx([0, 9, 20, 150]), max_seqlen_q=65, max_seqlen_k=130,
                                 causal=True)
        expect_bad(lambda: cuflash.attention_varlen(q, k, v, idx([0, 50, 120]), idx([0, 9, 150]), max_seqlen_q=100,
                                                    max_seqlen_k=150))
    cp.cuda.Device().synchronize()
os.environ["CUFLASH_SM90_OVERLAP"] = os.environ["CUFLASH_SM90_PERSISTENT"] = ""
_kernels.SM90_FWD_TILES[64] = d64_tile
_kernels.sm90_fwd_variant.cache_clear()
_fastpath.PLANS.clear()
# d64's long-row tile as the dispatcher picks it (SM90_FWD_LONG_ROWS query rows and more)
q = rand((1, _kernels.SM90_FWD_LONG_ROWS + 7, 2, 64), ml_dtypes.bfloat16)
k, v = rand((1, 300, 1, 64), ml_dtypes.bfloat16), rand((1, 300, 1, 64), ml_dtypes.bfloat16)
for causal in (False, True):
    assert not bool(cp.isnan(cuflash.attention(q, k, v, causal=causal).astype(cp.float32)).any())
cp.cuda.Device().synchronize()
print("sanitize sweep done")
