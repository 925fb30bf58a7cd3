"""One attention call of the standard sweep's shape, for Nsight Compute to profile.

    ncu --clock-control none -k regex:cuflash_fwd_sm90 --launch-skip 2 --launch-count 1 --set full \\
        python scripts/ncu_case.py --headdim 128 --seqlen 16384 [--causal] [--varlen] [--backward [--deterministic]] [--mods mask]

bf16 (or --dtype fp16/fp32/fp64), batch * seqlen = 16k tokens, nheads * headdim = 2048 (the shape of scripts/bench.py and
scripts/ab_compare.py).  The call runs three times (the first compiles and plans, the second is
warm: profile the third with --launch-skip 2), then once more after a synchronisation.
--varlen packs the batch as equal sequences of --seqlen with cu_seqlens.  --mods adds a modifier as
`bench --suite modifiers` does: `mask` a (B, 1, 1, S) key-padding mask (valid lengths in [S/2, S]),
`bias` a (1, H, S, S) bf16 bias, `dropout` dropout 0.1.  gpu_check.sh's `ncu`
stage runs it for a few cases and keeps ncu's text report (stall reasons, issue-slot use, pipe
utilisation) in ncu_*.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="with --backward: deterministic=True")
    ap.add_argument("--mods", choices=("mask", "bias", "dropout"))
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "fp64"), default="bf16")
    args = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes

    import cuflash

    d, s = args.headdim, args.seqlen
    batch, heads = max(1, 16384 // s), 2048 // d
    rng = cp.random.default_rng(0)

    def rand(shape):
        dtype = {"bf16": ml_dtypes.bfloat16, "fp16": cp.float16, "fp32": cp.float32, "fp64": cp.float64}[args.dtype]
        return rng.standard_normal(shape, dtype=cp.float32).astype(dtype)

    if args.varlen:
        q, k, v, dout = (rand((batch * s, heads, d)) for _ in range(4))
        cu = cp.arange(0, batch * s + 1, s, dtype=cp.int32)
        opts = dict(max_seqlen_q=s, max_seqlen_k=s, causal=args.causal)
        fwd = lambda: cuflash.attention_varlen(q, k, v, cu, cu, return_lse=True, **opts)  # noqa: E731
        bwd = lambda out, lse: cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu,  # noqa: E731
                                                                 deterministic=args.deterministic, **opts)
    else:
        q, k, v, dout = (rand((batch, s, heads, d)) for _ in range(4))
        mods = {}
        if args.mods:
            from cuflash.bench import _modifier_inputs

            case = {"mask": "key-padding", "bias": "bias", "dropout": "dropout"}[args.mods]
            mods, _, _ = _modifier_inputs(case, batch, heads, s, args.causal, rng)
            mods.pop("causal")
        fwd = lambda: cuflash.attention(q, k, v, causal=args.causal, return_lse=True, **mods)  # noqa: E731
        bwd = lambda out, lse: cuflash.attention_backward(dout, q, k, v, out, lse, causal=args.causal,  # noqa: E731
                                                          deterministic=args.deterministic, **mods)
    for _ in range(3):
        out, lse = fwd()
        if args.backward:
            bwd(out, lse)
    cp.cuda.Device().synchronize()
    out, lse = fwd()
    if args.backward:
        bwd(out, lse)
    cp.cuda.Device().synchronize()
    print(f"ran {args.dtype} d{d} s{s}{' causal' if args.causal else ''}{' varlen' if args.varlen else ''}"
          f"{' backward' if args.backward else ''}")


if __name__ == "__main__":
    main()
