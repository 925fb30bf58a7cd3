"""How often the backward misses the exactness rule on tiny problems with few keys per row.

The problems of tests/test_cpu.py::test_backward_exact_on_short_rows (4 query rows, 1-9 keys, 2
heads), 60 draws per head dim, dtype and mask, on the GPU when CuPy sees one, else on the NumPy
path (which meets the rule on all of them).  Prints the failures per kind and the worst ratio;
attention_backward's docstring quotes the GPU numbers (session 6, H200).
"""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuflash import _arrays  # noqa: E402
from tests.test_cpu import check_backward, make_qkv  # noqa: E402

xp = _arrays.cupy_module() if _arrays.gpu_available() else np
MASKS = {"full": {}, "causal": dict(causal=True), "window (1, 0)": dict(window_size=(1, 0))}
print(f"backward on {'the GPU' if xp is not np else 'the NumPy path'}: failures of 60 per kind")
for d in (4, 64, 128):
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for mask, opts in MASKS.items():
            rng = np.random.default_rng(5)
            failed, worst = 0, 0.0
            for _ in range(60):
                q, k, v = make_qkv(rng, dtype, 1, 4, int(rng.integers(1, 10)), 2, 2, d)
                try:
                    check_backward(xp, q, k, v, rng=rng, **opts)
                except AssertionError as exc:
                    failed += 1
                    worst = max(worst, float(str(exc).split("error ratio ")[1].split(" ")[0]))
            print(f"d{d:<4} {np.dtype(dtype).name:<9} {mask:<14} {failed:2d} / 60" + (f", worst ratio {worst:.2f}" if failed else ""))
