"""kernels/philox.cuh, the kernels' dropout generator, built with the host compiler and compared
word for word and mask for mask with cuflash.dropout (the NumPy generator): the GPU and the
NumPy path must draw the same keep-mask (issue 23)."""

import shutil
import subprocess

import numpy as np
import pytest

from cuflash import _kernels
from cuflash import dropout as D

_PROGRAM = r"""
#include <cstdio>
#include "philox.cuh"
int main() {
    unsigned long long seed, offset, threshold, bh, i, j;
    while (std::scanf("%llu %llu %llu %llu %llu %llu", &seed, &offset, &threshold, &bh, &i, &j) == 6) {
        const DropoutKey key{seed, offset, threshold};
        const PhiloxWords w = key.words(bh, i, j);
        std::printf("%u %u %u %u %d\n", w.w[0], w.w[1], w.w[2], w.w[3], key.keep(bh, i, j) ? 1 : 0);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++ or clang++) to build kernels/philox.cuh with")
    d = tmp_path_factory.mktemp("philox")
    (d / "main.cpp").write_text(_PROGRAM)
    exe = d / "philox"
    subprocess.run([compiler, "-O1", "-std=c++17", "-I", str(_kernels.kernel_dir()), str(d / "main.cpp"), "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


def test_words_and_keep_mask_equal_the_numpy_generator(program):
    rng = np.random.default_rng(0)
    cases = [(0, 0, 0.1, 0, 0, 0), (2**64 - 1, 2**64 - 1, 0.5, 2**31, 2**31 - 1, 2**31 - 1), (1234, 7, 0.0, 3, 5, 6)]
    for _ in range(300):
        cases.append((int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2)), int(rng.integers(0, 2**40)) << 24,
                      float(rng.choice([0.0, 0.1, 0.5, 0.9, 0.999])), int(rng.integers(0, 10**6)),
                      int(rng.integers(0, 2**20)), int(rng.integers(0, 2**20))))
    lines = "".join(f"{s} {o} {D.keep_threshold(p)} {bh} {i} {j}\n" for s, o, p, bh, i, j in cases)
    got = subprocess.run([str(program)], input=lines, capture_output=True, text=True, check=True).stdout.split("\n")
    for (seed, offset, p, bh, i, j), line in zip(cases, got):
        *words, keep = (int(x) for x in line.split())
        key = (seed & 0xFFFFFFFF, ((seed >> 32) + (offset >> 32)) & 0xFFFFFFFF)
        want = D.philox4x32_10((j & ~9, i & ~8, bh, offset & 0xFFFFFFFF), key)
        assert words == [int(w) for w in want], (seed, offset, bh, i, j)
        mask = D.keep_mask_block(seed, offset, p, np.uint64(bh), np.uint64(i), np.uint64(j))
        assert bool(keep) == bool(mask), (seed, offset, p, bh, i, j)
    assert len(got) >= len(cases)


def test_a_draw_equal_to_the_threshold_is_dropped(program):
    """keep = draw < threshold (dropout.py): the boundary, where < and <= differ.  Element (9, 5):
    n = 4 + 0 + 1 = 5, the upper half of word 2 of the counter (4, 1)."""
    draw = int(D.philox4x32_10((5 & ~9, 9 & ~8, 3, 0), (77, 0))[2]) >> 16
    lines = f"77 0 {draw} 3 9 5\n77 0 {draw + 1} 3 9 5\n"
    got = subprocess.run([str(program)], input=lines, capture_output=True, text=True, check=True).stdout.split()
    assert (int(got[4]), int(got[9])) == (0, 1)
