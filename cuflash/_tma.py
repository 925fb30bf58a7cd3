"""Tensor maps for Hopper's bulk tensor copy engine (TMA), encoded by the CUDA driver.

A tensor map describes a strided array in GPU memory and the box (tile) one copy moves; the
kernels (kernels/sm90_pipeline.cuh) take it as a ``__grid_constant__`` parameter.  It is encoded
on the host by ``cuTensorMapEncodeTiled`` of ``libcuda`` (the driver every CUDA machine has),
called through ctypes: no dependency beyond CuPy.  The rules the driver enforces are checked here
first (:func:`check_tiled`), so that a bad layout is a ``ValueError`` naming the problem rather
than a bare ``CUDA_ERROR_INVALID_VALUE``.

Layout used for attention tiles (:func:`tile_map`): a (batch, seqlen, heads, headdim) array of
16-bit values, dims given innermost first as (headdim, seqlen, heads, batch), box (64, rows, 1, 1)
with the 128-byte swizzle, i.e. one 64-column panel of kernels/swizzled_tile.cuh's layout per copy.
Loads: rows past ``seqlen`` (and columns past ``headdim``) arrive as zeros; stores (the Hopper
forward's O, kernels/sm90_fwd_epilogue.cuh): elements past them are not written.
Sources: CUDA Driver API, "Tensor Map Object Management"; PTX ISA, "Tensor Copy".
"""

from __future__ import annotations

import ctypes
import functools

# CUtensorMapDataType, CUtensorMapSwizzle (cuda.h).
DATA_TYPES = {"float16": 6, "bfloat16": 9, "float32": 7, "float64": 8}
SWIZZLE_BYTES = {0: 0, 32: 1, 64: 2, 128: 3}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class TensorMap(ctypes.Structure):
    """128 opaque bytes, 64-byte aligned (``CUtensorMap``); kernels/sm90_pipeline.cuh's TensorMap."""

    _fields_ = [("words", ctypes.c_uint64 * 16)]


def check_tiled(dtype: str, address: int, dims, strides, box, swizzle: int = 128) -> None:
    """Raise ``ValueError`` unless the driver would accept this tiled map.

    ``dims`` and ``box`` innermost first, ``strides`` in bytes for every dim but the innermost
    (which is contiguous).
    """
    if dtype not in DATA_TYPES:
        raise ValueError(f"tensor maps here take {sorted(DATA_TYPES)}; got {dtype}")
    rank = len(dims)
    if not 1 <= rank <= 5 or len(box) != rank or len(strides) != rank - 1:
        raise ValueError(f"rank 1..5 with a box entry per dim and a stride per outer dim; got dims {dims}, "
                         f"strides {strides}, box {box}")
    if address % 16:
        raise ValueError(f"the array must start at a 16-byte boundary; it starts at {address:#x}")
    if any(not 0 < d <= 1 << 32 for d in dims):
        raise ValueError(f"every dim must lie in [1, 2^32]; got {dims}")
    if any(s % 16 or not 0 <= s < 1 << 40 for s in strides):
        raise ValueError(f"strides must be multiples of 16 bytes below 2^40 (rows of whole 16-byte chunks); "
                         f"got {strides}")
    if any(not 0 < b <= 256 for b in box):
        raise ValueError(f"box entries must lie in [1, 256]; got {box}")
    inner = box[0] * _ITEMSIZE[dtype]
    if inner % 16:
        raise ValueError(f"the box's inner extent must be a multiple of 16 bytes; got {inner}")
    if swizzle not in SWIZZLE_BYTES:
        raise ValueError(f"swizzle must be one of {sorted(SWIZZLE_BYTES)} bytes; got {swizzle}")
    if swizzle and inner > swizzle:
        raise ValueError(f"with the {swizzle}-byte swizzle the box's inner extent is at most {swizzle} bytes; "
                         f"got {inner}")


@functools.lru_cache(maxsize=None)
def _encoder():
    """cuTensorMapEncodeTiled from the driver library."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _aligned_map() -> tuple:
    """A TensorMap at a 64-byte boundary, and the buffer that owns it."""
    raw = ctypes.create_string_buffer(ctypes.sizeof(TensorMap) + 64)
    offset = (-ctypes.addressof(raw)) % 64
    return TensorMap.from_buffer(raw, offset), raw


def encode_tiled(dtype: str, address: int, dims, strides, box, swizzle: int = 128, l2_promotion: int = 2):
    """Encode a tiled tensor map (zeros outside the tensor).  Returns the :class:`TensorMap`;
    keep the returned object alive until the launches that use it are queued (CuPy copies the
    parameter bytes at launch).  ``l2_promotion``: 0 none, 1 64 B, 2 128 B, 3 256 B."""
    check_tiled(dtype, address, dims, strides, box, swizzle)
    rank = len(dims)
    tmap, owner = _aligned_map()
    status = _encoder()(
        ctypes.addressof(tmap), DATA_TYPES[dtype], rank, ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(rank - 1, 1))(*strides, *([0] * (rank == 1))),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        0, SWIZZLE_BYTES[swizzle], l2_promotion, 0)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} (dtype {dtype}, dims {dims}, "
                           f"strides {strides}, box {box})")
    tmap._owner = owner  # the aligned struct lives inside this buffer
    return tmap


def tile_map(x, rows: int):
    """The map of (rows x 64) boxes of a (batch, seqlen, heads, headdim) CuPy array of 16-bit
    values (innermost axis contiguous), for kernels/sm90_pipeline.cuh's ``tma_load_tile``."""
    batch, seqlen, heads, headdim = x.shape
    item = x.dtype.itemsize
    if x.strides[3] != item:
        raise ValueError(f"the head dim must be contiguous for the copy engine; strides are {x.strides}")
    legal = -(-max(seqlen * abs(x.strides[1]), heads * abs(x.strides[2]), 16) // 16) * 16
    row_stride, head_stride, batch_stride = x.strides[1], x.strides[2], x.strides[0]
    if batch == 1:  # any stride will do (e.g. a packed array viewed as one batch entry): a legal one
        batch_stride = legal
    # A size-1 axis is never stepped along either: a stride the driver refuses there (0, negative, or
    # not a 16-byte multiple, as views and broadcasts make them) becomes a legal one
    row_stride = legal if seqlen == 1 and (row_stride <= 0 or row_stride % 16) else row_stride
    head_stride = legal if heads == 1 and (head_stride <= 0 or head_stride % 16) else head_stride
    return encode_tiled(x.dtype.name, x.data.ptr, (headdim, seqlen, heads, batch), (row_stride, head_stride, batch_stride),
                        (64, rows, 1, 1))


@functools.lru_cache(maxsize=None)
def _replacer():
    """cuTensorMapReplaceAddress from the driver library."""
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapReplaceAddress
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class MapsArg:
    """The tensor maps a kernel takes by value after FlashParams (packed by :func:`pack_maps`),
    with the names of the arrays they read or write (``"q"``, ``"k"``, ``"v"``, ``"out"``) and those
    arrays' device addresses, so that a warm call (cuflash._fastpath) can re-point them at new arrays of the same
    layout with :meth:`repointed` instead of encoding them again."""

    def __init__(self, maps, names, arrays):
        self.names = tuple(names)
        self.pointers = tuple(a.data.ptr for a in arrays)
        self.address, self._raw = pack_maps(*maps)
        self._arrays = tuple(arrays)  # the maps point into them

    def detached(self) -> "MapsArg":
        """The same maps without the references to the arrays they read (for a plan that must
        not keep a call's inputs allocated)."""
        new = object.__new__(MapsArg)
        new.names, new.pointers, new.address, new._raw, new._arrays = self.names, self.pointers, self.address, self._raw, ()
        return new

    def repointed(self, pointers: dict) -> "MapsArg":
        """A copy whose map i reads ``pointers[names[i]]`` (same shapes and strides)."""
        new = object.__new__(MapsArg)
        new.names, new.pointers, new._arrays = self.names, tuple(pointers[n] for n in self.names), ()
        size = ctypes.sizeof(TensorMap)
        new._raw = ctypes.create_string_buffer(size * len(self.names) + 64)
        new.address = ctypes.addressof(new._raw) + (-ctypes.addressof(new._raw)) % 64
        ctypes.memmove(new.address, self.address, size * len(self.names))
        for i, ptr in enumerate(new.pointers):
            status = _replacer()(new.address + i * size, ctypes.c_void_p(ptr))
            if status != 0:
                raise RuntimeError(f"cuTensorMapReplaceAddress failed with CUresult {status}")
        return new


def pack_maps(*maps):
    """Tensor maps laid out back to back, 64-byte aligned, as a kernel's struct of maps
    (``FwdMaps`` of kernels/flash_fwd_sm90.cu).  Returns (address, owner): keep ``owner``
    alive until the launch is queued."""
    size = ctypes.sizeof(TensorMap)
    raw = ctypes.create_string_buffer(size * len(maps) + 64)
    base = ctypes.addressof(raw) + (-ctypes.addressof(raw)) % 64
    for i, m in enumerate(maps):
        ctypes.memmove(base + i * size, ctypes.addressof(m), size)
    return base, raw
