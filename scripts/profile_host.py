"""Where the host time of a warm cuflash.attention call goes (cProfile, GPU needed).

    PYTHONPATH=. python scripts/profile_host.py [calls]
"""

import cProfile
import pstats
import sys
import time

import cupy as cp
import numpy as np

import cuflash

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
q = cp.asarray(np.random.default_rng(0).standard_normal((1, 16, 1, 64)).astype(np.float16))
out = cp.empty_like(q)
for _ in range(50):
    cuflash.attention(q, q, q, out=out)
cp.cuda.Device().synchronize()
for label, kwargs in (("out=", dict(out=out)), ("new out", {}), ("causal, lse", dict(causal=True, return_lse=True))):
    t0 = time.perf_counter()
    for _ in range(calls):
        cuflash.attention(q, q, q, **kwargs)
    cp.cuda.Device().synchronize()
    print(f"{label}: {(time.perf_counter() - t0) / calls * 1e6:.1f} us per call")
prof = cProfile.Profile()
prof.enable()
for _ in range(calls):
    cuflash.attention(q, q, q, out=out)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
