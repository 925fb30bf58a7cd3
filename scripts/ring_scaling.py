"""Ring attention over the GPUs of one machine (issue 25): exactness against one GPU, weak and
strong scaling, and the transfers alone, in one run.

One process per GPU (``multiprocessing``, spawn), an NCCL communicator from a unique id the
parent hands out (no MPI needed), ``cuflash.parallel.NcclComm``; rank 0 prints the table.

- exact: ring forward and backward of a (1, 1024·world, 8, D) bf16 sequence, causal, zig-zag
  shards, against the float64 reference with the exactness rule (``cuflash.reference``);
- weak: ``--tokens-per-gpu`` tokens on each GPU (the sequence grows with the GPUs); per-GPU
  throughput against one GPU running its local size alone;
- strong: ``--total`` tokens across the GPUs, against one GPU running all of them;
- transfers: the world − 1 exchanges of the K/V shard alone (what the ring must hide).

Usage: NCCL_NVLS_ENABLE=0 python scripts/ring_scaling.py [--gpus N] [--tokens-per-gpu 131072]
           [--total 262144] [--headdim 128] [--heads 16] [--markdown FILE]
       python scripts/ring_scaling.py --dry-run [--gpus N]   (threads over NumPy arrays, tiny
           sizes, no GPU: checks this script's schedule and table, as tests/test_parallel.py does)
TF/s: forward 4·B·H·S·S·D (halved for causal) over the whole sequence, backward 2.5×; per GPU
it is that divided by the number of GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import parallel  # noqa: E402
from cuflash import reference as R  # noqa: E402


def flops(tokens: int, heads: int, headdim: int, causal: bool) -> float:
    return 4.0 * heads * tokens * tokens * headdim / (2 if causal else 1)


def wall_ms(fn, reps: int = 5) -> float:
    """Median milliseconds of fn() after a warm-up, by the wall clock (the dry run; on the GPU
    cuflash.bench.time_gpu times with CUDA events)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def rank_main(comm, xp, dtype, args) -> dict:
    """What every rank runs; returns its measurements (rank 0's table collects them)."""
    rank, world = comm.rank, comm.size
    if xp is np:
        clock = wall_ms
    else:
        from cuflash.bench import time_gpu as clock
    rng = np.random.default_rng(0)  # the same whole sequence on every rank
    h, d = args.heads, args.headdim

    def whole(tokens, heads=h):
        return [xp.asarray(rng.standard_normal((1, tokens, heads, d)).astype(dtype)) for _ in range(3)]

    def shards(xs):
        return [parallel.shard(x, rank, world) for x in xs]

    row = {"rank": rank}
    # exactness of forward and backward against the float64 reference
    n = args.exact_tokens * world
    q, k, v = whole(n, 8)
    dout = xp.asarray(rng.standard_normal(q.shape).astype(dtype))
    qs, ks, vs, ds = shards([q, k, v, dout])
    out, lse = parallel.ring_attention(qs, ks, vs, comm, causal=True, return_lse=True)
    grads = parallel.ring_attention_backward(ds, qs, ks, vs, out, lse, comm, causal=True)
    parts = [comm.allgather(xp.ascontiguousarray(x)) for x in (out, *grads)]  # (NCCL gathers arrays, not objects)
    if rank == 0:
        got = [parallel.unshard([_host(p) for p in gathered]) for gathered in parts]
        host = [_host(x) for x in (q, k, v, dout)]
        ref_out, _ = R.attention_ref(*host[:3], causal=True)
        naive_out = R.naive_attention(*host[:3], causal=True)
        refs = (ref_out, *R.attention_backward_ref(host[3], *host[:3], causal=True)[:3])
        naives = (naive_out, *R.naive_attention_backward(host[3], *host[:3], causal=True)[:3])
        row["exact"] = {name: R.max_error_ratio(g, r, nv) for name, g, r, nv in zip(("out", "dq", "dk", "dv"), got, refs, naives)}
    # weak scaling: args.tokens_per_gpu on each GPU
    for label, tokens in (("weak", args.tokens_per_gpu * world), ("strong", args.total)):
        q, k, v = whole(tokens)
        qs, ks, vs = shards([q, k, v])
        dout = xp.ones_like(qs)
        fwd = clock(lambda: parallel.ring_attention(qs, ks, vs, comm, causal=True))
        out, lse = parallel.ring_attention(qs, ks, vs, comm, causal=True, return_lse=True)
        bwd = clock(lambda: parallel.ring_attention_backward(dout, qs, ks, vs, out, lse, comm, causal=True))
        row[label] = dict(tokens=tokens, fwd_ms=fwd, bwd_ms=bwd)
        if rank == 0:  # one GPU alone: its local size (weak) or the whole sequence (strong)
            alone = tokens // world if label == "weak" else tokens
            q1, k1, v1 = (x[:, :alone] for x in (q, k, v))
            row[label]["one_fwd_ms"] = clock(lambda: cuflash.attention(q1, k1, v1, causal=True))
            o1, l1 = cuflash.attention(q1, k1, v1, causal=True, return_lse=True)
            d1 = xp.ones_like(q1)
            row[label]["one_bwd_ms"] = clock(lambda: cuflash.attention_backward(d1, q1, k1, v1, o1, l1, causal=True))
            row[label]["one_tokens"] = alone
        del q, k, v, qs, ks, vs, out, lse, dout
    # the transfers alone: world - 1 exchanges of one K/V shard
    ks, vs = shards(whole(args.tokens_per_gpu * world)[1:])

    def ring_of_transfers():
        block = (ks, vs)
        for _ in range(world - 1):
            block = comm.sendrecv(block, (rank + 1) % world, (rank - 1) % world)

    row["transfers_ms"] = clock(ring_of_transfers)
    return row


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def table(rows, args, world, device_name: str, dtype_name: str = "bf16") -> str:
    r0 = rows[0]
    lines = [f"Ring attention, {world} × {device_name}, {dtype_name}, head dim {args.headdim}, {args.heads} heads, causal, "
             "zig-zag shards", "",
             "exactness (max_error_ratio, <= 1 passes): " + ", ".join(f"{k} {v:.3f}" for k, v in r0["exact"].items()), "",
             "| case | tokens | GPUs | fwd ms | bwd ms | fwd TF/s per GPU | bwd TF/s per GPU | one GPU fwd TF/s | "
             "one GPU bwd TF/s | per-GPU fwd / one GPU | speed-up fwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ("weak", "strong"):
        m = max((r[label] for r in rows), key=lambda x: x["fwd_ms"])  # the slowest rank sets the pace
        b = max(r[label]["bwd_ms"] for r in rows)
        f = flops(m["tokens"], args.heads, args.headdim, True)
        f1 = flops(r0[label]["one_tokens"], args.heads, args.headdim, True)
        per_fwd, per_bwd = f / m["fwd_ms"] / 1e9 / world, 2.5 * f / b / 1e9 / world
        one_fwd, one_bwd = f1 / r0[label]["one_fwd_ms"] / 1e9, 2.5 * f1 / r0[label]["one_bwd_ms"] / 1e9
        # (a speed-up is the strong case's: the weak case's GPUs each do the one GPU's work)
        speedup = f"{r0[label]['one_fwd_ms'] / m['fwd_ms']:.2f}" if label == "strong" else "–"
        lines.append(f"| {label} | {m['tokens']} | {world} | {m['fwd_ms']:.2f} | {b:.2f} | {per_fwd:.4g} | "
                     f"{per_bwd:.4g} | {one_fwd:.4g} | {one_bwd:.4g} | {per_fwd / one_fwd:.3f} | {speedup} |")
    lines += ["", f"K/V transfers alone ({world - 1} exchanges of one shard): "
              f"{max(r['transfers_ms'] for r in rows):.2f} ms (against the weak case's forward above)"]
    return "\n".join(lines)


def _gpu_rank(rank, world, uid, args, results):
    import cupy as cp
    from cupy.cuda import nccl

    cp.cuda.Device(rank).use()
    comm = parallel.NcclComm(nccl.NcclCommunicator(world, uid, rank), rank, world, timeout=args.timeout)
    import ml_dtypes

    row = rank_main(comm, cp, ml_dtypes.bfloat16, args)
    results.put((rank, row, cp.cuda.runtime.getDeviceProperties(rank)["name"].decode()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all CuPy sees; 2 for --dry-run)")
    ap.add_argument("--tokens-per-gpu", type=int, default=131072, help="weak scaling: tokens on each GPU")
    ap.add_argument("--total", type=int, default=262144, help="strong scaling: tokens across the GPUs")
    ap.add_argument("--exact-tokens", type=int, default=1024, help="exactness check: tokens per GPU")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a transfer may take (CollectiveTimeout)")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--dry-run", action="store_true", help="threads over NumPy arrays with tiny sizes, no GPU")
    args = ap.parse_args(argv)
    if args.dry_run:
        world = args.gpus or 2
        args.tokens_per_gpu, args.total, args.exact_tokens, args.heads, args.headdim = 64, 32 * 2 * world, 16, 2, 16
        rows = parallel.run_local(world, rank_main, np, np.float32, args)
        device, dtype_name = "CPU (dry run)", "float32"
    else:
        import multiprocessing as mp

        import cupy as cp
        from cupy.cuda import nccl

        world = args.gpus or cp.cuda.runtime.getDeviceCount()
        if world < 2:
            raise SystemExit(f"ring scaling needs 2 or more GPUs; CuPy sees {world}")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        ctx = mp.get_context("spawn")
        uid, results = nccl.get_unique_id(), ctx.Queue()
        procs = [ctx.Process(target=_gpu_rank, args=(r, world, uid, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        got = sorted((results.get(timeout=args.timeout * 4) for _ in range(world)), key=lambda x: x[0])
        for p in procs:
            p.join()
        rows, device, dtype_name = [g[1] for g in got], got[0][2], "bf16"
    text = table(rows, args, world, device, dtype_name)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
