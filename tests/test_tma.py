"""Tensor maps for the bulk tensor copy engine (cuflash/_tma.py), and the ring of shared-memory
stages a producer thread fills with them (kernels/sm90_pipeline.cuh, checked through
kernels/tma_copy.cu on a Hopper GPU).  Building blocks of the warp-specialised kernels (issue 21)."""

import ctypes

import ml_dtypes
import numpy as np
import pytest

from cuflash import _arrays, _gpu, _kernels, _tma

from .conftest import HAS_GPU

GOOD = dict(dtype="bfloat16", address=0x10000, dims=(128, 150, 3, 2), strides=(768, 256, 115200), box=(64, 64, 1, 1))


def test_a_valid_attention_tile_map_passes():
    _tma.check_tiled(**GOOD)


@pytest.mark.parametrize(("change", "message"), [
    (dict(dtype="int8"), "tensor maps here take"),
    (dict(address=0x10008), "16-byte boundary"),
    (dict(dims=(128, 0, 3, 2)), r"\[1, 2\^32\]"),
    (dict(strides=(760, 256, 115200)), "multiples of 16 bytes"),
    (dict(strides=(768, 256)), "a stride per outer dim"),
    (dict(box=(64, 257, 1, 1)), r"\[1, 256\]"),
    (dict(box=(4, 64, 1, 1)), "multiple of 16 bytes"),
    (dict(box=(128, 64, 1, 1)), "at most 128 bytes"),
])
def test_what_the_driver_would_refuse_is_a_value_error(change, message):
    with pytest.raises(ValueError, match=message):
        _tma.check_tiled(**{**GOOD, **change})


def test_the_map_struct_is_128_bytes_at_a_64_byte_boundary():
    assert ctypes.sizeof(_tma.TensorMap) == 128
    for _ in range(8):
        tmap, owner = _tma._aligned_map()
        assert ctypes.addressof(tmap) % 64 == 0
        assert ctypes.addressof(owner) <= ctypes.addressof(tmap) <= ctypes.addressof(owner) + 64


def _on_hopper() -> bool:
    return HAS_GPU and _gpu._is_hopper(_arrays.cupy_module().cuda.Device().id)


@pytest.mark.gpu
@pytest.mark.skipif("not _on_hopper()", reason="the bulk tensor copy needs a compute-capability-9.0 GPU")
@pytest.mark.parametrize(("shape", "kd", "view"), [
    ((2, 150, 3, 128), 128, None),       # a partial last tile: rows past seqlen arrive as zeros
    ((1, 1000, 4, 128), 128, "heads"),   # every other head of a larger array (strided heads)
    ((3, 65, 2, 64), 64, None),
    ((2, 129, 2, 40), 64, None),         # head dim 40 in a 64-column box: columns past 40 are zeros
])
@pytest.mark.parametrize("tiles_per_block", [1, 5])  # 5: the 2-stage ring wraps (both phases)
def test_tiles_through_the_ring_equal_the_array(shape, kd, view, tiles_per_block):
    cp = _arrays.cupy_module()
    rng = np.random.default_rng(sum(shape) + kd + tiles_per_block)
    full = rng.standard_normal((shape[0], shape[1], 2 * shape[2] if view else shape[2], shape[3]))
    host = full.astype(ml_dtypes.bfloat16)
    x = cp.asarray(host)
    if view:
        x, host = x[:, :, ::2], host[:, :, ::2]
    batch, seqlen, heads, d = x.shape
    rows = 64
    row_tiles = -(-seqlen // rows)
    total = batch * heads * row_tiles
    out = cp.full((total, rows, kd), np.nan, dtype=x.dtype)
    variant = _kernels.tma_copy_variant(headdim=kd, rows=rows)
    fn = _kernels.get_function(variant, x.device.id)
    tmap = _tma.tile_map(x, rows)
    blocks = -(-total // tiles_per_block)
    fn((blocks,), (256,), (_gpu._cpointer()(ctypes.addressof(tmap)), out, np.int32(tiles_per_block),
                           np.int32(row_tiles), np.int32(heads), np.int64(total)), shared_mem=variant.smem_bytes)
    got = out.get().astype(np.float32)
    want = np.zeros((batch, row_tiles * rows, heads, kd), np.float32)
    want[:, :seqlen, :, :d] = host.astype(np.float32)
    want = want.reshape(batch, row_tiles, rows, heads, kd).transpose(0, 3, 1, 2, 4).reshape(total, rows, kd)
    np.testing.assert_array_equal(got, want)
