"""The ctypes mirror of ``struct FlashParams`` in kernels/params.cuh.

Every field is 8 bytes wide (pointer, int64 or double), so C and ctypes cannot pad differently;
the loader passes ``ctypes.sizeof(FlashParams)`` to the compiler, where a ``static_assert``
rejects a struct that gained or lost a field on one side only.
"""

import ctypes

_POINTERS = (
    "q", "k", "v", "out", "lse", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k",
    "cache_batch_idx", "seq_bad", "error_word", "offsets_first_bad",
    "dout", "dq", "dk", "dv", "dsum", "dq_accum",
    "block_table", "out_accum", "lse_accum", "split_counters", "k_new", "v_new",
    "bias", "mask", "dbias", "dropout_seed_ptr", "mask_tiles", "mask_tile_row_ranges", "mask_tile_col_ranges",
)
_INTEGERS = (
    "q_batch_stride", "q_row_stride", "q_head_stride",
    "k_batch_stride", "k_row_stride", "k_head_stride",
    "v_batch_stride", "v_row_stride", "v_head_stride",
    "o_batch_stride", "o_row_stride", "o_head_stride",
    "lse_batch_stride", "lse_head_stride",
    "do_batch_stride", "do_row_stride", "do_head_stride",
    "dq_batch_stride", "dq_row_stride", "dq_head_stride",
    "dk_batch_stride", "dk_row_stride", "dk_head_stride",
    "dv_batch_stride", "dv_row_stride", "dv_head_stride",
    "knew_batch_stride", "knew_row_stride", "knew_head_stride",
    "vnew_batch_stride", "vnew_row_stride", "vnew_head_stride",
    "batch", "nheads_q", "nheads_k",
    "seqlen_q", "seqlen_k",
    "headdim_qk", "headdim_v",
    "window_left", "window_right",
    "top_left",
    "total_q", "total_k", "kv_rows", "index_64bit", "error_call", "seqlen_new", "elem_bytes",
    "block_table_batch_stride", "page_size", "num_splits", "pack_gqa", "tile_heads",
    "bias_batch_stride", "bias_head_stride", "bias_row_stride", "bias_col_stride",
    "mask_batch_stride", "mask_head_stride", "mask_row_stride", "mask_col_stride", "bias_dtype",
    "mask_tile_m", "mask_tile_n", "mask_tiles_rows", "mask_tiles_cols", "mask_tiles_heads",
    "dropout_seed", "dropout_offset", "dropout_threshold", "dropout_first_batch",
    "dbias_batch_stride", "dbias_head_stride", "dbias_row_stride", "dbias_col_stride",
    "tf32_operands",
)
_REALS = ("softmax_scale", "softcap", "dropout_scale")


class FlashParams(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS]
        + [(name, ctypes.c_longlong) for name in _INTEGERS]
        + [(name, ctypes.c_double) for name in _REALS]
    )


PARAMS_SIZE = ctypes.sizeof(FlashParams)
