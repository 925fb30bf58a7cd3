"""The split-KV decode's automatic split count (cuflash._gpu._auto_splits), on a stand-in for
the H200's resources: no GPU needed.  docs/perf-notes.md, d3, has the measurements behind it."""
import pytest

from cuflash import _gpu, _kernels

SMS, SMEM_PER_SM = 132, 233472  # H200: 132 SMs, 228 KB of shared memory per SM


@pytest.fixture
def variant(monkeypatch):
    monkeypatch.setattr(_gpu, "_sm_resources", lambda device: (SMS, SMEM_PER_SM))
    v = _kernels.fwd_variant("bfloat16", 128, softcap=False, alibi=False, splitkv=True)
    assert SMEM_PER_SM // (v.smem_bytes + 1024 + _gpu.RESERVED_SMEM_PER_BLOCK) == 5  # resident blocks at d128
    return v


@pytest.mark.parametrize("paged, per_sm", [(False, _gpu.CONTIGUOUS_DECODE_BLOCKS_PER_SM), (True, 5)])
def test_one_wave_of_the_chosen_depth(variant, paged, per_sm):
    # GQA 32/8, batch 1: 8 row blocks; a 128k-token cache has 2048 key tiles of 64.
    splits = _gpu._auto_splits(8, 2048, variant, 0, paged=paged)
    assert splits == min(SMS * per_sm // 8, _gpu.MAX_SPLITS)
    assert splits * 8 <= SMS * per_sm  # never a second wave


def test_contiguous_caches_use_fewer_splits_than_paged(variant):
    for blocks in (1, 8, 32, 64, 256):
        contiguous = _gpu._auto_splits(blocks, 4096, variant, 0, paged=False)
        paged = _gpu._auto_splits(blocks, 4096, variant, 0, paged=True)
        assert 1 <= contiguous <= paged


@pytest.mark.parametrize("paged", [False, True])
def test_every_split_keeps_two_key_tiles_and_the_combine_limit(variant, paged):
    assert _gpu._auto_splits(1, 10, variant, 0, paged=paged) == 5
    assert _gpu._auto_splits(1, 1, variant, 0, paged=paged) == 1
    assert _gpu._auto_splits(1, 10**6, variant, 0, paged=paged) == _gpu.MAX_SPLITS


@pytest.mark.parametrize("paged", [False, True])
def test_a_full_grid_is_not_split(variant, paged):
    assert _gpu._auto_splits(SMS * 5, 4096, variant, 0, paged=paged) == 1


def test_registers_bound_the_resident_blocks(variant):
    paged = _kernels.fwd_variant("bfloat16", 128, softcap=False, alibi=False, splitkv=True, paged=True)
    assert paged.threads == 128 and paged.smem_bytes == variant.smem_bytes  # 4 warps, the same tiles
    # 187 registers x 128 threads: two blocks of 24,576 fit in the 65,536 registers of an SM.
    assert _gpu._auto_splits(8, 2048, paged, 0, paged=True, regs=187) == SMS * 2 // 8
    # 128 (the kernel's bound for four blocks): four; 64: shared memory's five.
    assert _gpu._auto_splits(8, 2048, paged, 0, paged=True, regs=128) == SMS * 4 // 8
    assert _gpu._auto_splits(8, 2048, paged, 0, paged=True, regs=64) == min(SMS * 5 // 8, _gpu.MAX_SPLITS)


def test_static_shared_memory_bounds_the_resident_blocks(monkeypatch):
    # The paged head-dim-64 form keeps 2.25 KB in static shared memory (page slots of 128-key
    # tiles, the warps' row maxima): on an A100 (164 KB per SM) three blocks of 38.25 + 2.25 + 1
    # (reserved) KB fit, not the four that 1 KB of static memory would give.
    monkeypatch.setattr(_gpu, "_sm_resources", lambda device: (108, 167936))
    v = _kernels.fwd_variant("bfloat16", 64, softcap=False, alibi=False, splitkv=True, paged=True)
    assert v.smem_bytes == 39168
    assert _gpu._auto_splits(8, 4096, v, 0, paged=True, static_smem=2304) == 108 * 3 // 8
    assert _gpu._auto_splits(8, 4096, v, 0, paged=True, static_smem=1024) == 108 * 4 // 8
