// The Hopper backward's output side (flash_bwd_sm90.cu): where a warpgroup's accumulator rows lie,
// dQ's fp32 panels in dq_accum (the order the dK/dV kernel stages and adds them in, and the last
// pass that scales and rounds them), and the staged store of a 16-bit accumulator tile (dK, dV; dQ
// of the deterministic _dq kernel) through shared memory.
#pragma once
#include "mma.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "swizzled_tile.cuh"

// Each thread's rows of a warpgroup's 64-row wgmma accumulator: r and r + 8 within the 64.
__device__ __forceinline__ int wg_row(int tid) { return ((tid / 32) % 4) * 16 + (tid % 32) / 4; }

// The first float of query tile m0 (64 rows) of head h, batch entry b in dq_accum.
// Each tile is 64 kD floats of its own, in panels of kSlice columns (panel c / kSlice); within a
// panel, thread t (of the 128 of the warpgroup that formed it) holds its accumulator tile nt of
// dQ = dS K as the 4 floats at (nt * 128 + t) * 4: rows wg_row(t) (+0, +0, +8, +8), columns
// 8 nt + 2 (t % 4) (+0, +1, +0, +1) of the panel, so that the warpgroup stores it with one 16-byte
// store a tile per thread, without bank conflicts, and the copy engine adds it in one piece.
// kSlice = dq_panel_cols(kD, warpgroups, column split): 64 with the column split, the warpgroup's
// share of kD otherwise, or all of d64 where two warpgroups each add their keys' part of the
// whole tile (flash_bwd_dkdv_sm90's kDqByKeys).
// Tiles do not overlap: padded batches round each head's rows up to 64, packed sequences keep 64
// rows apart (dq_accum holds nheads_q * (total_q + 64 batch) rows then).
constexpr int dq_panel_cols(int d, int warpgroups, bool col_split) { return col_split || d / warpgroups < 64 ? 64 : d / warpgroups; }
// The copies of dq_accum: 2 where dQ's additions are ordered and each consumer forms all of a dQ tile
// over its own keys (flash_bwd_dkdv_sm90's kDqByKeys, d64's producer form): consumer w adds to copy w,
// the two under turns of their own, and _dq_convert sums copy 0 and copy 1 in that order; else 1.
constexpr int dq_accum_copies(int d, int warpgroups, bool col_split, bool ordered) {
    return ordered && !col_split && d / warpgroups < 64 ? 2 : 1;
}
__device__ __forceinline__ long long dq_tile_offset(const FlashParams& p, const SeqInfo& seq, int b, int h, int m0, int kD) {
    const long long row = p.cu_seqlens_q ? h * (p.total_q + 64 * p.batch) + seq.q_start + 64ll * b + m0
                                         : (b * p.nheads_q + h) * ((p.seqlen_q + 63) / 64 * 64) + m0;
    return row * kD;
}
// Deterministic dQ (flash_bwd_sm90.cu's kDqOrdered): the index in p.split_counters (zeroed per
// call) of the counter that orders the additions to query tile m0 of head h of the panels of
// `slot`: the warpgroup whose columns the panels hold (d64's kDqByKeys: whose copy of dq_accum,
// dq_accum_copies).  Tiles are 64 rows apart in
// dq_accum, so row / 64 numbers them (the host allocates 2 (rows / 64 + 1) counters after the first
// int, bwd_block's ticket).
__device__ __forceinline__ int dq_order_counter(const FlashParams& p, const SeqInfo& seq, int b, int h, int m0, int slot) {
    return static_cast<int>(1 + dq_tile_offset(p, seq, b, h, m0, 1) / 64 * 2 + slot);
}
// The rows of one copy of dq_accum (dq_tile_offset's layout; the host allocates as many)
__device__ __forceinline__ long long dq_accum_rows(const FlashParams& p) {
    return p.cu_seqlens_q ? p.nheads_q * (p.total_q + 64 * p.batch) : p.batch * p.nheads_q * ((p.seqlen_q + 63) / 64 * 64);
}

// Scale a (64 x kAccD) accumulator of this warpgroup by `mul`, round to 16 bits, stage it in the
// warpgroup's own rows [r0, r0 + 64) and chunks [c0, c0 + kAccD / 8) of the swizzled (kRows x kD)
// tile `stage`, then (after a block barrier) store rows < rows_valid and chunks < chunks_valid to g.
// `sync` is the barrier of the threads that store (every thread of the block by default).
struct BlockSync {
    __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
template <class T, int kD, int kRows, int kThreads, int kAccD = kD, class Sync = BlockSync>
__device__ __forceinline__ void store_tile(const float (&acc)[kAccD / 8][4], float mul, unsigned char* stage, int r0,
                                           u16* g, long long row_stride, int rows_valid, int chunks_valid, int tid, int c0 = 0,
                                           Sync sync = Sync{}) {
    const int lane = tid % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int ot = 0; ot < kAccD / 8; ++ot)
            *reinterpret_cast<u32*>(stage + swizzled_chunk<kRows>(r0 + wg_row(tid) + 8 * half, c0 + ot) + (lane % 4) * 4) =
                pack2<T>(acc[ot][2 * half] * mul, acc[ot][2 * half + 1] * mul);
    sync();
    constexpr int kChunks = kD / 8;
#pragma unroll
    for (int c = tid; c < kRows * kChunks; c += kThreads) {
        const int r = c / kChunks, col = c % kChunks;
        if (r < rows_valid && col < chunks_valid)
            *reinterpret_cast<uint4*>(g + r * row_stride + col * 8) = *reinterpret_cast<const uint4*>(stage + swizzled_chunk<kRows>(r, col));
    }
}

// The atomic-dQ form's last pass: dq = softmax_scale * dq_accum for the 64-row query tiles of one
// (64 * warpgroups)-row block of a sequence, read in dq_tile_offset's fragment order (a float4 a
// thread: two adjacent columns of two rows 8 apart); rows no key reached are 0, a bad sequence's NaN.
// kCopies 2 (dq_accum_copies): the sum of the two copies, the first plus the second.
template <class T, int kD, int kSlice, int kRows, int kThreads, int kCopies = 1>
__device__ __forceinline__ void dq_convert_tiles(const FlashParams& p) {
    const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * p.nheads_q) return;
    const int b = static_cast<int>(bh / p.nheads_q), h = static_cast<int>(bh % p.nheads_q);
    const SeqInfo seq(p, b);
    __syncthreads();  // seq.poison reads what every thread wrote (racecheck)
    const float scale = seq.poison(static_cast<float>(p.softmax_scale));
    const int cols = static_cast<int>(p.headdim_qk);
    for (int m0 = blockIdx.x * kRows; m0 < min(seq.sq, (blockIdx.x + 1) * kRows); m0 += 64) {
        const float4* acc = reinterpret_cast<const float4*>(p.dq_accum + dq_tile_offset(p, seq, b, h, m0, kD));
        u16* gdQ = static_cast<u16*>(p.dq) + b * p.dq_batch_stride + (seq.q_start + m0) * p.dq_row_stride + h * p.dq_head_stride;
        const int rows_valid = min(64, seq.sq - m0);
        for (int f = threadIdx.x; f < 16 * kD; f += kThreads) {
            const int panel = f / (16 * kSlice), g = f % (16 * kSlice), nt = g / 128, t = g % 128;
            const int r = wg_row(t), c = panel * kSlice + nt * 8 + (t % 4) * 2;
            if (c >= cols) continue;
            float4 v = acc[f];
            if constexpr (kCopies == 2) {
                const float4 w = acc[dq_accum_rows(p) * kD / 4 + f];
                v = make_float4(v.x + w.x, v.y + w.y, v.z + w.z, v.w + w.w);
            }
            if (r < rows_valid) *reinterpret_cast<u32*>(gdQ + r * p.dq_row_stride + c) = pack2<T>(v.x * scale, v.y * scale);
            if (r + 8 < rows_valid) *reinterpret_cast<u32*>(gdQ + (r + 8) * p.dq_row_stride + c) = pack2<T>(v.z * scale, v.w * scale);
        }
    }
}
