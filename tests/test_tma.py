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


@pytest.mark.parametrize(("shape", "strides", "want"), [
    ((2, 150, 3, 128), (115200, 768, 256, 2), (768, 256, 115200)),  # kept as they are
    ((1, 150, 3, 128), (0, 768, 256, 2), (768, 256, 115200)),       # batch 1: a legal batch stride
    ((2, 1, 3, 128), (768, 0, 256, 2), (768, 256, 768)),            # one row, stride 0 (a broadcast row)
    ((2, 150, 1, 128), (38400, 256, -256, 2), (256, 38400, 38400)),  # one head, a negative stride
    ((2, 150, 1, 128), (38400, 256, 8, 2), (256, 38400, 38400)),     # one head, not a 16-byte multiple
])
def test_size_1_axes_get_a_stride_the_driver_takes(monkeypatch, shape, strides, want):
    """A size-1 axis is never stepped along, so a stride the driver would refuse there (0, negative,
    not a 16-byte multiple: views and broadcasts make them) is replaced by a legal one; the
    others are passed as they are (review of session 24)."""
    from types import SimpleNamespace

    seen = {}
    monkeypatch.setattr(_tma, "encode_tiled", lambda dtype, address, dims, strides, box: seen.update(strides=strides))
    x = SimpleNamespace(shape=shape, strides=strides, dtype=np.dtype(ml_dtypes.bfloat16), data=SimpleNamespace(ptr=0x10000))
    _tma.tile_map(x, 64)
    assert seen["strides"] == want
    _tma.check_tiled("bfloat16", 0x10000, (shape[3], shape[1], shape[2], shape[0]), want, (64, 64, 1, 1))


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
