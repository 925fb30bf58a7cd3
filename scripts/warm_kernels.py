"""Compile every kernel variant into CuPy's on-disk cache, many at once (NVRTC releases the GIL),
so that a GPU test run that follows loads them instead of compiling them test by test.

    python scripts/warm_kernels.py [--threads 16] [--match sm90,bwd]

--match keeps the variants whose names contain one of its comma-separated parts (a test run that
covers only some kernels then waits for those alone; scripts/gpu_check.sh passes WARM_MATCH).
"""
import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402

from cuflash import _gpu, _kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--match", default="", help="comma-separated parts of variant names to keep (default: all)")
    args = ap.parse_args()
    device = cp.cuda.Device().id
    hopper = _gpu._is_hopper(device)
    parts = [m for m in args.match.split(",") if m]
    variants = [v for v in _kernels.all_variants(_gpu._smem_limit(device)) if (hopper or v.arch != "90a")
                and (not parts or any(m in v.name for m in parts))]

    def build(v):
        with cp.cuda.Device(device):
            cp.RawModule(code=_kernels.read_source(v.filename), options=v.options()).compile()

    start = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(build, variants))
    print(f"{len(variants)} kernel modules compiled into the cache in {time.perf_counter() - start:.1f} s "
          f"({args.threads} threads)")


if __name__ == "__main__":
    main()
