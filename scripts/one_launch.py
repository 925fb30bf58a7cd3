"""One warm forward launch (d128, bf16, seqlen 4096) for profilers such as ncu."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
q, k, v = (cp.asarray(np.random.default_rng(i).standard_normal((4, 4096, 2048 // d, d), dtype=np.float32)).astype(ml_dtypes.bfloat16) for i in range(3))
cuflash.attention(q, k, v)
cp.cuda.Device().synchronize()
