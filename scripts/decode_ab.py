"""A/B of the split-KV decode versions in one process (docs/perf-notes.md, d2).

    PYTHONPATH=. python3 scripts/decode_ab.py [--old 1] [--new 3] [--mid 2] [--quick]

Versions (cuflash/_kernels.py, DECODE_VERSIONS): 1 = the d1 kernel and its _combine; 2 = the
same split kernel and _combine2 (every partial of a row loaded at once); 3 = the multi-stage split
loop (4 stages of 32-key K/V tiles at d128) and _combine2.  Each is selected through
``_kernels.DECODE_VERSION`` (the CUFLASH_DECODE environment variable does the same for a whole
process), with the warm-call plans cleared in between.

First every version is checked against cuflash.reference (exactness rule) on small caches that
exercise the contract (per-sequence lengths with NaN past them, GQA/MHA, paged, causal, window,
softcap, split counts that leave blocks without keys), and on each timed row for the query heads
of K/V head 0 of sequence 0.  Then each row is timed with cuflash.bench.time_gpu, alternating the
versions twice (best of two), as ``cuflash bench --suite decode`` times it: TB/s of K+V cache read.
The table is the last lines printed.  Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import sys
import time

import ml_dtypes
import numpy as np

import cupy as cp

import cuflash
from cuflash import _fastpath, _kernels
from cuflash.bench import time_gpu
from cuflash.reference import assert_exact, attention_ref, naive_attention

BF16 = ml_dtypes.bfloat16
HEADS = {"gqa": (32, 8), "mha": (32, 32)}
D = 128
BUDGET_S = 80.0  # stop timing new rows past this (the whole run must stay under 90 s)


def use(version: int):
    _kernels.DECODE_VERSION = version
    _fastpath.PLANS.clear()  # recorded launches hold the previous version's kernels


def _host_rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)


def _check(name, out, lse, q, keys, values, lengths, failures, **opts):
    """Each sequence of (out, lse) against the float64 reference over its valid keys."""
    out, lse = cp.asnumpy(out), cp.asnumpy(lse)
    for b, n in enumerate(lengths):
        args = (q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n])
        ref, ref_lse = attention_ref(*args, **opts)
        naive, naive_lse = naive_attention(*args, return_lse=True, **opts)
        try:
            assert_exact(out[b:b + 1], ref, naive, f"out of sequence {b}")
            assert_exact(lse[b:b + 1], ref_lse, naive_lse, f"lse of sequence {b}")
        except AssertionError as exc:
            failures.append(f"{name}: {str(exc).splitlines()[0]}")
            return


def contract_checks(version, failures):
    """Small caches through the whole contract; appends failures (strings)."""
    rng = np.random.default_rng(version)
    # Contiguous, GQA 32/8 and MQA, per-sequence lengths, NaN past them, several split counts.
    for (hq, hkv) in ((32, 8), (6, 1), (4, 4)):
        lengths = np.array([0, 1, 33, 65, 3000], np.int32)
        kc = _host_rand(rng, (len(lengths), 3000, hkv, D))
        vc = _host_rand(rng, (len(lengths), 3000, hkv, D))
        for b, n in enumerate(lengths):
            kc[b, n:], vc[b, n:] = np.nan, np.nan
        q = _host_rand(rng, (len(lengths), 1, hq, D), 3.0)
        dk, dv = cp.asarray(kc), cp.asarray(vc)
        for splits in (0, 1, 3, 128):
            for opts in (dict(), dict(causal=True, window_size=(100, 0)), dict(softcap=2.0)):
                out, lse = cuflash.attention_with_kvcache(cp.asarray(q), dk, dv, cache_seqlens=cp.asarray(lengths),
                                                          num_splits=splits, return_lse=True, **opts)
                _check(f"v{version} contiguous {hq}/{hkv} splits={splits} {opts}", out, lse, q, kc, vc, lengths,
                       failures, **opts)
    # Paged, page sizes 1, 16 and 256, pages scattered, unused slots NaN, unused table entries -1.
    hq, hkv = 8, 2
    for page_size in (1, 16, 256):
        lengths = np.array([0, 5, page_size + 3, 1500], np.int32)
        batch = len(lengths)
        max_pages = int(-(-lengths.max() // page_size)) + 1
        num_pages = batch * max_pages + 2
        table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
        kp = np.full((num_pages, page_size, hkv, D), np.nan, BF16)
        vp = np.full((num_pages, page_size, hkv, D), np.nan, BF16)
        keys = _host_rand(rng, (batch, max_pages * page_size, hkv, D))
        values = _host_rand(rng, (batch, max_pages * page_size, hkv, D))
        for b, n in enumerate(lengths):
            pos = np.arange(n)
            kp[table[b, pos // page_size], pos % page_size] = keys[b, :n]
            vp[table[b, pos // page_size], pos % page_size] = values[b, :n]
            table[b, -(-n // page_size):] = -1
        q = _host_rand(rng, (batch, 2, hq, D), 3.0)
        for splits in (0, 5):
            out, lse = cuflash.attention_with_kvcache(cp.asarray(q), cp.asarray(kp), cp.asarray(vp),
                                                      cache_seqlens=cp.asarray(lengths), block_table=cp.asarray(table),
                                                      num_splits=splits, causal=True, return_lse=True)
            _check(f"v{version} paged{page_size} splits={splits}", out, lse, q, keys, values, lengths, failures,
                   causal=True)


def row_data(heads, batch, n, page_size):
    hq, hkv = HEADS[heads]
    rng = cp.random.default_rng(0)
    k, v = (rng.standard_normal((batch, n, hkv, D), dtype=cp.float32).astype(BF16) for _ in range(2))
    q = rng.standard_normal((batch, 1, hq, D), dtype=cp.float32).astype(BF16)
    lengths = cp.full(batch, n, dtype=cp.int32)
    call = dict(cache_seqlens=lengths)
    kk, vv = k, v
    if page_size:
        pages = batch * n // page_size
        table = cp.asarray(np.random.default_rng(0).permutation(pages).reshape(batch, -1).astype(np.int32))
        kk, vv = (x.reshape(pages, page_size, hkv, D) for x in (k, v))
        call["block_table"] = table
        # Sequence b's keys are pages table[b] of the pool: the reference slice is sequence 0's.
        k0 = kk[table[0]].reshape(1, -1, hkv, D)[:, :n, :1]
        v0 = vv[table[0]].reshape(1, -1, hkv, D)[:, :n, :1]
    else:
        k0, v0 = k[:1, :, :1], v[:1, :, :1]
    g = hq // hkv
    ref_args = (cp.asnumpy(q[:1, :, :g]), cp.asnumpy(k0), cp.asnumpy(v0))
    return q, kk, vv, call, k.nbytes + v.nbytes, ref_args, g


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=int, default=1)
    ap.add_argument("--new", type=int, default=3)
    ap.add_argument("--mid", type=int, default=2, help="a third version to time (0 = none)")
    ap.add_argument("--quick", action="store_true", help="batch 1 rows only")
    args = ap.parse_args(argv)
    versions = [args.old] + ([args.mid] if args.mid else []) + [args.new]
    t0 = time.perf_counter()
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    print(f"GPU {name.decode() if isinstance(name, bytes) else name}, CuPy {cp.__version__}, "
          f"NVRTC {cp.cuda.nvrtc.getVersion()}, versions {versions}", flush=True)

    failures: list[str] = []
    for ver in versions:
        use(ver)
        contract_checks(ver, failures)
        print(f"contract checks v{ver}: {'ok' if not any(f.startswith(f'v{ver} ') for f in failures) else 'FAILED'}"
              f"  ({time.perf_counter() - t0:.1f} s)", flush=True)

    configs = [(h, b, n, 0) for h in ("gqa", "mha") for b in ((1,) if args.quick else (1, 8))
               for n in (16384, 65536, 131072)]
    configs += [("gqa", 1, 65536, 256), ("mha", 8, 16384, 256)]
    rows = []
    for heads, batch, n, page_size in configs:
        if time.perf_counter() - t0 > BUDGET_S:
            print(f"time budget reached: skipping {heads} b{batch} n{n} p{page_size}", flush=True)
            continue
        q, kk, vv, call, kv_bytes, ref_args, g = row_data(heads, batch, n, page_size)
        ref, ref_lse = attention_ref(*ref_args)
        naive, naive_lse = naive_attention(*ref_args, return_lse=True)
        name = f"{heads} {HEADS[heads][0]}/{HEADS[heads][1]} b{batch} kv{n // 1024}k" + (f" paged{page_size}" if page_size else "")
        ms = {v: float("inf") for v in versions}
        for ver in versions:  # check this row's slice
            use(ver)
            out, lse = cuflash.attention_with_kvcache(q, kk, vv, return_lse=True, **call)
            try:
                assert_exact(cp.asnumpy(out[:1, :, :g]), ref, naive, "out")
                assert_exact(cp.asnumpy(lse[:1, :g]), ref_lse, naive_lse, "lse")
            except AssertionError as exc:
                failures.append(f"v{ver} {name}: {str(exc).splitlines()[0]}")
        for _ in range(2):  # alternate the versions; best of two
            for ver in versions:
                use(ver)
                ms[ver] = min(ms[ver], time_gpu(lambda: cuflash.attention_with_kvcache(q, kk, vv, **call),
                                                max_seconds=0.5))
        rows.append((name, kv_bytes / 1e6, {v: kv_bytes / ms[v] / 1e9 for v in versions}, ms))
        print(f"{name}: " + ", ".join(f"v{v} {ms[v] * 1e3:.1f} us" for v in versions)
              + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        del q, kk, vv, call
        cp.get_default_memory_pool().free_all_blocks()
    use(None)

    for f in failures:
        print("CHECK FAILED:", f)
    print(f"checks: {'all passed' if not failures else f'{len(failures)} failed'}; "
          f"total {time.perf_counter() - t0:.1f} s")
    mid = f" | v{args.mid} TB/s" if args.mid else ""
    print(f"| config | KV MB | v{args.old} TB/s{mid} | v{args.new} TB/s | v{args.new}/v{args.old} | us v{args.old} / v{args.new} |")
    print("|---|---|---|" + "---|" * bool(args.mid) + "---|---|---|")
    for name, mb, tbs, ms in rows:
        mids = f" | {tbs[args.mid]:.2f}" if args.mid else ""
        print(f"| {name} | {mb:.0f} | {tbs[args.old]:.2f}{mids} | {tbs[args.new]:.2f} | "
              f"{tbs[args.new] / tbs[args.old]:.3f} | {ms[args.old] * 1e3:.1f} / {ms[args.new] * 1e3:.1f} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
