// Global <-> shared memory tile movement shared by the attention kernels.
#pragma once
#include "mma.cuh"

// Copy a (kRows x kD) tile whose rows start `row_stride` elements apart into shared memory rows
// kStride elements apart (no default: the kernels' pads differ by element size) (padded so that ldmatrix reads avoid bank conflicts); rows >= rows_valid
// and 16-byte chunks >= chunks_valid (8 columns of 16-bit elements E, 2 of double) become zeros.  kFetchLine: see cp_async_16.  When the
// threads divide the row chunks evenly, thread t always copies column chunk t % kChunks of rows
// t / kChunks + i * kRowStep: addresses are a base plus a constant step, with no division or
// 64-bit multiply per chunk.
// The column at which a swizzled float64 tile (load_tile's kSwz) stores element (r, c): c XOR 4 in
// rows 4-7 of every 8.  With rows of kD + 4 doubles, rows g / columns t (S = Q Kᵀ's operands) and
// rows 2t / columns g (P V's B operand) then both fall on 16 distinct bank pairs in each half-warp.
__device__ __forceinline__ int swizzle_f64(int r, int c) { return c ^ (4 * ((r >> 2) & 1)); }

// kSwz (float64, flash_bwd.cu): element (r, c) is stored at column swizzle_f64(r, c), which
// warp_gemm.cuh's float64 products (steps of 4) read without bank conflicts.
template <int kRows, int kD, int kThreads, int kStride, bool kFetchLine = false, bool kSwz = false, class E>
__device__ __forceinline__ void load_tile(E* smem, const E* g, long long row_stride, int rows_valid,
                                          int chunks_valid, int tid) {
    constexpr int kPer = 16 / sizeof(E), kChunks = kD / kPer;
    static_assert(!kSwz || (sizeof(E) == 8 && kD % 8 == 0), "swizzled tiles: float64, whole 8-column groups");
    if constexpr (kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0) {
        constexpr int kRowStep = kThreads / kChunks;
        const int r0 = tid / kChunks, col = tid % kChunks;
        const bool col_ok = col < chunks_valid;
        const E* src = g + r0 * row_stride + col * kPer;
        E* dst = smem + r0 * kStride + col * kPer;
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; ++i) {
            const int r = r0 + i * kRowStep;
            const bool valid = col_ok && r < rows_valid;  // (kSwz: the chunk moved by the XOR)
            cp_async_16<kFetchLine>(kSwz ? smem + r * kStride + swizzle_f64(r, col * kPer) : dst + i * kRowStep * kStride,
                                    valid ? src : g, valid);
            src += kRowStep * row_stride;
        }
    } else {
#pragma unroll
        for (int c = tid; c < kRows * kChunks; c += kThreads) {
            const int r = c / kChunks, col = c % kChunks;
            const bool valid = r < rows_valid && col < chunks_valid;
            cp_async_16<kFetchLine>(smem + r * kStride + (kSwz ? swizzle_f64(r, col * kPer) : col * kPer),
                                    valid ? g + r * row_stride + col * kPer : g, valid);
        }
    }
}

// load_tile for tiles whose rows are not evenly spaced: row r starts at row_ptr(r) (paged K/V,
// or query rows that interleave tokens and heads).  row_ptr is called only for valid rows;
// `fallback` is any readable address, given to the zero-filling copies of the others.
template <int kRows, int kD, int kThreads, int kStride, bool kFetchLine = false, class RowPtr, class E>
__device__ __forceinline__ void load_tile_rows(E* smem, RowPtr row_ptr, const E* fallback, int rows_valid,
                                               int chunks_valid, int tid) {
    constexpr int kPer = 16 / sizeof(E), kChunks = kD / kPer;
    if constexpr (kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0) {
        constexpr int kRowStep = kThreads / kChunks;  // one row pointer per row a thread copies
        const int r0 = tid / kChunks, col = tid % kChunks;
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; ++i) {
            const int r = r0 + i * kRowStep;
            const bool valid = col < chunks_valid && r < rows_valid;
            cp_async_16<kFetchLine>(smem + r * kStride + col * kPer, valid ? row_ptr(r) + col * kPer : fallback, valid);
        }
    } else {
#pragma unroll
        for (int c = tid; c < kRows * kChunks; c += kThreads) {
            const int r = c / kChunks, col = c % kChunks;
            const bool valid = r < rows_valid && col < chunks_valid;
            cp_async_16<kFetchLine>(smem + r * kStride + col * kPer, valid ? row_ptr(r) + col * kPer : fallback, valid);
        }
    }
}
