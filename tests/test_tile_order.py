"""The Hopper forward's tile order (cuflash._gpu._sm90_tile_grid, kernels/sm90_scheduler.cuh) on a
stand-in for the H200's resources: no GPU needed.  docs/perf-notes.md h13 has the measurement."""
import itertools

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


# The deterministic Hopper backward's dQ order (flash_bwd_sm90.cu's kDqOrdered) transcribed from
# the kernels' integer arithmetic: SeqInfo's key_range and query_range (kernels/seqinfo.cuh), the
# dK/dV block's query tiles (flash_bwd_dkdv_sm90) and its turn at a tile (turn_at), bwd_block's
# order of the tickets the blocks draw as they start (kernels/sm90_scheduler.cuh), the counters'
# places (dq_order_counter, kernels/sm90_bwd_epilogue.cuh) in the scratch _gpu allocates.  A turn no
# block takes would hang the launch; two tiles sharing a counter would too.

def _key_range(m0, m1, sk, offset, left, right):
    lo = 0 if left < 0 else max(0, m0 + offset - left)
    hi = sk if right < 0 else min(sk, m1 - 1 + offset + right + 1)
    return lo, hi


def _query_tiles(n0, n1, sq, sk, offset, left, right, bm):
    if n0 >= sk:
        return range(0)
    lo = 0 if right < 0 else max(0, n0 - offset - right)
    hi = sq if left < 0 else min(sq, n1 - 1 - offset + left + 1)
    return range(lo // bm, -(-hi // bm)) if lo < hi else range(0)


def _turn(m0, sq, sk, offset, left, right, bm, bn, key_block, launched):
    lo, hi = _key_range(m0, min(m0 + bm, sq), sk, offset, left, right)
    assert hi >= 1  # (C's division truncates, Python's floors: the same for hi - 1 >= 0)
    return min((hi - 1) // bn, launched - 1) - key_block


def _bwd_block(x, grid, pairs, section):
    blocks = grid // pairs
    section = max(1, min(pairs, section))
    first = x // (section * blocks) * section
    size, r = min(section, pairs - first), x - first * blocks
    return blocks - 1 - r // size, first + r % size


@pytest.mark.parametrize("bn", [64, 128])
def test_ordered_dq_turns_are_each_taken_once_in_launch_order(bn):
    """Over lengths around the tile sizes, both causal alignments, windows (one-sided too) and no
    mask: at every query tile the key blocks that reach it (their query_range) hold the turns
    0 .. count - 1, one each; the block with turn r + 1 starts after the one with turn r (bwd_block:
    it waits only for blocks already started: a smaller ticket); every (pair, key block) is
    launched once.  Also with
    fewer key blocks launched than the keys need (a packed key sequence longer than max_seqlen_k:
    an error the kernels report, which must not leave a turn to a block never launched)."""
    bm = 64
    masks = [(-1, -1), (-1, 0), (0, 0), (3, 5), (70, 0), (0, 130), (200, -1), (-1, 17)]
    for sq in (1, 7, 63, 64, 65, 129, 200, 333):
        for sk in (1, 63, 64, 65, 128, 129, 300, 700):
            for top_left in (False, True):
                offset = 0 if top_left else sk - sq
                for (left, right), launched in itertools.product(masks, {-(-sk // bn), max(1, sk // bn // 2)}):
                    turns = {}
                    for n in range(launched):
                        for m in _query_tiles(n * bn, n * bn + bn, sq, sk, offset, left, right, bm):
                            turns.setdefault(m, []).append(_turn(m * bm, sq, sk, offset, left, right, bm, bn, n, launched))
                            assert m * bm < sq
                    for m, ts in turns.items():
                        assert sorted(ts) == list(range(len(ts))), (sq, sk, top_left, left, right, launched, m, ts)
    for pairs, blocks, section in ((1, 5, 17), (40, 3, 17), (40, 32, 17), (7, 4, 3), (3, 1, 1)):
        seen = [_bwd_block(x, pairs * blocks, pairs, section) for x in range(pairs * blocks)]
        assert sorted(seen) == [(n, pr) for n in range(blocks) for pr in range(pairs)]
        for pr in range(pairs):  # a pair's key blocks start from the last (turn 0 at every tile)
            order = [n for n, q in seen if q == pr]
            assert order == list(range(blocks - 1, -1, -1))


def _dq_order_counter(b, h, m0, slot, *, nheads_q, seqlen_q, cu_seqlens_q=None, total_q=0):
    """dq_order_counter(p, seq, b, h, m0, slot) on dq_tile_offset's rows (index 0: the ticket)."""
    if cu_seqlens_q is not None:
        row = h * (total_q + 64 * (len(cu_seqlens_q) - 1)) + cu_seqlens_q[b] + 64 * b + m0
    else:
        row = (b * nheads_q + h) * (-(-seqlen_q // 64) * 64) + m0
    return 1 + row // 64 * 2 + slot


def _dq_order_size(*, batch, nheads_q, seqlen_q, cu_seqlens_q=None, total_q=0):
    """The int32s _gpu._launch_attention_bwd zeroes for an ordered launch."""
    rows = nheads_q * (total_q + 64 * batch) if cu_seqlens_q is not None else batch * nheads_q * -(-seqlen_q // 64) * 64
    return 1 + 2 * (rows // 64 + 1)


def test_ordered_dq_counters_are_one_per_tile_and_slot_inside_the_scratch():
    """Every (sequence, query head, 64-row tile, slot) of padded and packed layouts (sequences of 0, 1,
    63, 64, 65 and random lengths, trailing rows no sequence owns) has a counter of its own, past
    the ticket at index 0 and inside the scratch the host zeroes.  Packed tiles are not 64-row
    aligned: row / 64 stays unique because each sequence's tiles start 64 rows past the previous
    sequence's end (dq_tile_offset's 64 b)."""
    import random

    rng = random.Random(2)
    for _ in range(3000):
        batch, heads = rng.randint(1, 5), rng.randint(1, 4)
        if rng.random() < 0.5:
            lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 300)]) for _ in range(batch)]
            cu = list(itertools.accumulate(lens, initial=0))
            layout = dict(nheads_q=heads, seqlen_q=max(lens), cu_seqlens_q=cu, total_q=cu[-1] + rng.randint(0, 70))
        else:
            lens = [rng.randint(1, 300)] * batch
            layout = dict(nheads_q=heads, seqlen_q=lens[0])
        size, seen = _dq_order_size(batch=batch, **layout), set()
        for b, h in itertools.product(range(batch), range(heads)):
            for m0, slot in itertools.product(range(0, lens[b], 64), (0, 1)):
                c = _dq_order_counter(b, h, m0, slot, **layout)
                assert 1 <= c < size and c not in seen, (lens, layout, b, h, m0, slot)
                seen.add(c)
