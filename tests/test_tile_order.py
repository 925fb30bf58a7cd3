"""The Hopper forward's tile order (cuflash._gpu._sm90_tile_grid, kernels/sm90_scheduler.cuh) on a
stand-in for the H200's resources: no GPU needed.  docs/perf-notes.md h13 has the measurement."""
import pytest

from cuflash import _gpu

SMS, L2 = 132, 60 * 2**20  # H200: 132 SMs, 60 MB of L2


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(_gpu, "_sm_resources", lambda device: (SMS, 233472))
    monkeypatch.setattr(_gpu, "_l2_bytes", lambda device: L2)


def kv_bytes(seqlen, headdim):
    return seqlen * headdim * 2 * 2  # K and V rows of one (batch, head) pair, 16-bit


@pytest.mark.parametrize("seqlen, headdim", [(1024, 64), (1024, 128), (4096, 128), (16384, 128), (4096, 256),
                                             (16384, 256), (65536, 64)])
def test_a_section_gives_every_sm_a_tile_and_no_more(seqlen, headdim):
    m_blocks, pairs = -(-seqlen // 128), 2048 // headdim * max(1, 16384 // seqlen)
    section, grid = _gpu._sm90_tile_grid(0, m_blocks, pairs, kv_bytes(seqlen, headdim))
    assert 1 <= section <= pairs
    assert section * kv_bytes(seqlen, headdim) <= L2 // 2 or section == 1  # K and V of a section fit
    fewest = -(-SMS // m_blocks)  # pairs whose tiles give every SM one
    assert section <= fewest  # the tiles in flight share the K and V of few pairs
    assert section == min(pairs, fewest, max(1, L2 // 2 // kv_bytes(seqlen, headdim)))
    assert grid == (min(SMS, m_blocks * pairs),)


def test_sections_of_the_measured_row():
    # d128, 4k, 16k tokens: 32 query tiles of 16 heads x 4 sequences; sized by the cache alone the
    # section was 15 pairs (L2 hit rate 77 %), now 5 (91 %, the rate of one block per tile)
    assert _gpu._sm90_tile_grid(0, 32, 64, kv_bytes(4096, 128))[0] == 5


def test_no_pairs_and_packed_grids():
    assert _gpu._sm90_tile_grid(0, 4, 0, 1024) == (0, (1,))
    assert _gpu._sm90_tile_grid(0, 1, 3, 1024, packed=True) == (3, (SMS,))  # packed: one block per SM
