"""GPU path: prepare CuPy arrays, fill FlashParams, launch the kernels on CuPy's current stream.

Called by ``cuflash.api`` after validation, with (batch, seqlen, heads, dim) views.  Inputs are
used in place when their last axis is contiguous and every other stride keeps 16-byte alignment
(slices of packed QKV, transposed layouts and broadcast heads all qualify); otherwise one
contiguous copy is made.  Head dims that are not multiples of 8 are zero-padded in a copy.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from . import _guard, _kernels
from ._arrays import cupy_module, is_gpu
from ._guard import NotAvailableOnGPU  # (defined there, so that cuflash exports it without importing this module)
from ._params import FlashParams

_GRID_YZ_MAX = 65535
DECODE_MAX_ROWS = 16  # query rows up to which the split-KV decode variant runs (its block height)
MAX_SPLITS = 128  # the split kernel's merge reads at most this many partial results per row
COMBINE_BYTES = 64 << 10  # partial results one merging block reads in two rounds of its loads (d8)
REGISTERS_PER_SM = 65536  # 32-bit registers of one SM on every GPU since sm_50
RESERVED_SMEM_PER_BLOCK = 1024  # bytes of shared memory CUDA keeps per resident block (sm_80 and later)
_ALIGN = 16  # bytes: cp.async moves 16-byte chunks


def _cp():
    return cupy_module()


@functools.lru_cache(maxsize=None)
def _smem_limit(device_id: int) -> int:
    """Opt-in shared memory per block of one device (read once: the attribute dict is slow)."""
    return _cp().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]


# The float32/float64 forms of flash_fwd.cu and flash_bwd.cu (issue 24: TF32 and FP64 tensor cores)
# and what they cover so far (_wide_limit, _wide_missing).
_WIDE_DTYPES = tuple(_kernels.WIDE_ITEMSIZE)


def _wide_limit(name: str, backward: bool, smem_limit: int = _kernels.DEFAULT_SMEM_LIMIT) -> int:
    """The largest head dim of the float32/float64 forward or backward kernels on a GPU with
    ``smem_limit`` bytes of shared memory a block (float64 gradients stop at d192 on 99 KB GPUs)."""
    if backward:
        return _kernels.wide_bwd_max_headdim(name, smem_limit)
    return _kernels.F64_FWD_MAX_HEADDIM if name == "float64" else _kernels.HEADDIM_BUCKETS[-1]


def _device_smem_limit(q) -> int:
    """The shared memory a block of q's GPU may take (the H200's for arrays not on a GPU)."""
    return _smem_limit(q.device.id) if is_gpu(q) else _kernels.DEFAULT_SMEM_LIMIT


def _wide_covers(name: str, smem_limit: int = _kernels.DEFAULT_SMEM_LIMIT) -> str:
    grads = f" and its gradients (attention_backward, attention_vjp) up to head dim {_wide_limit(name, True, smem_limit)}"
    return ("the forward of padded and packed batches and KV caches (attention, attention_varlen, "
            "attention_with_kvcache) with causal, window_size, softcap, alibi_slopes, seqlens_k and GQA, bias, "
            "mask and dropout where those calls take them, "
            f"head dims up to {_wide_limit(name, False, smem_limit)}{grads}")


def _check_gpu_dtype(q, wide_missing: str | None):
    """q's dtype name where a GPU kernel takes it: float16 and bfloat16, and float32 and float64
    when ``wide_missing`` is None.  Otherwise NotAvailableOnGPU; for those dtypes
    it names ``wide_missing``, what the call needs that their kernel does not have yet."""
    name = np.dtype(q.dtype).name
    wide = name in _WIDE_DTYPES
    if wide and wide_missing is None:
        return name
    if wide:
        raise NotAvailableOnGPU(
            f"q has dtype {name}: the GPU's {name} attention has no {wide_missing} yet (it covers "
            f"{_wide_covers(name, _device_smem_limit(q))}); cast to float16/bfloat16 with .astype, or use NumPy arrays for the CPU path"
        )
    if name not in ("float16", "bfloat16"):
        raise NotAvailableOnGPU(
            f"q has dtype {name}; GPU kernels take float16, bfloat16, float32 or float64 (cast with .astype)"
        )
    return name


def check_call(p, q, *, packed=False, kvcache=False, backward=False, headdim=0) -> str:
    """The dtype name of the forward (``backward``: backward) kernels for this call, or
    NotAvailableOnGPU (before the caller writes anything, even for calls with nothing to compute)
    when its dtype has none for it.  ``p`` None checks the dtype and ``headdim`` alone
    (attention_vjp's first step, before its forward runs)."""
    name = np.dtype(q.dtype).name
    if name not in _WIDE_DTYPES:
        return _check_gpu_dtype(q, None)
    if p is None:
        limit = _wide_limit(name, backward, _device_smem_limit(q))
        return _check_gpu_dtype(q, f"head dims past {limit}" if headdim > limit else None)
    return _check_gpu_dtype(q, _wide_missing(p, name, max(p.headdim_qk, p.headdim_v), packed=packed,
                                             kvcache=kvcache, backward=backward, smem_limit=_device_smem_limit(q)))


def _wide_missing(p, name, headdim, *, packed, kvcache, backward=False, smem_limit=_kernels.DEFAULT_SMEM_LIMIT) -> str | None:
    """The first option of a call that the float32/float64 kernels lack, or None."""
    limit = _wide_limit(name, backward, smem_limit)
    missing = [(f"head dims past {limit}", headdim > limit)]
    return next((what for what, needed in missing if needed), None)


def _same_device(arrays):
    ids = {a.device.id for a in arrays if a is not None}
    if len(ids) > 1:
        raise ValueError(f"all GPU arrays must live on one device; got devices {sorted(ids)}")
    return ids.pop()


def _aligned(x) -> bool:
    item = x.itemsize
    return (
        x.strides[-1] == item
        and all(s % _ALIGN == 0 for s in x.strides[:-1])
        and x.data.ptr % _ALIGN == 0
    )


def _prepare(x, dim8: int):
    """A kernel-readable version of x whose last axis has length dim8 (a multiple of 8)."""
    cp = _cp()
    if x.shape[-1] != dim8:
        padded = cp.zeros(x.shape[:-1] + (dim8,), dtype=x.dtype)
        padded[..., : x.shape[-1]] = x
        return padded
    return x if _aligned(x) else cp.ascontiguousarray(x)


def _strides(x, packed: bool):
    """(batch, row, head) strides in elements; packed arrays have no batch axis."""
    e = [s // x.itemsize for s in x.strides]
    return (0, e[0], e[1]) if packed else (e[0], e[1], e[2])


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


# Bits of FlashParams.index_64bit (kernels/metadata.cuh, kIndex*).
_INDEX_BITS = dict(cu_seqlens_q=1, cu_seqlens_k=2, seqlens_k=4, block_table=8, cache_batch_idx=16)


def _index_arrays(indices):
    """Pointers and the index_64bit mask of int32/int64 index arrays (None where absent), as the
    kernels read them: in place when contiguous, else a contiguous copy of the same dtype.  Values
    are never converted (an int64 past 2^31 must not wrap into a valid int32); the kernels check
    them (kernels/metadata.cuh)."""
    cp = _cp()
    arrays, bits = {}, 0
    for name, x in indices.items():
        if x is not None:
            x = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
            bits |= _INDEX_BITS[name] * (x.dtype.itemsize == 8)
        arrays[name] = x
    return arrays, bits


def _report_to(prm, device, call, **extents):
    """Point the kernels' metadata checks at the device's error word (cuflash/_guard.py), with
    the description of this launch."""
    prm.error_word = _guard.error_word(device)
    prm.error_call = _guard.call_code(call, **extents)


def _fill_params(p, pointers, strided, *, packed, lse_strides, d8, dv8, scale, indices=None):
    """The FlashParams every kernel reads: ``pointers`` maps fields to arrays (or None),
    ``strided`` maps stride prefixes ("q", "k", ...) to the arrays whose strides they take,
    ``indices`` maps index-array fields to int32/int64 arrays (or None)."""
    prm = FlashParams()
    if indices:
        arrays, prm.index_64bit = _index_arrays(indices)
        pointers = {**pointers, **arrays}
        prm.keep_alive = arrays  # contiguous copies of strided index arrays live as long as prm (its launches)
    for field, x in pointers.items():
        setattr(prm, field, None if x is None else x.data.ptr)
    for prefix, x in strided.items():
        bs, rs, hs = _strides(x, packed)
        setattr(prm, f"{prefix}_batch_stride", bs)
        setattr(prm, f"{prefix}_row_stride", rs)
        setattr(prm, f"{prefix}_head_stride", hs)
    prm.lse_batch_stride, prm.lse_head_stride = lse_strides
    prm.batch, prm.nheads_q, prm.nheads_k = p.batch, p.nheads_q, p.nheads_k
    prm.seqlen_q, prm.seqlen_k = p.seqlen_q, p.seqlen_k
    prm.headdim_qk, prm.headdim_v = d8, dv8
    prm.elem_bytes = next(iter(strided.values())).itemsize  # (varlen_tail.cuh's rows: 2, 4 or 8 bytes)
    # A window bound of max(seqlen_q, seqlen_k) or more hides no key of any sequence (every one is
    # at most that long): passed as -1, unbounded, since the kernels keep the bounds in 32-bit ints
    # (a bound of 2**32 became 0, a window of one key, and i + offset + bound could overflow).
    reach = max(p.seqlen_q, p.seqlen_k)
    prm.window_left, prm.window_right = (w if w < reach else -1 for w in (p.window_left, p.window_right))
    prm.top_left = int(p.top_left)
    prm.softmax_scale, prm.softcap = scale, p.softcap
    prm.num_splits = prm.pack_gqa = 1
    return prm


def _positive_scale(p, q):
    """(q, scale, q_sign) with scale > 0: the kernels fold a positive scale into exp2, and
    (-q)·k·|scale| and 0·k·1 are the same scores exactly; dq is mapped back with q_sign."""
    scale = p.softmax_scale
    if scale > 0:
        return q, scale, 1.0
    if scale < 0:
        return -q, -scale, -1.0
    return _cp().zeros_like(q), 1.0, 0.0


def _grid_yz(bh: int):
    grid_y = min(bh, _GRID_YZ_MAX)
    return grid_y, (bh + grid_y - 1) // grid_y


def _launch_attention_fwd(p, q, k, v, out, lse, *, packed, cu_q=None, cu_k=None, lse_strides, call,
                          block_table=None, cache_batch_idx=None, seq_bad=None, seqlen_new=0, num_splits=0,
                          record=None, tail_only=False):
    """``tail_only`` (packed): launch only varlen_tail.cu, which checks the offsets against the
    rows and max_seqlen_* and NaN-fills the rows of bad sequences (the caller wrote 0 and -inf)."""
    cp = _cp()
    kvcache = block_table is not None or cache_batch_idx is not None or seq_bad is not None
    dtype = check_call(p, q, packed=packed, kvcache=kvcache)
    wide = dtype in _WIDE_DTYPES
    device = _same_device([q, k, v, out, lse, p.alibi_slopes, p.seqlens_k, cu_q, cu_k, block_table, cache_batch_idx,
                           seq_bad, p.bias, p.mask, p.dropout_seed_array])
    with cp.cuda.Device(device):
        d8, dv8 = _round8(p.headdim_qk), _round8(p.headdim_v)
        q, scale, _ = _positive_scale(p, q)
        qx, kx, vx = _prepare(q, d8), _prepare(k, d8), _prepare(v, dv8)
        direct = out.shape[-1] == dv8 and _aligned(out) and min(out.strides) >= 0  # (the map of O takes no negative stride)
        ox = out if direct else (cp.zeros if tail_only else cp.empty)(out.shape[:-1] + (dv8,), dtype=out.dtype)
        # (float32/float64: no split-KV form yet, every row count and paged caches run the one-pass kernel)
        decode = not packed and not wide and (block_table is not None or p.seqlen_q <= DECODE_MAX_ROWS)
        features = dict(softcap=p.softcap > 0, alibi=p.alibi_slopes is not None, mods=_mods_level(p))
        # (raw scores without a bias: a form of the Hopper forward only, _kernels._raw_applies)
        long_rows = p.seqlen_q >= _kernels.SM90_FWD_LONG_ROWS
        variant = (_hopper_variant(device, dtype, max(d8, dv8), dict(features, raw=p.bias is None, long_rows=long_rows))
                   if not decode and not wide else None)
        if variant is None:
            variant = _kernels.fwd_variant(dtype, max(d8, dv8), **features, splitkv=decode, smem_limit=_smem_limit(device),
                                           tf32=p.precision == "tf32")
        pointers = dict(q=qx, k=kx, v=vx, out=ox, lse=lse, alibi_slopes=p.alibi_slopes, seq_bad=seq_bad)
        indices = dict(seqlens_k=p.seqlens_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=block_table,
                       cache_batch_idx=cache_batch_idx)
        prm = _fill_params(p, pointers, dict(q=qx, k=kx, v=vx, o=ox), packed=packed, lse_strides=lse_strides,
                           d8=d8, dv8=dv8, scale=scale, indices=indices)
        _set_extents(prm, p, q, k, packed, block_table, cache_batch_idx)
        keep_mods = _set_mods(prm, p, dtype)  # noqa: F841 (a float32 copy of a float64 bias lives until the launch)
        if any(x is not None for x in indices.values()):
            _report_to(prm, device, call, **_extents(prm, seqlen_new))
        # Varlen: the offsets are checked and the rows no sequence owns written by a kernel launched
        # first, or by the Hopper forward's own blocks (kernels/varlen_tail.cuh)
        tail_kernel = packed and (tail_only or variant.filename != "flash_fwd_sm90.cu")
        # (the Hopper forward's bias/mask-only variants leave that check out: packed calls take neither)
        assert not (packed and (p.bias is not None or p.mask is not None)), "varlen calls take no bias or mask"
        if tail_kernel and not tail_only:  # the tail kernel's module compiles beside the forward's
            _kernels.prefetch([(_kernels.varlen_tail_variant(), ""), (variant, "")], device)
        fn = _kernels.get_function(variant, device) if not tail_only else None
        if tail_only:
            launches, accum = [], None
        elif decode:
            launches, accum = _decode_launches(p, prm, variant, fn, device, num_splits)
        else:
            block_m = dict(variant.defines)["CUFLASH_BLOCK_M"]
            m_blocks = (p.seqlen_q + block_m - 1) // block_m
            if variant.filename == "flash_fwd_sm90.cu":  # tiles in the scheduler's order, + the tensor maps of Q, K, V
                kv_bytes = p.seqlen_k * (d8 + dv8) * 2 // (p.nheads_q // p.nheads_k)  # per pair: a GQA group shares K/V
                prm.tile_heads, grid = _sm90_tile_grid(device, m_blocks, p.batch * p.nheads_q, kv_bytes, packed)
                maps = _fwd_maps(qx, kx, vx, ox, packed, block_m, dict(variant.defines)["CUFLASH_BLOCK_N"])
                # A persistent grid takes its tiles from a counter (the split kernel's, kept per stream)
                accum = (0, 0, 1) if grid[0] < m_blocks * p.batch * p.nheads_q else None
                launches = [(fn, grid, (variant.threads,), variant.smem_bytes, maps)]
            else:
                grid = (m_blocks, *_grid_yz(p.batch * p.nheads_q))
                launches, accum = [(fn, grid, (variant.threads,), variant.smem_bytes)], None
        if not tail_only:
            defines = dict(variant.defines)
            map_launch, mask_map = _mask_tile_map(prm, p, defines["CUFLASH_BLOCK_M"], defines["CUFLASH_BLOCK_N"],  # noqa: F841
                                                  device)
            if map_launch:  # (mask_map: alive until the launches are queued)
                launches.insert(0, map_launch)
        if tail_kernel:  # rows past cu_seqlens_q[-1] belong to no block of the forward kernel
            tail = _kernels.get_function(_kernels.varlen_tail_variant(), device)
            launches.insert(0, (tail, (2 * _sm_resources(device)[0],), (256,), 0))
        execute(prm, launches, accum)
        if not direct:
            out[...] = ox[..., : out.shape[-1]]
        if record is not None:
            record.append(dict(device=device, template=bytes(prm), launches=launches, accum=accum))


_BIAS_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}  # (ScoreMods' bias_dtype; 3 float64, read by the float64 kernels)


def _bias_dtypes(dtype: str) -> dict:
    """The bias dtypes the kernels for inputs of ``dtype`` read in place (others: a float32 copy)."""
    return dict(_BIAS_DTYPES, float64=3) if dtype == "float64" else _BIAS_DTYPES


def _mods_level(p) -> int:
    """The kernels' CUFLASH_MODS for ``p`` (_kernels._MODS_SUFFIX): 0 none, 1 bias and/or mask, 2 dropout too."""
    return 2 if p.dropout is not None else int(p.bias is not None or p.mask is not None)


def _set_mods(prm, p, dtype):
    """The additive bias and boolean mask (softmax_tile.cuh, ScoreMods): pointers and strides in
    elements over (batch, head, query, key), 0 on broadcast axes, read in place (a float64 bias is
    read as a float32 copy of its own size where the kernels form scores in float32, as itself by
    the float64 kernels of ``dtype`` float64).  Returns the arrays that must live until the launch is queued."""
    full = (p.batch, p.nheads_q, p.seqlen_q, p.seqlen_k)
    bias_dtypes = _bias_dtypes(dtype)
    keep = []
    for name, x in (("bias", p.bias), ("mask", p.mask)):
        if x is None:
            continue
        x = x[(None,) * (4 - x.ndim)] if x.ndim < 4 else x
        if name == "bias" and x.dtype.name not in bias_dtypes:  # float64: cast only the distinct entries
            x = x[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in x.strides)].astype(np.float32)
        if x.data.ptr % x.itemsize or any(stride % x.itemsize for stride in x.strides):  # (a view of other bytes)
            x = _cp().ascontiguousarray(x)
        x = _cp().broadcast_to(x, full)  # a view: broadcast axes get stride 0
        keep.append(x)
        setattr(prm, name, x.data.ptr)
        for axis, stride in zip(("batch", "head", "row", "col"), x.strides):
            setattr(prm, f"{name}_{axis}_stride", stride // x.itemsize)
        if name == "bias":
            prm.bias_dtype = bias_dtypes[x.dtype.name]
    if p.dropout is not None:  # (rate, seed, offset, first batch entry): cuflash/dropout.py's numbering
        from .dropout import keep_threshold

        rate, seed, offset, first = p.dropout
        prm.dropout_seed, prm.dropout_offset = (v - 2**64 if v >= 2**63 else v for v in (seed, offset))  # the same 64 bits
        prm.dropout_threshold, prm.dropout_first_batch = keep_threshold(rate), first
        prm.dropout_scale = 1.0 / (1.0 - rate)
        if p.dropout_seed_array is not None:  # read by the kernels (ScoreMods::dropout_key)
            keep.append(p.dropout_seed_array)
            prm.dropout_seed_ptr = p.dropout_seed_array.data.ptr
    return keep


def _set_extents(prm, p, q, k, packed, block_table=None, cache_batch_idx=None):
    """The extents the kernels bound metadata-derived indices by: packed rows of q and k, and
    the rows (or pages) of a cache indexed through ``cache_batch_idx`` (or ``block_table``)."""
    if packed:
        prm.total_q, prm.total_k = q.shape[0], k.shape[0]
    if block_table is not None or cache_batch_idx is not None:
        prm.kv_rows = k.shape[0]
    if block_table is not None:  # k/v are (num_pages, page_size, Hk, D): the batch stride is the page stride
        prm.block_table_batch_stride, prm.page_size = block_table.shape[1], k.shape[1]


def _extents(prm, seqlen_new=0):
    """What an error message needs to say what the values were checked against (_guard.describe)."""
    return dict(total_q=prm.total_q, total_k=prm.total_k, seqlen_k=prm.seqlen_k, seqlen_new=seqlen_new,
                kv_rows=prm.kv_rows, table_stride=prm.block_table_batch_stride, max_seqlen_q=prm.seqlen_q,
                max_seqlen_k=prm.seqlen_k)


def _hopper_variant(device: int, dtype: str, headdim: int, features: dict, family=_kernels.sm90_fwd_variant):
    """The wgmma kernel of ``family`` (forward or backward) where it applies: a
    compute-capability-9.0 GPU, an NVRTC that builds sm_90a, a head-dim bucket it covers, and
    CUFLASH_DISABLE_SM90 unset (a switch for comparing with the sm_80 kernels).  None otherwise."""
    if not _is_hopper(device) or _kernels.sm90_disabled():
        return None
    if family is _kernels.sm90_fwd_variant:
        return family(dtype, headdim, **features, overlap=_kernels.sm90_overlap())
    return family(dtype, headdim, **features, ordered=_kernels.sm90_ordered_dq())


def _mask_tile_map(prm, p, block_m: int, block_n: int, device: int):
    """The mask's tile map for an attention kernel of block_m x block_n tiles
    (kernels/mask_tiles.cu), its fields set in ``prm``: (its launch, to run before the kernel's;
    the arrays it writes, alive until both are queued), or (None, None) without a mask (or with
    more tiles than a grid's extents hold: no map, every tile then reads the mask)."""
    if not prm.mask or p.seqlen_q == 0 or p.seqlen_k == 0:
        return None, None
    cp = _cp()
    heads = p.nheads_q if prm.mask_head_stride else 1
    planes = (p.batch if prm.mask_batch_stride else 1) * heads
    rows = -(-p.seqlen_q // block_m) if prm.mask_row_stride else 1
    cols = -(-p.seqlen_k // block_n)
    if rows > _GRID_YZ_MAX or cols * planes >= 2**31:  # (grid extents; without a map the kernels read every tile's mask)
        return None, None
    states = cp.empty(planes * rows * cols, dtype=cp.uint8)
    ranges = cp.zeros(2 * planes * (rows + cols), dtype=cp.int32)  # (count - first, last + 1); 0 0: none
    prm.mask_tiles, prm.mask_tile_row_ranges = states.data.ptr, ranges.data.ptr
    prm.mask_tile_col_ranges = ranges.data.ptr + 8 * planes * rows
    prm.mask_tile_m, prm.mask_tile_n, prm.mask_tiles_rows, prm.mask_tiles_cols, prm.mask_tiles_heads = (
        block_m, block_n, rows, cols, heads)
    fn = _kernels.get_function(_kernels.mask_tiles_variant(), device)
    return (fn, (cols * planes, rows), (128,), 0), (states, ranges)


@functools.lru_cache(maxsize=None)
def _is_hopper(device_id: int) -> bool:
    cp = _cp()
    return _kernels.sm90_applies(cp.cuda.Device(device_id).compute_capability, cp.cuda.nvrtc.getVersion())


def _offsets_scratch(prm):
    """Varlen: the two int64 words where the offsets check (kernels/varlen_tail.cuh: the tail kernel,
    or each block of the Hopper forward) publishes the first bad entry of each cu_seqlens for the
    attention kernels' SeqInfo (allocated per call: calls on two streams must
    not share them; CuPy's pool hands the memory to later work on this stream only)."""
    words = _cp().empty(2, dtype=np.int64)
    prm.offsets_first_bad = words.data.ptr
    return words


def _sm90_tile_grid(device: int, m_blocks: int, pairs: int, kv_bytes_per_pair: int, packed: bool = False):
    """The Hopper forward's tile order and grid (kernels/sm90_scheduler.cuh): (batch, head) pairs
    per section, as few as give every SM a tile (and no more than half the L2 cache holds the K
    and V of), and the grid: one block per SM, each taking the next tile from a counter
    (CUFLASH_SM90_PERSISTENT=0: one block per tile).  The tiles in flight then read the K and V of
    about as many pairs as one SM count of tiles spans, which L2 keeps: sections sized by the
    cache alone (15 pairs at d128, 4k) had the blocks stream 15 pairs' K and V at once, L2 hit
    rate 77 % against 91 % (docs/perf-notes.md h13).
    Packed (varlen) calls keep one block per SM with fewer tiles too: the blocks also write the
    rows past the last sequence (varlen_tail.cuh), however many there are; those without a tile
    leave after that."""
    sms = _sm_resources(device)[0]
    section = min(pairs, max(1, _l2_bytes(device) // 2 // max(kv_bytes_per_pair, 1)), -(-sms // max(m_blocks, 1)))
    tiles = m_blocks * pairs
    if tiles >= 2**31:  # (the kernel numbers tiles in 32 bits: terabytes of q)
        raise ValueError(f"q has {tiles} query tiles (heads x tiles of rows), more than the Hopper forward numbers (2**31)")
    blocks = (sms if packed else min(tiles, sms)) if _kernels.sm90_persistent() else tiles
    return section, (max(1, blocks),)


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_id: int) -> int:
    return _cp().cuda.Device(device_id).attributes["L2CacheSize"]


def _tma_readable(x, packed):
    """``x`` as the copy engine reads it: packed rows as one batch entry; reversed or broadcast axes
    as a contiguous copy."""
    x = x[None] if packed else x
    return x if all(s > 0 or n == 1 for s, n in zip(x.strides, x.shape)) else _cp().ascontiguousarray(x)


def _fwd_maps(q, k, v, out, packed, block_m, block_n):
    """Tensor maps of Q (block_m-row boxes), K and V (block_n-row boxes) and O (64-row boxes, one
    consumer warpgroup's rows; a packed call stores O without it) for the warp-specialised
    forward: its FwdMaps struct as a :class:`cuflash._tma.MapsArg`."""
    from . import _tma

    q, k, v = (_tma_readable(x, packed) for x in (q, k, v))
    out = out[None] if packed else out  # (written: never a copy; its head dim is contiguous, rows 16-byte aligned)
    maps = [_tma.tile_map(q, block_m), _tma.tile_map(k, block_n), _tma.tile_map(v, block_n), _tma.tile_map(out, 64)]
    return _tma.MapsArg(maps, ("q", "k", "v", "out"), (q, k, v, out))


def _bwd_maps(q, dout, packed, rows):
    """Tensor maps of Q and dO (rows-row boxes) for the Hopper dK/dV kernels (BwdMaps of
    kernels/flash_bwd_sm90.cu), as a :class:`cuflash._tma.MapsArg`."""
    from . import _tma

    def tile_map(x):  # (a copy where the driver cannot describe the rows: not 16-byte multiples apart)
        x = _tma_readable(x, packed)
        try:
            return x, _tma.tile_map(x, rows)
        except ValueError:
            x = _cp().ascontiguousarray(x)
            return x, _tma.tile_map(x, rows)

    (q, q_map), (dout, dout_map) = tile_map(q), tile_map(dout)
    return _tma.MapsArg([q_map, dout_map], ("q", "dout"), (q, dout))


def execute(prm, launches, accum):
    """Run the recorded launches: point the split kernel at its scratch (if any), then launch in
    order.  A launch may carry a fifth item, a :class:`cuflash._tma.MapsArg` (tensor maps by value)."""
    first_bad = _offsets_scratch(prm) if prm.cu_seqlens_q else None  # noqa: F841 (alive until queued)
    if accum is not None:
        out_floats, lse_floats, groups = accum
        counters, partials = _split_scratch(groups, out_floats + lse_floats)
        base = partials.data.ptr  # partial outputs, then their LSEs (out_floats is a multiple of 8: aligned)
        prm.out_accum, prm.lse_accum, prm.split_counters = base, base + 4 * out_floats, counters.data.ptr
    arg = _pointer(prm)
    for fn, grid, block, smem, *extra in launches:
        args = (arg,) + tuple(_cpointer()(maps.address) for maps in extra)
        fn(grid, block, args, shared_mem=smem)


# The split kernel's scratch, kept per (device, stream): counters, one per row group, 0 between
# launches since the last block of each group resets its own (zeroed only when allocated), and
# the partial results, which every launch writes before it reads them.  Launches on one stream
# never overlap (those on two may), so one set per stream serves every call on it without an
# allocation per call (d9).  A call being captured into a CUDA graph, or on the per-thread
# default stream (one handle for a different stream in each host thread), gets scratch of its
# own instead: a stream's scratch is never allocated inside a capture, where the counters' memset
# would not run.  On the per-thread stream it is freed on return; inside a capture cuflash._guard
# keeps it (as every allocation of a captured call) until release_graph_memory(), so that replays
# never touch memory handed to someone else.  An outgrown set, or that of a stream not used among the last
# _MAX_SCRATCH_STREAMS, is freed in stream order: CuPy's pool hands its memory only to later work
# on the same stream.
_STREAM_SCRATCH = {}  # in order of last use
_MAX_SCRATCH_STREAMS = 64
_SCRATCH_LOCK = threading.Lock()
_PER_THREAD_STREAM = 2  # cudaStreamPerThread


def _split_scratch(groups: int, partial_floats: int):
    """(counters, partials) for the next launch on the current stream: at least ``groups`` int32
    counters, all 0, and ``partial_floats`` float32 of uninitialised memory."""
    cp = _cp()
    stream = cp.cuda.get_current_stream().ptr
    if stream == _PER_THREAD_STREAM or cp.cuda.runtime.streamIsCapturing(stream) != 0:
        return cp.zeros(groups, dtype=cp.int32), cp.empty(partial_floats, dtype=cp.float32)
    key = (cp.cuda.runtime.getDevice(), stream)
    with _SCRATCH_LOCK:
        counters, partials = _STREAM_SCRATCH.pop(key, (None, None))
        if counters is None or counters.size < groups:
            counters = cp.zeros(max(groups, 1024), dtype=cp.int32)
        if partials is None or partials.size < partial_floats:
            partials = cp.empty(partial_floats, dtype=cp.float32)
        _STREAM_SCRATCH[key] = counters, partials
        if len(_STREAM_SCRATCH) > _MAX_SCRATCH_STREAMS:
            del _STREAM_SCRATCH[next(iter(_STREAM_SCRATCH))]
    return counters, partials


def _decode_launches(p, prm, variant, fn, device, num_splits):
    """The split-KV variant: GQA heads packed into rows, the key range cut across blocks whose last
    one per row group merges their partial results (Flash-Decoding).  Returns (launches, the
    floats of the partial outputs and of their LSEs and the number of row groups, or None
    without splits)."""
    # ALiBi slopes, bias and mask differ per head: no packing
    pack = p.group_size if p.alibi_slopes is None and p.bias is None and p.mask is None and p.dropout is None else 1
    assert pack == 1 or not (prm.bias or prm.mask or prm.dropout_scale)  # (the kernel indexes them by the group's first head)
    defines = dict(variant.defines)
    block_m, block_n = defines["CUFLASH_BLOCK_M"], defines["CUFLASH_BLOCK_N"]
    m_blocks = (p.seqlen_q * pack + block_m - 1) // block_m
    blocks = m_blocks * p.batch * (p.nheads_q // pack)
    key_blocks = max(1, (p.seqlen_k + block_n - 1) // block_n)
    if num_splits == 0:
        group_rows = min(block_m, p.seqlen_q * pack)  # rows whose partial results one block merges
        paged = bool(prm.block_table)  # paged blocks need every resident block whatever the merge costs (d3, d8)
        num_splits = _auto_splits(blocks, key_blocks, variant, device, regs=fn.num_regs, static_smem=fn.shared_size_bytes,
                                  partial_bytes=0 if paged else group_rows * prm.headdim_v * 4)
    num_splits = max(1, min(num_splits, key_blocks, MAX_SPLITS))
    prm.pack_gqa, prm.num_splits = pack, num_splits
    grid = (m_blocks * num_splits, *_grid_yz(p.batch * (p.nheads_q // pack)))
    launches = [(fn, grid, (variant.threads,), variant.smem_bytes)]
    if num_splits == 1:
        return launches, None
    partial_rows = num_splits * p.batch * p.nheads_q * p.seqlen_q  # (splits, batch, heads, seqlen_q) each
    return launches, (partial_rows * prm.headdim_v, partial_rows, blocks)


def _auto_splits(blocks: int, key_blocks: int, variant, device: int, regs: int = 0, static_smem: int = 1024,
                 partial_bytes: int = 0) -> int:
    """Splits for one wave of every block the SMs can hold at once (never a second, nearly
    empty wave), each split keeping at least two key tiles (so the merge stays a small
    fraction of the work) and none left without one.  docs/perf-notes.md, d7: with the
    four-warp decode blocks, a wave of every resident block reads contiguous and paged caches
    fastest.  Resident blocks are bounded by shared memory (the variant's dynamic bytes, the
    kernel's ``static_smem`` and CUDA's reserved kilobyte per block) and, given the kernel's
    ``regs`` per thread, by the register file.  The last block of a row group reads every
    split's partial result, ``partial_bytes`` each: past COMBINE_BYTES in all, a wave of half
    the resident blocks reads a contiguous cache faster (d8: GQA 32/8 at batch 1, 32 splits
    against 64, +2-4 %; on a paged cache -14 %: its blocks, busy with page lookups, need every
    resident one, d3, so the launch passes 0 there).  The launch passes all three from the
    compiled kernel and the call; the defaults (no register bound, 1 KB of static memory: the
    page slots of 64-key tiles, no merge bound) are for callers without them, such as tests."""
    sms, smem_per_sm = _sm_resources(device)
    per_sm = max(1, min(32, smem_per_sm // (variant.smem_bytes + static_smem + RESERVED_SMEM_PER_BLOCK)))
    if regs:  # registers are allocated per thread in units of 8
        per_sm = max(1, min(per_sm, REGISTERS_PER_SM // (-(-regs // 8) * 8 * variant.threads)))
    splits = sms * per_sm // blocks
    if partial_bytes:
        splits = min(splits, max(COMBINE_BYTES // partial_bytes, sms * per_sm // (2 * blocks)))
    splits = max(1, min(splits, key_blocks // 2, MAX_SPLITS))
    per_split = -(-key_blocks // splits)  # key tiles per split, as the kernel cuts them
    return -(-key_blocks // per_split)  # only splits that get key tiles: no empty block, less to merge


@functools.lru_cache(maxsize=None)
def _sm_resources(device_id: int):
    attrs = _cp().cuda.Device(device_id).attributes
    return attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerMultiprocessor"]


@functools.lru_cache(maxsize=None)
def _cpointer():
    return _cp().cuda.function.CPointer


def _pointer(prm):
    return _cpointer()(ctypes.addressof(prm))


def forward(p, q, k, v, out, lse, *, block_table=None, cache_batch_idx=None, seq_bad=None, seqlen_new=0,
            num_splits=0, record=None, call="attention"):
    """Padded batch: q (B, Sq, H, D), out (B, Sq, H, Dv) views; lse (B, H, Sq) contiguous.

    With ``block_table`` (B, max_pages), k and v are paged caches (num_pages, page_size, Hk, D);
    with ``cache_batch_idx`` (B,), sequence b reads row cache_batch_idx[b] of k and v; then
    ``p.seqlens_k`` gives each sequence's length, ``seq_bad`` (B,) int32 marks the sequences an
    append refused (:func:`append_kv`), and ``seqlen_new`` is the tokens appended (for messages).
    ``record`` (a list) receives the parameters and launches, for cuflash._fastpath to replay;
    ``call`` names the public function in error messages.
    """
    if p.seqlen_k == 0 or p.nheads_k == 0:
        out[...] = 0
        lse[...] = -np.inf
        if seq_bad is not None:  # a cache of capacity 0 refused every append: those rows are NaN
            bad = seq_bad != 0
            out[...] = _cp().where(bad[:, None, None, None], np.nan, out)
            lse[...] = _cp().where(bad[:, None, None], np.nan, lse)
        return
    _launch_attention_fwd(p, q, k, v, out, lse, packed=False, lse_strides=(p.nheads_q * p.seqlen_q, p.seqlen_q),
                          block_table=block_table, cache_batch_idx=cache_batch_idx, seq_bad=seq_bad,
                          seqlen_new=seqlen_new, num_splits=num_splits, record=record, call=call)


def forward_varlen(p, q, k, v, out, lse, cu_q, cu_k, record=None, call="attention_varlen"):
    """Packed: q (total_q, H, D); lse (H, total_q); rows past cu_q[-1] get out = 0, lse = -inf,
    rows of sequences with malformed offsets NaN (kernels/varlen_tail.cuh).  ``record`` as in
    :func:`forward`.  When no row sees a key (max_seqlen_* = 0, or no key rows; the caller wrote 0
    and -inf), only the offsets check and its NaN fill run."""
    tail_only = p.seqlen_q == 0 or p.seqlen_k == 0 or k.shape[0] == 0
    _launch_attention_fwd(p, q, k, v, out, lse, packed=True, cu_q=cu_q, cu_k=cu_k, lse_strides=(0, q.shape[0]),
                          record=None if tail_only else record, call=call, tail_only=tail_only)


def append_kv(k_cache, v_cache, k, v, cache_seqlens, capacity, *, block_table=None, cache_batch_idx=None,
              call="attention_with_kvcache"):
    """Write the new tokens k, v (B, new, Hk, D) at positions cache_seqlens[b] + t of each
    sequence's cache row or pages (kernels/kv_append.cu), refusing a sequence whose metadata names
    a slot it may not write.  Returns the (B,) int32 flags of the refused sequences, for
    :func:`forward`'s ``seq_bad``.  The caches' last axis must be contiguous (checked by the caller)."""
    cp = _cp()
    device = _same_device([k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx])
    with cp.cuda.Device(device):
        batch, new = k.shape[:2]
        seq_bad = cp.empty(batch, dtype=cp.int32)
        k, v = (x if x.strides[-1] == x.itemsize else cp.ascontiguousarray(x) for x in (k, v))
        prm = _fill_params_append(k_cache, v_cache, k, v, capacity)
        arrays, prm.index_64bit = _index_arrays(dict(seqlens_k=cache_seqlens, block_table=block_table,
                                                     cache_batch_idx=cache_batch_idx))
        for field, x in arrays.items():
            setattr(prm, field, None if x is None else x.data.ptr)
        prm.seq_bad = seq_bad.data.ptr
        if block_table is not None:
            prm.block_table_batch_stride, prm.page_size = block_table.shape[1], k_cache.shape[1]
        _report_to(prm, device, call, **_extents(prm, new))
        fn = _kernels.get_function(_kernels.kv_append_variant(), device)
        fn((batch,), (256,), (_pointer(prm),))
    return seq_bad


def _fill_params_append(k_cache, v_cache, k, v, capacity):
    """The FlashParams of kv_append.cu: caches as k/v, new tokens as k_new/v_new (strides in elements)."""
    prm = FlashParams()
    prm.k, prm.v, prm.k_new, prm.v_new = (x.data.ptr for x in (k_cache, v_cache, k, v))
    for prefix, x in (("k", k_cache), ("v", v_cache), ("knew", k), ("vnew", v)):
        bs, rs, hs = _strides(x, False)
        setattr(prm, f"{prefix}_batch_stride", bs)
        setattr(prm, f"{prefix}_row_stride", rs)
        setattr(prm, f"{prefix}_head_stride", hs)
    prm.batch, prm.seqlen_new, prm.nheads_k = k.shape[0], k.shape[1], k.shape[2]
    prm.headdim_qk, prm.headdim_v, prm.elem_bytes = k.shape[3], v.shape[3], k.itemsize
    prm.seqlen_k, prm.kv_rows = capacity, k_cache.shape[0]
    return prm


def _launch_attention_bwd(p, dout, q, k, v, out, lse, grads, *, packed, cu_q=None, cu_k=None, lse_strides,
                          deterministic, call, tail_only=False, dlse=None, dbias=None):
    """dsum pre-pass, then the dq and dkdv kernels, or unless ``deterministic`` (on Hopper, and for
    float32/float64 on any GPU) one dkdv kernel that adds dQ atomically to an fp32 (float64) buffer
    and a kernel scaling it into dq;
    grads = (dq, dk, dv) views, written in full (packed: pre-zeroed, and the rows of sequences
    with malformed offsets set to NaN first, kernels/varlen_tail.cu).  ``tail_only`` (packed):
    only that check and fill, for calls with no row to differentiate (max_seqlen_* = 0).
    Bias, mask and dropout run the CUFLASH_MODS kernels of either; ``dlse`` (the
    LSE's gradient) is subtracted from D; ``dbias`` (bias's shape) is written in full."""
    cp = _cp()
    dtype = check_call(p, q, packed=packed, backward=True)
    wide = dtype in _WIDE_DTYPES
    device = _same_device([dout, q, k, v, out, lse, *grads, p.alibi_slopes, p.seqlens_k, cu_q, cu_k, p.bias, p.mask,
                           p.dropout_seed_array, dlse, dbias])
    with cp.cuda.Device(device):
        d8, dv8 = _round8(p.headdim_qk), _round8(p.headdim_v)
        q, scale, q_sign = _positive_scale(p, q)  # dq is mapped back below
        qx, kx = _prepare(q, d8), _prepare(k, d8)
        vx, ox, dox = _prepare(v, dv8), _prepare(out, dv8), _prepare(dout, dv8)
        lse = cp.ascontiguousarray(lse)
        dsum = cp.empty(lse.shape, dtype=lse.dtype)  # (float32; float64 for float64 inputs)
        gx = []
        for g_out, dim in zip(grads, (d8, d8, dv8)):
            direct = g_out.shape[-1] == dim and _aligned(g_out)
            # (zeros: rows of a packed batch past its last sequence are written by no kernel)
            gx.append(g_out if direct else cp.zeros(g_out.shape[:-1] + (dim,), dtype=g_out.dtype))
        features = dict(softcap=p.softcap > 0, alibi=p.alibi_slopes is not None)
        mods = _mods_level(p)
        smem_limit = _smem_limit(device)
        # float32/float64: dQ added atomically in the dtype (one pass) unless ``deterministic``, where
        # its dS tile fits (_kernels.wide_bwd_schemes)
        atomic_wide = wide and not deterministic and False in _kernels.wide_bwd_schemes(
            dtype, _kernels.headdim_bucket(max(d8, dv8)), smem_limit)
        variant = _kernels.bwd_variant(dtype, max(d8, dv8), **features, mods=mods, smem_limit=smem_limit,
                                       tf32=p.precision == "tf32", deterministic=not atomic_wide)
        main = (_hopper_variant(device, dtype, max(d8, dv8), dict(features, deterministic=deterministic, mods=mods),
                                _kernels.sm90_bwd_variant) if not wide else None) or variant
        pointers = dict(q=qx, k=kx, v=vx, out=ox, lse=lse, dout=dox, dq=gx[0], dk=gx[1], dv=gx[2], dsum=dsum,
                        alibi_slopes=p.alibi_slopes)
        indices = dict(seqlens_k=p.seqlens_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        strided = dict(q=qx, k=kx, v=vx, o=ox, do=dox, dq=gx[0], dk=gx[1], dv=gx[2])
        prm = _fill_params(p, pointers, strided, packed=packed, lse_strides=lse_strides, d8=d8, dv8=dv8, scale=scale,
                           indices=indices)
        _set_extents(prm, p, q, k, packed)
        keep_mods = _set_mods(prm, p, dtype)  # noqa: F841 (alive until the launches are queued)
        dbias_acc, dbias_of = _dbias_accumulator(prm, p, dbias, deterministic, lse.dtype)
        if any(x is not None for x in indices.values()):
            _report_to(prm, device, call, **_extents(prm))
        tile, key_tile = bwd_tiles(main)
        dq_grid = ((p.seqlen_q + tile - 1) // tile, *_grid_yz(p.batch * p.nheads_q))
        dkdv_grid = ((p.seqlen_k + key_tile - 1) // key_tile, *_grid_yz(p.batch * p.nheads_k))
        smem = main.smem_bytes
        if tail_only:
            launches = ()
        elif dict(main.defines).get("CUFLASH_DETERMINISTIC", 1):
            launches = (("_dq", dq_grid, smem), ("_dkdv", dkdv_grid, smem))
        else:  # dQ rows, head-dim bucket wide: fp32 (float64 for float64); flash_bwd.cu lays them out
            # like the LSE's, flash_bwd_sm90.cu in 64-row tiles of their own (its dq_tile_offset: each
            # head's rows rounded up to 64, packed sequences 64 rows apart)
            rows = lse.size
            if main.filename == "flash_bwd_sm90.cu":
                rows = (prm.nheads_q * (prm.total_q + 64 * prm.batch) if prm.cu_seqlens_q
                        else prm.batch * prm.nheads_q * -(-prm.seqlen_q // 64) * 64)
            dq_accum = cp.zeros(rows * dict(main.defines)["CUFLASH_HEADDIM"] * _kernels.dq_accum_copies(main), dtype=lse.dtype)
            prm.dq_accum = dq_accum.data.ptr
            if dict(main.defines).get("CUFLASH_DQ_ORDER"):  # deterministic: the key blocks add to a dQ tile in turn
                # (the blocks' ticket counter, then a turn counter per dQ tile and panel owner)
                dq_order = cp.zeros(1 + 2 * (rows // 64 + 1), dtype=cp.int32)  # noqa: F841 (alive until queued)
                prm.split_counters = dq_order.data.ptr
                prm.tile_heads, dkdv_grid = _ordered_bwd_grid(device, main, p.batch * p.nheads_k, dkdv_grid[0])
            launches = (("_dkdv_dq", dkdv_grid, smem), ("_dq_convert", dq_grid, 0))
        tail, dsum_kernel = _kernels.varlen_tail_variant(), _kernels.dsum_variant(dtype)
        if not tail_only:
            _kernels.prefetch([(dsum_kernel, ""), (main, launches[0][0])] + [(tail, "_grads")] * packed, device)

        if packed:  # rows no well-formed sequence owns: NaN where the offsets are malformed
            first_bad = _offsets_scratch(prm)  # noqa: F841 (alive until the launches are queued)
            _kernels.get_function(tail, device, "_grads")((2 * _sm_resources(device)[0],), (256,), (_pointer(prm),))

        if not tail_only:  # D = rowsum(dO * O) over every stored row; packed rows are one long sequence here.
            pre = FlashParams.from_buffer_copy(prm)
            pre.tf32_operands = int(dtype == "float32" and p.precision == "tf32")
            if packed:
                pre.batch, pre.seqlen_q = 1, q.shape[0]
            rows = pre.batch * pre.seqlen_q * pre.nheads_q
            _kernels.get_function(dsum_kernel, device)(((rows + 7) // 8,), (256,), (_pointer(pre),))
            if dlse is not None:  # dS = P (dP - D + dlse): the LSE's gradient joins D
                dsum -= cp.where(cp.isneginf(lse), 0, dlse)  # (rows with no key stay 0, whatever dlse says)

        if launches:  # the mask's tile map for the dK/dV kernel's tiles (query tiles x key_tile keys)
            inner = dict(main.defines).get("CUFLASH_INNER", tile)
            map_launch, mask_map = _mask_tile_map(prm, p, inner, key_tile, device)  # noqa: F841 (alive until queued)
            if map_launch:
                fn, grid, block, shared_mem = map_launch
                fn(grid, block, (_pointer(prm),), shared_mem=shared_mem)
        # the Hopper dK/dV kernels read Q and dO through the copy engine's tensor maps
        maps = (_bwd_maps(qx, dox, packed, dict(main.defines)["CUFLASH_INNER"])
                if launches and main.filename == "flash_bwd_sm90.cu" else None)
        for suffix, grid, shared_mem in launches:
            fn = _kernels.get_function(main, device, suffix)
            extra = (_cpointer()(maps.address),) if suffix.startswith("_dkdv") and maps is not None else ()
            fn(grid, (main.threads_of(suffix),), (_pointer(prm), *extra), shared_mem=shared_mem)

        for g_out, g_x in zip(grads, gx):
            if g_x is not g_out:
                g_out[...] = g_x[..., : g_out.shape[-1]]
        if dbias is not None:
            dbias[...] = dbias_of().reshape(dbias.shape)
        if q_sign != 1.0:
            grads[0][...] = grads[0] * q_sign  # -dq, or 0 (NaN rows of bad metadata stay NaN)


def _ordered_bwd_grid(device: int, variant, pairs: int, key_blocks: int):
    """(tile_heads, grid) of the Hopper dK/dV kernel with ordered dQ additions (flash_bwd_sm90.cu's
    kDqOrdered): one axis of key_blocks x pairs blocks in sections of tile_heads (batch, K/V head)
    pairs (kernels/sm90_scheduler.cuh's bwd_block), as many as one wave of resident blocks holds
    whole (at least one): a pair's key blocks then run side by side.  Measured (perf-notes b16,
    bf16 H200): d128 causal 16k 314 -> 451 TF/s against sections of 17 pairs (the first rule's,
    about 8 key blocks of each pair at a time), causal 4k 296 -> 338, d256 causal 16k 176 -> 267."""
    resident = _sm_resources(device)[0] * dict(variant.defines).get("CUFLASH_MIN_BLOCKS", 1)
    blocks = key_blocks * pairs
    assert blocks < 2**31, "the grid's x extent"  # (2^31 blocks of 64 keys would be terabytes of K)
    return max(1, min(pairs, resident // max(key_blocks, 1))), (blocks, 1, 1)


def bwd_tiles(variant) -> tuple:
    """(query rows, key rows) per block of a backward variant's grids: flash_bwd.cu 16 per warp,
    or per slab of CUFLASH_SLAB_WARPS warps with a column split, its atomic-dQ kernel's query rows
    CUFLASH_QUERY_TILE where set (fewer than its key rows); the Hopper kernels 64 per
    warpgroup, with 64 keys in all at d256, whose warpgroups split the columns (CUFLASH_COL_SPLIT)."""
    defines = dict(variant.defines)
    tile = variant.threads // 2 // defines.get("CUFLASH_SLAB_WARPS", 1)
    return defines.get("CUFLASH_QUERY_TILE") or tile, (64 if defines.get("CUFLASH_COL_SPLIT") else tile)


def _dbias_accumulator(prm, p, dbias, deterministic, acc_dtype=np.float32):
    """A zero buffer of ``acc_dtype`` (float32; float64 for the float64 kernels: the LSE's dtype) for
    the backward kernels to add dS into (None without dbias), and the dbias it gives.  Default: dbias's shape lifted to four axes, strides 0 on the axes where the bias
    broadcasts (size 1), so that the atomics sum there.  ``deterministic`` with a broadcast axis:
    the full (batch, heads, seqlen_q, seqlen_k) dS (each element added once, to 0: exact), summed
    over those axes by CuPy in a fixed order afterwards; 4 (8) bytes per score of memory."""
    if dbias is None:
        return None, None
    shape = (1,) * (4 - dbias.ndim) + tuple(dbias.shape)
    full = (p.batch, p.nheads_q, p.seqlen_q, p.seqlen_k)
    summed = tuple(axis for axis in range(4) if shape[axis] == 1 and full[axis] > 1)
    acc = _cp().zeros(full if deterministic and summed else shape, dtype=acc_dtype)
    prm.dbias = acc.data.ptr
    for axis, size, stride in zip(("batch", "head", "row", "col"), acc.shape, acc.strides):
        setattr(prm, f"dbias_{axis}_stride", 0 if size == 1 else stride // acc.itemsize)
    return acc, (lambda: acc.sum(axis=summed, keepdims=True) if acc.shape != shape else acc)


def backward(p, dout, q, k, v, out, lse, dq, dk, dv, *, deterministic, call="attention_backward", dlse=None,
             dbias=None):
    """Padded batch: bshd views; lse (B, H, Sq).  ``deterministic``: no atomics (bitwise repeatable;
    the bias gradient from a full-size dS, _dbias_accumulator).  ``dlse`` (B, H, Sq), ``dbias``: as
    cuflash._cpu.backward's."""
    _launch_attention_bwd(p, dout, q, k, v, out, lse, (dq, dk, dv), packed=False,
                          lse_strides=(p.nheads_q * p.seqlen_q, p.seqlen_q), deterministic=deterministic, call=call,
                          dlse=dlse, dbias=dbias)


def backward_varlen(p, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, *, deterministic,
                    call="attention_varlen_backward"):
    """Packed: (total, H, D) arrays; lse (H, total_q); grads pre-zeroed by the caller.  With nothing
    to differentiate (max_seqlen_* = 0, or no key rows) only the offsets check and its NaN fill run."""
    tail_only = p.seqlen_q == 0 or p.seqlen_k == 0 or k.shape[0] == 0
    _launch_attention_bwd(p, dout, q, k, v, out, lse, (dq, dk, dv), packed=True, cu_q=cu_q, cu_k=cu_k,
                          lse_strides=(0, q.shape[0]), deterministic=deterministic, call=call, tail_only=tail_only)


def softmax(x, axis):
    """Row softmax kernel over ``axis`` (moved last and made contiguous when needed)."""
    cp = _cp()
    name = np.dtype(x.dtype).name
    with cp.cuda.Device(x.device.id):
        moved = cp.ascontiguousarray(cp.moveaxis(x, axis, -1))
        y = cp.empty_like(moved)
        n = moved.shape[-1]
        rows = moved.size // n
        fn = _kernels.get_function(_kernels.softmax_variant(name), x.device.id)
        # Grid x allows 2^31 - 1 blocks: one per row.
        fn((rows,), (256,), (moved, y, np.int64(n)))
        return cp.moveaxis(y, -1, axis)
