// FlashParams: everything a cuflash attention kernel needs, passed by value as one argument.
//
// Mirrored field for field by cuflash/_params.py (a ctypes.Structure).  Every field is 8 bytes
// wide so the two layouts cannot disagree on padding; CUFLASH_PARAMS_SIZE (set by the loader from
// ctypes.sizeof) is checked below so a field added on one side only fails to compile.
#pragma once

struct FlashParams {
    const void* q;                 // (batch, seqlen_q, nheads_q, headdim_qk) elements of T, strided
    const void* k;                 // (batch, seqlen_k, nheads_k, headdim_qk)
    const void* v;                 // (batch, seqlen_k, nheads_k, headdim_v)
    void* out;                     // (batch, seqlen_q, nheads_q, headdim_v)
    float* lse;                    // natural-log LSE, row i of (b, h) at b*lse_batch_stride + h*lse_head_stride + q_start + i
    const float* alibi_slopes;     // (batch, nheads_q) contiguous, or null
    // Index arrays (int32, or int64 where index_64bit has their bit; metadata.cuh reads them).  Their
    // values are never trusted: SeqInfo bounds every index derived from them by the extents below.
    const void* cu_seqlens_q;      // (batch + 1) packed-row offsets of q/out, or null (padded batch)
    const void* cu_seqlens_k;      // (batch + 1) packed-row offsets of k/v, or null
    const void* seqlens_k;         // (batch) valid key length per batch entry, or null (= seqlen_k)
    const void* cache_batch_idx;   // (batch) row of k/v holding sequence b, or null (row b)
    int* seq_bad;                  // (batch) 1 = the KV append refused sequence b (kv_append.cu writes it), or null
    unsigned long long* error_word;  // mapped host memory: the first bad index is atomicMin'ed here (metadata.cuh)
    long long* offsets_first_bad;  // varlen: first bad entry of cu_seqlens_q and _k (-1: well formed), written by varlen_tail.cuh's check
    // Backward only (null in the forward):
    const void* dout;              // (batch, seqlen_q, nheads_q, headdim_v), gradient of out
    void* dq;                      // (batch, seqlen_q, nheads_q, headdim_qk), written
    void* dk;                      // (batch, seqlen_k, nheads_k, headdim_qk), written
    void* dv;                      // (batch, seqlen_k, nheads_k, headdim_v), written
    float* dsum;                   // D = rowsum(dout * out), fp32, laid out like lse
    float* dq_accum;               // dkdv with atomic dQ: fp32 (float64 for float64), head-dim bucket wide, zeroed, or null;
                                   // flash_bwd.cu: the rows of lse; flash_bwd_sm90.cu: dq_tile_offset's 64-row tiles
    // Split-KV decode kernel only (null / 0 elsewhere):
    const void* block_table;       // (batch, max_pages) page of each page_size keys; k/v batch stride = page stride
    float* out_accum;              // (num_splits, batch, nheads_q, seqlen_q, headdim_v) fp32 partial outputs
    float* lse_accum;              // (num_splits, batch, nheads_q, seqlen_q) their natural-log LSE
    int* split_counters;           // one per group of blocks sharing rows, 0 between launches (the last block resets it);
                                   // the Hopper backward with ordered dQ: its turn counters (zeroed per call, dq_order_counter)
    // KV append only (kv_append.cu): new keys/values (batch, seqlen_new, nheads_k, headdim), written into k/v.
    const void* k_new;
    const void* v_new;
    // Score modifiers (forward of attention(), CUFLASH_MODS kernels; null elsewhere): an additive
    // bias (float32, float16 or bfloat16: bias_dtype) and a boolean mask (1 byte, nonzero =
    // attend), element (b, h, i, j) at the strides below (elements; 0 on broadcast axes).
    const void* bias;
    const unsigned char* mask;
    // Backward with a bias (flash_bwd.cu, CUFLASH_MODS kernels): dS accumulated into float32 at the
    // dbias strides below (0 on the bias's broadcast axes); null: no bias gradient.
    float* dbias;
    // Dropout's (seed, offset) as a (2,) int64 GPU array read by the kernels (null: the values below).
    const unsigned long long* dropout_seed_ptr;
    // The mask's tile map for the next kernel's tiles of mask_tile_m x mask_tile_n scores
    // (mask_tiles.cu writes it first; null: none): per tile of each distinct (batch, head) plane of
    // the mask, 0 every entry False, 1 every entry True, 2 both; per row of tiles the key tiles and
    // per column the query tiles not all False, as int pairs (count - first, last + 1), 0 0 if none.
    unsigned char* mask_tiles;
    int* mask_tile_row_ranges;
    int* mask_tile_col_ranges;

    // Strides in elements.  Packed (varlen) tensors have batch stride 0.
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long knew_batch_stride, knew_row_stride, knew_head_stride;
    long long vnew_batch_stride, vnew_row_stride, vnew_head_stride;

    long long batch, nheads_q, nheads_k;
    long long seqlen_q, seqlen_k;  // padded sizes (varlen: the longest sequence)
    long long headdim_qk, headdim_v;  // real head dims (multiples of 8; the kernel's kD may be larger)

    long long window_left, window_right;  // inclusive, -1 = unbounded; causal already folded in (right = 0)
    long long top_left;            // 1: diagonal through (0, 0); 0: bottom-right (offset sk - sq)

    // Extents that bound the metadata, and how a violation is reported (metadata.cuh):
    long long total_q, total_k;    // rows of packed q and k (varlen)
    long long kv_rows;             // k/v's first axis where it is indexed by metadata: pages (block_table) or rows (cache_batch_idx)
    long long index_64bit;         // bit set per index array stored as int64 (kIndex* in metadata.cuh)
    long long error_call;          // the call's description number on the host (cuflash/_guard.py)
    long long seqlen_new, elem_bytes;  // KV append: new tokens per sequence; bytes per element (every call)

    // Split-KV decode kernel only:
    long long block_table_batch_stride, page_size;  // paged K/V (block_table not null)
    long long num_splits;          // key range cut into this many parts; > 1 writes out_accum/lse_accum
    long long pack_gqa;            // g query heads of one K/V head folded into the row axis (1 = none)
    // Hopper forward only (sm90_scheduler.cuh): (batch, head) pairs per section of the tile order.
    long long tile_heads;
    // Score modifiers: strides of bias and mask over (batch, head, query, key); bias_dtype 0 float32,
    // 1 float16, 2 bfloat16.
    long long bias_batch_stride, bias_head_stride, bias_row_stride, bias_col_stride;
    long long mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
    long long bias_dtype;
    // The tile map's shape: tile sizes, tiles per plane (rows: 1 where the mask's rows broadcast),
    // head planes per batch plane (nheads_q, or 1 where the mask's heads broadcast).
    long long mask_tile_m, mask_tile_n, mask_tiles_rows, mask_tiles_cols, mask_tiles_heads;
    // Dropout (CUFLASH_MODS = 2 kernels): the keep-mask of philox.cuh from (seed, offset) with keep
    // threshold round((1 - p) 2^16) for its 16-bit draws, batch entries numbered from dropout_first_batch; the output
    // times dropout_scale = 1 / (1 - p) with its 1 / l.
    long long dropout_seed, dropout_offset, dropout_threshold, dropout_first_batch;
    long long dbias_batch_stride, dbias_head_stride, dbias_row_stride, dbias_col_stride;
    // float32 backward with precision="tf32" (bwd_dsum.cu): D from dO rounded to TF32, as the main
    // kernel's dP = dO V^T has it, so that dP - D cancels where it should (1: on).
    long long tf32_operands;

    double softmax_scale;          // multiplies q.k
    double softcap;                // > 0: s = softcap * tanh(s / softcap)
    double dropout_scale;          // 1 / (1 - dropout_p), or 0: no dropout
};

#ifdef CUFLASH_PARAMS_SIZE
static_assert(sizeof(FlashParams) == CUFLASH_PARAMS_SIZE, "FlashParams differs from cuflash/_params.py");
#endif
