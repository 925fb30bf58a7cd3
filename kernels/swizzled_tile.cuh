// Shared-memory tiles in the layout Hopper's wgmma reads (sm_90a kernels): a (rows x cols) tile
// of 16-bit values is stored as panels of 64 columns, panel after panel; row r of a panel is 128
// bytes, and its 16-byte chunk c sits at chunk position c ^ (r % 8) (the "128-byte swizzle", which
// also keeps cp.async writes and the epilogue's staging free of bank conflicts).  Tiles start at
// 1024-byte boundaries.  The descriptors below address one 16-deep slice of such a tile as a wgmma
// operand (PTX ISA, "Shared Memory Matrix Layout": K-major / MN-major with 128-byte swizzling).
#pragma once
#include "wgmma.cuh"

// Byte offset of 16-byte chunk c (8 elements) of row r in a swizzled tile of kRows rows.
template <int kRows>
__device__ __forceinline__ int swizzled_chunk(int r, int c) {
    return (c / 8) * kRows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16);
}

// Copy a (kRows x kD) tile into a swizzled shared tile; rows >= rows_valid and chunks >= chunks_valid
// become zeros.  When the threads divide the tile evenly, thread t copies chunk t % kChunks of rows
// t / kChunks + i kRowStep; kRowStep is then a multiple of 8, so the swizzle of a thread's chunk is
// the same for all its rows.
template <int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_tile_swizzled(unsigned char* smem, const u16* g, long long row_stride,
                                                   int rows_valid, int chunks_valid, int tid) {
    constexpr int kChunks = kD / 8, kRowStep = kThreads / kChunks;
    if constexpr (kThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0) {
        const int r0 = tid / kChunks, c = tid % kChunks;
        const bool col_ok = c < chunks_valid;
        const u16* src = g + r0 * row_stride + c * 8;
        unsigned char* dst = smem + swizzled_chunk<kRows>(r0, c);
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; ++i) {
            const bool valid = col_ok && r0 + i * kRowStep < rows_valid;
            cp_async_16(dst + i * kRowStep * 128, valid ? src : g, valid);
            src += kRowStep * row_stride;
        }
    } else {
#pragma unroll
        for (int i = tid; i < kRows * kChunks; i += kThreads) {
            const int r = i / kChunks, c = i % kChunks;
            const bool valid = r < rows_valid && c < chunks_valid;
            cp_async_16(smem + swizzled_chunk<kRows>(r, c), valid ? g + r * row_stride + c * 8 : g, valid);
        }
    }
}

// x as lane 0 holds it, a value ptxas knows to be the same in every lane: descriptors formed from
// it live on the uniform datapath.  NVRTC formed the kernels' descriptors from shared-memory
// addresses in vector registers otherwise (~9 ALU instructions a product, on the pipe the softmax
// needs; docs/perf-notes.md h13).  For values that are warp-uniform already; every lane calls it.
__device__ __forceinline__ u32 uniform(u32 x) { return __shfl_sync(0xffffffffu, x, 0); }

// Operand rows [r0, r0 + 64 or N) x head-dim step ks (16 columns) of a tile with kRows rows whose
// rows are the MMA's M or N index and whose columns are its K index (Q and K in S = Q K^T):
// 8-row groups 1024 bytes apart, step ks is 32 bytes into panel ks / 4.
template <int kRows>
__device__ __forceinline__ u64 desc_k_major(u32 tile, int r0, int ks) {
    return make_desc(tile + (ks / 4) * kRows * 128 + r0 * 128 + (ks % 4) * 32, 16, 1024);
}

// Operand rows [16 kk, 16 kk + 16) (the MMA's K index) x all columns (its N index) of a tile with
// kRows rows (V in O += P V): panels kRows * 128 bytes apart, 8-row groups 1024 bytes apart.
template <int kRows>
__device__ __forceinline__ u64 desc_n_major(u32 tile, int kk) {
    return make_desc(tile + kk * 16 * 128, kRows * 128, 1024);
}
