"""A/B speed comparison of cuflash checkouts on this GPU, in alternating processes.

    python scripts/ab_compare.py BASE NEW [NEW2 ...] [--rounds 3] [--parts fwd,bwd,decode,varlen,host] [--markdown FILE]

Each checkout is a directory, optionally followed by environment settings for its processes
(``.ab/pers,CUFLASH_SM90_PERSISTENT=1``).  In every round each checkout runs once, in a fresh
process (its own kernels, compiled from its own sources) that measures all parts; the order of the
checkouts rotates from round to round, so none always goes first.  Rows: the forward and backward
(bf16, batch * seqlen = 16k, nheads * headdim = 2048, head dims 64/128/256), decode against
contiguous and paged caches (TB/s of cache read), varlen prefill (TF/s), (parts "widefwd" and "widebwd",
not in the default parts) the float32/float64 forward and backward at head dims 64-256, seqlen 4k, (parts "fwdmods" and
"bwdmods", not in the default parts) the bf16 forward (also without a modifier) and backward at head dims 64-256 with a
key-padding mask, a bias or dropout, (part "widemods", not in the
default parts) their forward and backward with a bias, a key-padding mask or dropout, and (part "host") warm
calls of tiny problems per millisecond, eager (host time, unless the kernel is slower) and
replayed from a captured CUDA graph (the GPU's rate alone).  Per row: each checkout's median over the
rounds, each NEW / BASE of the medians, and the spread of one checkout between rounds (the
largest (max - min) / median of the two compared: an A/A difference).  A ratio is flagged slower
when it is < 0.97 and the difference exceeds that spread (a gap smaller than the spread is noise;
more rounds narrow it).  Used for the speed check of changes that touch every kernel
(docs/perf-notes.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FWD = [(d, s, c) for d in (64, 128, 256) for s, c in ((1024, False), (4096, False), (4096, True), (16384, True))]
BWD = [(64, 4096, False), (64, 16384, True), (128, 4096, False), (128, 16384, True), (256, 4096, False)]
BWD256 = [(192, 4096, False), (256, 4096, False), (256, 16384, True)]  # part "bwd256": the column split's head dims
MODS_HEADDIMS = (64, 128, 192, 256)  # parts "fwdmods", "bwdmods": bf16 with a key-padding mask, a bias, dropout (issue 23's kernels)
DECODE = [("mha", 1, 16384), ("mha", 8, 4096), ("mha", 64, 4096), ("gqa", 1, 65536), ("gqa", 8, 16384), ("gqa", 64, 16384)]
VARLEN = [(d, s) for d in (64, 128) for s in (512, 2048, 8192)]
WIDE_DTYPES = os.environ.get("AB_WIDE_DTYPES", "float32,float64").split(",")  # the wide parts' dtypes (AB_WIDE_DTYPES narrows them)
WIDE_ROWS = [(dt, d) for dt in WIDE_DTYPES for d in (64, 96, 128, 160, 192, 256)]  # (widefwd, widebwd) seqlen 4096, non-causal
WIDE_MODS = [(dt, d) for dt in WIDE_DTYPES for d in (64, 128)]  # seqlen 4096, non-causal


def _side(checkout: str, parts: str) -> list:
    """Rows of the parts (comma-separated), measured with the cuflash of ``checkout`` (run in its own process)."""
    return [row for part in parts.split(",") for row in _part(checkout, part)]


def _part(checkout: str, part: str) -> list:
    """Rows of one part, measured with the cuflash of ``checkout``."""
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    import cupy as cp
    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash import bench as B

    bf16 = ml_dtypes.bfloat16
    rows = []

    def rand(shape):
        return cp.random.default_rng(0).standard_normal(shape, dtype=cp.float32).astype(bf16)

    def time_backward(dout, q, k, v, out, lse, **opts):  # ms of attention_backward into its own gradients
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
        return B.time_gpu(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                                             **opts))

    def modifier_forms(batch, heads, s, randn):  # the modifier parts' bias, key padding (valid keys per entry), dropout
        valid = cp.asarray(np.random.default_rng(0).integers(s // 2, s + 1, size=(batch, 1, 1, 1)))
        return {"bias 1-H-S-S": dict(bias=randn((1, heads, s, s))), "key padding": dict(mask=cp.arange(s)[None, None, None, :] < valid),
                "dropout 0.1": dict(dropout_p=0.1, dropout_seed=3)}

    if part in ("fwd", "bwd", "bwd256"):
        for d, s, causal in {"fwd": FWD, "bwd": BWD, "bwd256": BWD256}[part]:
            batch, heads = 16384 // s, 2048 // d
            q, k, v, dout = (rand((batch, s, heads, d)) for _ in range(4))
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            flops = B.attention_flops(batch, heads, s, s, d, causal, backward=part != "fwd")
            if part == "fwd":
                ms = B.time_gpu(lambda: cuflash.attention(q, k, v, causal=causal, out=out))
            else:
                ms = time_backward(dout, q, k, v, out, lse, causal=causal)
            rows.append((f"{part} d{d} s{s}{' causal' if causal else ''}", flops / ms / 1e9))
    elif part == "widefwd":  # the float32/float64 forward (issue 24)
        for dtype, d in WIDE_ROWS:
            s, batch, heads = 4096, 4, 2048 // d
            q, k, v = (cp.random.default_rng(0).standard_normal((batch, s, heads, d), dtype=dtype) for _ in range(3))
            out = cuflash.attention(q, k, v)
            ms = B.time_gpu(lambda: cuflash.attention(q, k, v, out=out))
            rows.append((f"fwd {np.dtype(dtype).name} d{d} s{s}", B.attention_flops(batch, heads, s, s, d, False) / ms / 1e9))
    elif part == "widebwd":  # the float32/float64 backward (issue 24), atomic dQ as by default
        for dtype, d in WIDE_ROWS:
            s, batch, heads = 4096, 4, 2048 // d
            q, k, v, dout = (cp.random.default_rng(0).standard_normal((batch, s, heads, d), dtype=dtype) for _ in range(4))
            out, lse = cuflash.attention(q, k, v, return_lse=True)
            ms = time_backward(dout, q, k, v, out, lse)
            rows.append((f"bwd {np.dtype(dtype).name} d{d} s{s}", B.attention_flops(batch, heads, s, s, d, False, backward=True) / ms / 1e9))
    elif part == "fwdmods":  # the bf16 forward without a modifier and with each (seqlen 4k, non-causal)
        for d in MODS_HEADDIMS:
            s, batch, heads = 4096, 4, 2048 // d
            q, k, v = (rand((batch, s, heads, d)) for _ in range(3))
            forms = {"none": {}, **modifier_forms(batch, heads, s, rand)}
            for form, mods in forms.items():
                out = cuflash.attention(q, k, v, **mods)
                ms = B.time_gpu(lambda: cuflash.attention(q, k, v, out=out, **mods))
                rows.append((f"fwdmods d{d} {form}", B.attention_flops(batch, heads, s, s, d, False) / ms / 1e9))
                del mods, out
            del forms
            cp.get_default_memory_pool().free_all_blocks()
    elif part == "bwdmods":
        for d in MODS_HEADDIMS:
            s, batch, heads = 4096, 4, 2048 // d
            q, k, v, dout = (rand((batch, s, heads, d)) for _ in range(4))
            forms = modifier_forms(batch, heads, s, rand)
            for form, mods in forms.items():
                out, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
                ms = time_backward(dout, q, k, v, out, lse, **mods)
                rows.append((f"bwdmods d{d} {form}", B.attention_flops(batch, heads, s, s, d, False, backward=True) / ms / 1e9))
                del mods, out, lse
            del forms
            cp.get_default_memory_pool().free_all_blocks()
    elif part == "widemods":  # the float32/float64 modifier form (issue 24): none, bias, key padding, dropout
        for dtype, d in WIDE_MODS:
            s, batch, heads = 4096, 4, 2048 // d
            gen = cp.random.default_rng(0)
            q, k, v, dout = (gen.standard_normal((batch, s, heads, d), dtype=dtype) for _ in range(4))
            forms = {"none": {}, **modifier_forms(batch, heads, s, lambda shape: gen.standard_normal(shape, dtype=dtype))}
            for form, mods in forms.items():
                out, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
                ms = B.time_gpu(lambda: cuflash.attention(q, k, v, out=out, **mods))
                rows.append((f"fwd {np.dtype(dtype).name} d{d} {form}", B.attention_flops(batch, heads, s, s, d, False) / ms / 1e9))
                ms = time_backward(dout, q, k, v, out, lse, **mods)
                rows.append((f"bwd {np.dtype(dtype).name} d{d} {form}", B.attention_flops(batch, heads, s, s, d, False, backward=True) / ms / 1e9))
                del mods, out, lse
            del forms
            cp.get_default_memory_pool().free_all_blocks()
    elif part == "decode":
        for name, batch, n in DECODE:
            hq, hkv = B.DECODE_HEADS[name]
            k, v = rand((batch, n, hkv, 128)), rand((batch, n, hkv, 128))
            q = rand((batch, 1, hq, 128))
            lengths = cp.full(batch, n, dtype=cp.int32)
            nbytes = k.nbytes + v.nbytes
            ms = B.time_gpu(lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths))
            rows.append((f"decode {hq}/{hkv} B{batch} {n}", nbytes / ms / 1e9))
            pages = batch * n // 256
            table = cp.asarray(np.random.default_rng(0).permutation(pages).reshape(batch, -1).astype(np.int32))
            kp, vp = (x.reshape(pages, 256, hkv, 128) for x in (k, v))
            ms = B.time_gpu(lambda: cuflash.attention_with_kvcache(q, kp, vp, cache_seqlens=lengths, block_table=table))
            rows.append((f"decode {hq}/{hkv} B{batch} {n} paged256", nbytes / ms / 1e9))
            del k, v, kp, vp
            cp.get_default_memory_pool().free_all_blocks()
    elif part == "varlen":
        for d, s in VARLEN:
            batch, heads = 16384 // s, 2048 // d
            packed = [rand((batch * s, heads, d)) for _ in range(3)]
            cu = cp.arange(0, batch * s + 1, s, dtype=cp.int32)
            for causal in (False, True):
                flops = B.attention_flops(batch, heads, s, s, d, causal)
                ms = B.time_gpu(lambda: cuflash.attention_varlen(*packed, cu, cu, max_seqlen_q=s, max_seqlen_k=s,
                                                                 causal=causal))
                rows.append((f"varlen d{d} s{s}{' causal' if causal else ''}", flops / ms / 1e9))
    elif part == "host":  # warm calls of a problem too small to matter on the GPU: host-bound, unless the kernel is not
        import time

        q, k, v = (rand((1, 128, 8, 64)) for _ in range(3))
        kc, vc = rand((4, 4096, 8, 64)), rand((4, 4096, 8, 64))
        qd, lengths = rand((4, 1, 8, 64)), cp.full(4, 4096, dtype=cp.int32)
        out = cuflash.attention(q, k, v)
        calls = {"attention out=": lambda: cuflash.attention(q, k, v, out=out),
                 "decode 4 x 4k": lambda: cuflash.attention_with_kvcache(qd, kc, vc, cache_seqlens=lengths)}
        for name, fn in calls.items():
            for _ in range(200):
                fn()
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            for _ in range(3000):
                fn()
            cp.cuda.Device().synchronize()
            rows.append((f"host {name}, calls per ms", 3000 / ((time.perf_counter() - t) * 1e3)))
            # The same calls' GPU time alone: 100 of them captured in a CUDA graph and replayed (no host
            # work between the kernels), so that a slow row above can be told host-bound or kernel-bound.
            stream = cp.cuda.Stream(non_blocking=True)
            try:
                with stream:
                    fn()
                    stream.synchronize()
                    stream.begin_capture()
                    try:
                        for _ in range(100):
                            fn()
                    finally:
                        graph = stream.end_capture()
                    graph.launch(stream)
                    stream.synchronize()
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    a.record(stream)
                    for _ in range(10):
                        graph.launch(stream)
                    b.record(stream)
                    b.synchronize()
            except Exception as e:  # a checkout whose calls cannot be captured: no row
                print(f"{name}: not captured ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            rows.append((f"host {name}, GPU calls per ms (graph)", 1000 / cp.cuda.get_elapsed_time(a, b)))
    return rows


def _spec(text: str) -> tuple:
    """(label, directory, environment) of one checkout argument ``DIR[,VAR=VALUE...]``."""
    directory, *settings = text.split(",")
    env = dict(item.split("=", 1) for item in settings)
    return text, str(Path(directory).resolve()), env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkouts", nargs="*", help="BASE NEW [NEW2 ...], each DIR[,VAR=VALUE...]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="fwd,bwd,decode,varlen,host")
    ap.add_argument("--markdown")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run the parts with one checkout
    args = ap.parse_args(argv)
    if args.side:
        print(json.dumps(_side(args.side, args.parts)))
        return
    if len(args.checkouts) < 2:
        ap.error("give at least two checkouts: BASE NEW [NEW2 ...]")
    sides = [_spec(c) for c in args.checkouts]
    runs: dict = {}  # row -> side index -> one value per round
    for i in range(args.rounds):
        for j in range(len(sides)):
            index = (i + j) % len(sides)  # rotate the order: neither side always goes first
            label, directory, env = sides[index]
            proc = subprocess.run([sys.executable, __file__, "--side", directory, "--parts", args.parts],
                                  capture_output=True, text=True, env={**os.environ, **env})
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{label} failed")
            for row, value in json.loads(proc.stdout.strip().splitlines()[-1]):
                runs.setdefault(row, {}).setdefault(index, []).append(value)
        print(f"round {i + 1} of {args.rounds} done", file=sys.stderr)
    names = [label for label, _, _ in sides]
    head = ["row", *names, *(f"{n} / {names[0]}" for n in names[1:]), f"A/A spread ({args.rounds} rounds)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r in runs.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        spread = {k: (max(v) - min(v)) / med[k] for k, v in r.items()}
        cells = [f"{med[k]:.2f}" if k in med else "-" for k in range(len(sides))]
        for k in range(1, len(sides)):
            if k not in med or 0 not in med:
                cells.append("-")
                continue
            ratio = med[k] / med[0]
            slower = ratio < 0.97 and 1 - ratio > max(spread[0], spread[k])
            cells.append(f"{ratio:.3f}{' **slower**' if slower else ''}")
        cells.append(f"{max(spread.values()):.3f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
