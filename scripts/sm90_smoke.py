"""Quick look at the Hopper forward kernel: error against float64 per head dim (with where the
wrong entries sit, for layout bugs), then TF/s of it and of the sm_80 kernel at seqlen 4k/16k."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _fastpath  # noqa: E402
from cuflash.reference import attention_ref  # noqa: E402

rng = np.random.default_rng(0)
for d in (64, 128, 256):
    for causal in (False, True):
        q, k, v = (rng.standard_normal((1, 300, 2, d)).astype(ml_dtypes.bfloat16) for _ in range(3))
        out = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), causal=causal).get().astype(np.float64)
        ref, _ = attention_ref(q, k, v, causal=causal)
        err = np.abs(out - ref)
        bad = np.argwhere(err > 0.05)
        print(f"d{d} causal={causal}: max err {err.max():.3g}, bad {len(bad)}"
              + (f", rows {np.unique(bad[:, 1])[:8]}, cols {np.unique(bad[:, 3])[:16]}" if len(bad) else ""))


def tflops(d, s, causal, disable):
    os.environ["CUFLASH_DISABLE_SM90"] = "1" if disable else ""
    _fastpath.PLANS.clear()
    b, h = 16384 // s, 2048 // d
    q, k, v = (cp.asarray(rng.standard_normal((b, s, h, d), dtype=np.float32)).astype(ml_dtypes.bfloat16) for _ in range(3))
    for _ in range(3):
        cuflash.attention(q, k, v, causal=causal)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    n = 20
    start.record()
    for _ in range(n):
        cuflash.attention(q, k, v, causal=causal)
    stop.record()
    stop.synchronize()
    ms = cp.cuda.get_elapsed_time(start, stop) / n
    return 4 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9


print("d causal seqlen: sm90 / sm80 TF/s")
for d in (64, 128, 256):
    for causal in (False, True):
        for s in (4096, 16384):
            print(f"d{d} {causal} {s}: {tflops(d, s, causal, False):.0f} / {tflops(d, s, causal, True):.0f}")
