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
        // the forward's form (softmax_tile.cuh): the pair of draws of element (i, j)'s word, tested together
        const int n = DropoutKey::bit(i, j);
        bool lo, hi;
        DropoutKey::kept_pair(w.w[n >> 1], DropoutKey::pair_limit(static_cast<unsigned>(threshold)), lo, hi);
        // the dK/dV kernels' form (ScoreMods::keep_words_pair): row i's halves at key j's parity
        bool lo2, hi2;
        DropoutKey::kept_pair(DropoutKey::row_halves(w, static_cast<int>((i >> 3) & 1), static_cast<unsigned>(j & 1)),
                              DropoutKey::pair_limit(static_cast<unsigned>(threshold)), lo2, hi2);
        // the forwards' and dQ kernels' form: element (i, j) of its C fragment, tile (j >> 3) & 1
        bool frag[4];
        DropoutKey::kept_in_tile(w, static_cast<int>((j >> 3) & 1), DropoutKey::pair_limit(static_cast<unsigned>(threshold)), frag);
        std::printf("%u %u %u %u %d %d %d %d\n", w.w[0], w.w[1], w.w[2], w.w[3], key.keep(bh, i, j) ? 1 : 0, (n & 1 ? hi : lo) ? 1 : 0,
                    ((j >> 3) & 1 ? hi2 : lo2) ? 1 : 0, frag[2 * ((i >> 3) & 1) + (j & 1)] ? 1 : 0);
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
        *words, keep, keep_pair, keep_halves, keep_frag = (int(x) for x in line.split())
        key = (seed & 0xFFFFFFFF, ((seed >> 32) + (offset >> 32)) & 0xFFFFFFFF)
        want = D.philox4x32_10((j & ~9, i & ~8, bh, offset & 0xFFFFFFFF), key)
        assert words == [int(w) for w in want], (seed, offset, bh, i, j)
        mask = D.keep_mask_block(seed, offset, p, np.uint64(bh), np.uint64(i), np.uint64(j))
        assert bool(keep) == bool(mask) == bool(keep_pair) == bool(keep_halves) == bool(keep_frag), (seed, offset, p, bh, i, j)
    assert len(got) >= len(cases)


def test_a_draw_equal_to_the_threshold_is_dropped(program):
    """keep = draw < threshold (dropout.py): the boundary, where < and <= differ.  Element (9, 5):
    n = 4 + 0 + 1 = 5, the upper half of word 2 of the counter (4, 1)."""
    draw = int(D.philox4x32_10((5 & ~9, 9 & ~8, 3, 0), (77, 0))[2]) >> 16
    lines = f"77 0 {draw} 3 9 5\n77 0 {draw + 1} 3 9 5\n"
    got = subprocess.run([str(program)], input=lines, capture_output=True, text=True, check=True).stdout.split()
    assert [int(got[k]) for k in (4, 5, 6, 7)] == [0] * 4  # keep_bits, kept_pair, row_halves, kept_in_tile
    assert [int(got[k]) for k in (12, 13, 14, 15)] == [1] * 4


@pytest.mark.parametrize("threshold", [64, 65535, 65536])
def test_kept_pair_at_the_thresholds_ends(program, threshold):
    """kept_pair's 32-bit compares (on words, on row_halves' words and in kept_in_tile) at both halves where the limit is smallest (dropout_p = 1 - 2^-10)
    and largest (2^16: every draw kept; the limit's shift must not wrap), for draws at the threshold
    and one below: an element (i, j) whose draw sits in each half of its word."""
    lines, want = "", []
    for i, j in ((9, 5), (9, 4), (0, 0), (8, 9)):  # n = 5, 4, 0, 7: both halves, words 2, 0 and 3
        n = 4 * ((i >> 3) & 1) + 2 * ((j >> 3) & 1) + (j & 1)
        draw = (int(D.philox4x32_10((j & ~9, i & ~8, 3, 0), (77, 0))[n >> 1]) >> (16 * (n & 1))) & 0xFFFF
        lines += f"77 0 {threshold} 3 {i} {j}\n"
        want.append(int(draw < threshold))
        for t in (draw, draw + 1):  # the boundary itself, where a wrong half or compare shows
            if 1 <= t <= 65536:
                lines += f"77 0 {t} 3 {i} {j}\n"
                want.append(int(draw < t))
    got = subprocess.run([str(program)], input=lines, capture_output=True, text=True, check=True).stdout.split("\n")
    rows = [[int(x) for x in line.split()] for line in got if line]
    assert [r[4] for r in rows] == want
    assert [r[5] for r in rows] == want
    assert [r[6] for r in rows] == want
    assert [r[7] for r in rows] == want
