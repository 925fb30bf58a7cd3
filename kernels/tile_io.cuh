// Global <-> shared memory tile movement shared by the attention kernels.
#pragma once
#include "mma.cuh"

// Copy a (kRows x kD) tile whose rows start `row_stride` elements apart into shared memory rows
// kStride elements apart (padded so that ldmatrix reads avoid bank conflicts); rows >= rows_valid
// and 8-column chunks >= chunks_valid become zeros.  kFetchLine: see cp_async_16.  When the
// threads divide the row chunks evenly, thread t always copies column chunk t % kChunks of rows
// t / kChunks + i * kRowStep: addresses are a base plus a constant step, with no division or
// 64-bit multiply per chunk.
template <int kRows, int kD, int kThreads, int kStride = kD + 8, bool kFetchLine = false>
__device__ __forceinline__ void load_tile(u16* smem, const u16* g, long long row_stride, int rows_valid,
                                          int chunks_valid, int tid) {
    constexpr int kChunks = kD / 8;
    if constexpr (kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0) {
        constexpr int kRowStep = kThreads / kChunks;
        const int r0 = tid / kChunks, col = tid % kChunks;
        const bool col_ok = col < chunks_valid;
        const u16* src = g + r0 * row_stride + col * 8;
        u16* dst = smem + r0 * kStride + col * 8;
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; ++i) {
            const bool valid = col_ok && r0 + i * kRowStep < rows_valid;
            cp_async_16<kFetchLine>(dst + i * kRowStep * kStride, valid ? src : g, valid);
            src += kRowStep * row_stride;
        }
    } else {
#pragma unroll
        for (int c = tid; c < kRows * kChunks; c += kThreads) {
            const int r = c / kChunks, col = c % kChunks;
            const bool valid = r < rows_valid && col < chunks_valid;
            cp_async_16<kFetchLine>(smem + r * kStride + col * 8, valid ? g + r * row_stride + col * 8 : g, valid);
        }
    }
}

// load_tile for tiles whose rows are not evenly spaced: row r starts at row_ptr(r) (paged K/V,
// or query rows that interleave tokens and heads).  row_ptr is called only for valid rows;
// `fallback` is any readable address, given to the zero-filling copies of the others.
template <int kRows, int kD, int kThreads, int kStride = kD + 8, bool kFetchLine = false, class RowPtr>
__device__ __forceinline__ void load_tile_rows(u16* smem, RowPtr row_ptr, const u16* fallback, int rows_valid,
                                               int chunks_valid, int tid) {
    constexpr int kChunks = kD / 8;
    if constexpr (kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0) {
        constexpr int kRowStep = kThreads / kChunks;  // one row pointer per row a thread copies
        const int r0 = tid / kChunks, col = tid % kChunks;
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; ++i) {
            const int r = r0 + i * kRowStep;
            const bool valid = col < chunks_valid && r < rows_valid;
            cp_async_16<kFetchLine>(smem + r * kStride + col * 8, valid ? row_ptr(r) + col * 8 : fallback, valid);
        }
    } else {
#pragma unroll
        for (int c = tid; c < kRows * kChunks; c += kThreads) {
            const int r = c / kChunks, col = c % kChunks;
            const bool valid = r < rows_valid && col < chunks_valid;
            cp_async_16<kFetchLine>(smem + r * kStride + col * 8, valid ? row_ptr(r) + col * 8 : fallback, valid);
        }
    }
}
