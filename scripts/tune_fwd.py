"""Time the forward kernel under several tile shapes (block_m, block_n, warps) in one run.

Tuning writes data: the winner goes into cuflash._kernels.fwd_tile.  Each configuration is
checked against plain attention before it is timed.
Usage: python scripts/tune_fwd.py [--headdims 64,128,256] [--configs BMxBNxWARPSxMINBLOCKSxQINREGS[xCOLSPLIT[xCHAINS]],...]
       (COLSPLIT, float32/float64 only: warps sharing each 16-row slab, each with its share of O's columns,
       and with 2 each forming half of S (TileConfig.share_s);
       CHAINS, float32 only: the 3xTF32 chains of S and of P V as two digits, e.g. 23; 33 unless given)
       python scripts/tune_fwd.py --sm90 BNxSTAGESxCONSUMERS,... (the Hopper forward's SM90_FWD_TILES)
       python scripts/tune_fwd.py --decode BMxBNxWARPS,...
"""

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash.bench import attention_flops, check_against_plain, time_gpu  # noqa: E402
from cuflash import _fastpath, _kernels  # noqa: E402


@contextlib.contextmanager
def overridden(table, key, value):
    """``table[key] = value`` inside the block: a tile function in ``vars(_kernels)`` (fwd_tile,
    decode_tile) or an entry of a tile dict (SM90_FWD_TILES).

    Variants are memoised per tile table and warm-call plans hold their compiled functions, so
    both are cleared on the way in and on the way out."""
    original = table[key]
    table[key] = value
    _forget_variants()
    try:
        yield
    finally:
        table[key] = original
        _forget_variants()


def _forget_variants():
    _kernels.fwd_variant.cache_clear()
    _kernels.sm90_fwd_variant.cache_clear()
    _fastpath.PLANS.clear()


def tile_function(tile):
    """A stand-in for fwd_tile / decode_tile (whichever arguments they take) that always answers ``tile``."""
    return lambda headdim, *args, **kwargs: tile


def tune_decode(configs):
    """Decode tiles (BMxBNxWARPS): TB/s of KV read for one query token, MHA and GQA contiguous
    caches (decode_tile's other fields kept; WARPS > 1 splits each tile's keys)."""
    for hq, hkv, batch, n in ((32, 32, 1, 131072), (32, 8, 8, 32768), (32, 8, 64, 4096)):
        k, v = (cp.random.standard_normal((batch, n, hkv, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
        q = cp.random.standard_normal((batch, 1, hq, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16)
        for cfg in configs.split(","):
            bm, bn, w = map(int, cfg.split("x"))
            with overridden(vars(_kernels), "decode_tile", tile_function(dataclasses.replace(_kernels.decode_tile(128), block_m=bm, block_n=bn, warps=w))):
                try:
                    out = cuflash.attention(q, k, v)
                    check_against_plain(q, k, v, False, out)
                    ms = time_gpu(lambda: cuflash.attention(q, k, v, out=out))
                    print(f"decode {hq}/{hkv} b{batch} kv{n} {cfg:8} {(k.nbytes + v.nbytes) / ms / 1e9:6.2f} TB/s", flush=True)
                except Exception as exc:
                    print(f"decode {cfg}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
        del k, v


DTYPES = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32, "fp64": np.float64}


def standard_inputs(d, seqlen, dtype="bf16"):
    """q, k, v of the standard sweep (b * s = 16k tokens, h * d = 2048)."""
    b, h = 16384 // seqlen, 2048 // d
    return tuple(cp.asarray(np.random.default_rng(i).standard_normal((b, seqlen, h, d), dtype=np.float32)).astype(DTYPES[dtype])
                 for i in range(3))


def run_config(qkv, causal, cfg, tile_context, variant):
    """Check one configuration against plain attention, time it, print TF/s and registers."""
    q, k, v = qkv
    b, s, h, d = q.shape
    with tile_context:
        try:
            out = cuflash.attention(q, k, v, causal=causal)
            check_against_plain(q, k, v, causal, out)
            ms = time_gpu(lambda: cuflash.attention(q, k, v, causal=causal, out=out))
            fn = _kernels.get_function(variant(), 0)
            tf = attention_flops(b, h, s, s, d, causal) / ms / 1e9
            print(f"d{d} s{s} causal={causal!s:5} {cfg:10} {tf:6.0f} TF/s  regs {fn.num_regs} spill {fn.local_size_bytes}", flush=True)
        except Exception as exc:
            print(f"d{d} s{s} causal={causal} {cfg}: {type(exc).__name__} {str(exc)[:100]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--configs", default="128x64x4x1x1,128x64x8x1x1,64x64x4x3x1,64x64x4x4x1,64x64x4x3x0,128x64x8x2x1,64x128x4x2x1")
    ap.add_argument("--seqlen", default="4096", help="comma-separated lengths")
    ap.add_argument("--sm90", help="Hopper forward tiles to time instead, e.g. 176x2,96x2x3 (keys per tile x stages [x consumer warpgroups, 2])")
    ap.add_argument("--decode", help="decode tiles to time instead, e.g. 16x64x1,16x128x1")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                    help="the --configs forward's dtype: bf16, or fp32/fp64 (flash_fwd.cu's TF32/FP64 forms, issue 24)")
    args = ap.parse_args()
    dtype_name = {"bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}[args.dtype]
    itemsize = np.dtype(DTYPES[args.dtype]).itemsize
    if args.decode:
        return tune_decode(args.decode)
    seqlens = list(map(int, args.seqlen.split(",")))
    _kernels.SM90_FWD_LONG_ROWS = 1 << 62  # every row length on SM90_FWD_TILES, the table under test
    for d in map(int, args.headdims.split(",")):
        for seqlen in seqlens:
            qkv = standard_inputs(d, seqlen, args.dtype)  # one set of inputs for every configuration
            for causal in (False, True):
                if args.sm90:
                    for cfg in args.sm90.split(","):
                        run_config(qkv, causal, cfg, overridden(_kernels.SM90_FWD_TILES, d, (*map(int, cfg.split("x")), 2)[:3]),
                                   lambda: _kernels.sm90_fwd_variant("bfloat16", d, softcap=False, alibi=False))
                    continue
                for cfg in args.configs.split(","):
                    fields = list(map(int, cfg.split("x")))
                    bm, bn, w, mb, qr, cs, ch = fields + [1, 33][len(fields) - 5:]
                    wide = dict(row_pad=4, itemsize=itemsize, col_split=cs, tf32_chains=divmod(ch, 10), share_s=cs == 2) if itemsize > 2 else {}
                    tile = _kernels.TileConfig(bm, bn, w, mb, bool(qr), **wide)
                    if w % cs or bm % (16 * w // cs) or tile.smem_bytes(d) > 227 * 1024 - _kernels.STATIC_SMEM_RESERVE:
                        continue
                    run_config(qkv, causal, cfg, overridden(vars(_kernels), "fwd_tile", tile_function(tile)),
                               lambda: _kernels.fwd_variant(dtype_name, d, softcap=False, alibi=False))


if __name__ == "__main__":
    main()
