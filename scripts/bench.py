"""Benchmark entry point kept for scripts/gpu_check.sh: the code lives in cuflash/bench.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuflash.bench import main  # noqa: E402

if __name__ == "__main__":
    main()
