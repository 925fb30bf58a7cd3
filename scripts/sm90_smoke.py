"""Quick look at the Hopper kernels: forward error against float64 per head dim (with where the
wrong entries sit, for layout bugs), then TF/s of them and of the sm_80 kernels at seqlen 4k/16k.
Usage: python scripts/sm90_smoke.py [fwd] [bwd]   (errors always; timings of the kinds named;
backward: the atomic-dQ default and deterministic=True)"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _fastpath  # noqa: E402
from cuflash.bench import attention_flops, time_gpu  # noqa: E402
from cuflash.reference import attention_ref  # noqa: E402

rng = np.random.default_rng(0)
for d, overlap in [(d, overlap) for overlap in ("", "0") for d in (64, 128, 192, 256)]:
    os.environ["CUFLASH_SM90_OVERLAP"] = overlap  # "0": the forward's ablation without the overlap
    _fastpath.PLANS.clear()
    for causal in (False, True):
        q, k, v = (rng.standard_normal((1, 300, 2, d)).astype(ml_dtypes.bfloat16) for _ in range(3))
        out = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), causal=causal).get().astype(np.float64)
        ref, _ = attention_ref(q, k, v, causal=causal)
        err = np.abs(out - ref)
        bad = np.argwhere(err > 0.05)
        print(f"d{d}{' without overlap' if overlap else ''} causal={causal}: max err {err.max():.3g}, bad {len(bad)}"
              + (f", rows {np.unique(bad[:, 1])[:8]}, cols {np.unique(bad[:, 3])[:16]}" if len(bad) else ""))


def tflops(d, s, causal, disable, backward=False, deterministic=False, overlap="", persistent=""):
    os.environ["CUFLASH_DISABLE_SM90"] = "1" if disable else ""
    os.environ["CUFLASH_SM90_OVERLAP"] = overlap
    os.environ["CUFLASH_SM90_PERSISTENT"] = persistent
    _fastpath.PLANS.clear()
    b, h = 16384 // s, 2048 // d
    q, k, v = (cp.asarray(rng.standard_normal((b, s, h, d), dtype=np.float32)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    run = ((lambda: cuflash.attention_backward(out, q, k, v, out, lse, causal=causal, deterministic=deterministic))
           if backward else (lambda: cuflash.attention(q, k, v, causal=causal)))
    return attention_flops(b, h, s, s, d, causal, backward=backward) / time_gpu(run) / 1e9


for kind in [a for a in sys.argv[1:] if a in ("fwd", "bwd")]:
    print(f"{kind}: d causal seqlen: " + ("sm90 atomic dQ / sm90 deterministic" if kind == "bwd" else "sm90 / sm80 / sm90 without overlap / sm90 one block per tile") + " TF/s")
    for d in (64, 128, 192, 256) if kind == "fwd" else (64, 128):
        for causal in (False, True):
            for s in (4096, 16384):
                runs = [(False, False, "", ""), (False, True, "", "")] if kind == "bwd" else [
                    (False, False, "", ""), (True, False, "", ""), (False, False, "0", ""), (False, False, "", "0")]
                rates = [tflops(d, s, causal, disable, kind == "bwd", *rest) for disable, *rest in runs]
                print(f"{kind} d{d} {causal} {s}: " + " / ".join(f"{r:.0f}" for r in rates), flush=True)

# Backward tiles to compare: SM90_BWD_TILES="64:64x1x2,128:64x1x2" (head dim: inner x warpgroups x min blocks),
# in the form without the producer warpgroup (the override takes the head dim out of SM90_BWD_PRODUCER_TILES).
for spec in filter(None, os.environ.get("SM90_BWD_TILES", "").split(",")):
    from cuflash import _kernels

    d, tile = spec.split(":")
    d = int(d)
    _kernels.SM90_BWD_TILES[d] = tuple(map(int, tile.split("x")))
    _kernels.SM90_BWD_PRODUCER_TILES.pop(d, None)
    _kernels.sm90_bwd_variant.cache_clear()
    row = [f"{tflops(d, s, causal, False, True):.0f}" for causal in (False, True) for s in (4096, 16384)]
    print(f"bwd tile d{d} {tile}: non-causal 4k/16k, causal 4k/16k: {' / '.join(row)}", flush=True)
