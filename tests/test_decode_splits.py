"""The split-KV decode's automatic split count (cuflash._gpu._auto_splits), on a stand-in for
the H200's resources: no GPU needed.  docs/perf-notes.md, d3 and d7, has the measurements behind it."""
import pytest

from cuflash import _gpu, _kernels

SMS, SMEM_PER_SM = 132, 233472  # H200: 132 SMs, 228 KB of shared memory per SM


@pytest.fixture
def variant(monkeypatch):
    monkeypatch.setattr(_gpu, "_sm_resources", lambda device: (SMS, SMEM_PER_SM))
    v = _kernels.fwd_variant("bfloat16", 128, softcap=False, alibi=False, splitkv=True)
    assert SMEM_PER_SM // (v.smem_bytes + 1024 + _gpu.RESERVED_SMEM_PER_BLOCK) == 5  # resident blocks at d128
    return v


def test_one_wave_of_every_resident_block(variant):
    # GQA 32/8, batch 1: 8 row blocks; a 128k-token cache has 2048 key tiles of 64.
    splits = _gpu._auto_splits(8, 2048, variant, 0)
    assert splits == min(SMS * 5 // 8, _gpu.MAX_SPLITS)
    assert splits * 8 <= SMS * 5  # never a second wave


def test_every_split_keeps_two_key_tiles_and_the_combine_limit(variant):
    assert _gpu._auto_splits(1, 10, variant, 0) == 5
    assert _gpu._auto_splits(1, 1, variant, 0) == 1
    assert _gpu._auto_splits(1, 10**6, variant, 0) == _gpu.MAX_SPLITS


def test_no_split_is_left_without_key_tiles(variant):
    # GQA 32/8, batch 1, 64k tokens: a wave would be 82 splits of 1024 key tiles, 13 tiles each
    # (the kernel rounds up), so the last 3 would be empty; 79 get 13 tiles but the last.
    assert _gpu._auto_splits(8, 1024, variant, 0) == 79
    for blocks in (1, 3, 8, 32, 64, 100):
        for key_blocks in (2, 3, 10, 63, 65, 257, 1024, 4096):
            splits = _gpu._auto_splits(blocks, key_blocks, variant, 0)
            per_split = -(-key_blocks // splits)
            assert (splits - 1) * per_split < key_blocks  # the last split has a tile


def test_a_full_grid_is_not_split(variant):
    assert _gpu._auto_splits(SMS * 5, 4096, variant, 0) == 1


def test_registers_bound_the_resident_blocks(variant):
    assert variant.threads == 128  # 4 warps splitting each tile's keys
    # (10**5 key tiles: so many that no split count below is lowered to avoid empty splits)
    # 187 registers x 128 threads: two blocks of 24,576 fit in the 65,536 registers of an SM.
    assert _gpu._auto_splits(8, 10**5, variant, 0, regs=187) == SMS * 2 // 8
    # 128 (the kernel's bound for four blocks): four; 64: shared memory's five.
    assert _gpu._auto_splits(8, 10**5, variant, 0, regs=128) == SMS * 4 // 8
    assert _gpu._auto_splits(8, 10**5, variant, 0, regs=64) == min(SMS * 5 // 8, _gpu.MAX_SPLITS)


def test_static_shared_memory_bounds_the_resident_blocks(monkeypatch):
    # The head-dim-64 form keeps 2.25 KB in static shared memory (page slots of 128-key tiles,
    # the warps' row maxima): on the H200 (228 KB per SM) four blocks of 42.5 + 2.25 + 1
    # (reserved) KB fit, not the five that 1 KB of static memory would give.
    monkeypatch.setattr(_gpu, "_sm_resources", lambda device: (SMS, SMEM_PER_SM))
    v = _kernels.fwd_variant("bfloat16", 64, softcap=False, alibi=False, splitkv=True)
    assert v.smem_bytes == 43520
    assert _gpu._auto_splits(8, 4096, v, 0, static_smem=2304) == SMS * 4 // 8
    assert _gpu._auto_splits(8, 4096, v, 0, static_smem=1024) == SMS * 5 // 8


def test_merge_bytes_bound_the_splits_down_to_half_a_wave(variant):
    # The last block of a row group reads every split's partial result.  GQA 32/8, batch 1, 64k
    # tokens, d128: 4 rows x 2 KB per split; 64 KB allow 32 splits, half a wave allows 82 // 2 = 41.
    assert _gpu._auto_splits(8, 1024, variant, 0) == 79
    four_rows = 4 * 128 * 4
    assert _gpu._auto_splits(8, 1024, variant, 0, partial_bytes=four_rows) == 41
    # MHA 32 heads, batch 1: one row of 512 B per split, far under the bound: every resident block.
    assert _gpu._auto_splits(32, 256, variant, 0, partial_bytes=512) == SMS * 5 // 32
    # 16 rows per group: the bound would leave 8 splits, fewer than half a wave (41).
    assert _gpu._auto_splits(8, 1024, variant, 0, partial_bytes=16 * 512) == 41
    assert _gpu._auto_splits(8, 1024, variant, 0, partial_bytes=1 << 20) == 41
