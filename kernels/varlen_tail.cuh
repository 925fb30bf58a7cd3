// Rows of a packed (varlen) array that no well-formed sequence owns; the attention kernels write
// every other row (SeqInfo gives such rows to no block).  With offsets cu = cu_seqlens_q (q side)
// or cu_seqlens_k (k side) over `total` packed rows:
//   - rows [cu[batch], total) of a well-formed cu belong to no sequence: out = 0, lse = -inf
//     (forward; the backward's gradients start at 0);
//   - if cu is malformed from entry e on (metadata.cuh), rows [cu[e - 1], total) (all rows when
//     e = 0) belong to sequences whose rows cannot be trusted: NaN, and the LSE NaN;
//   - rows of a sequence longer than max_seqlen (p.seqlen_q / p.seqlen_k): NaN, reported (the
//     attention kernels reach no row past max_seqlen); also each side's rows of a sequence whose
//     other side is bad (partner_rows: the query rows of one with too many keys, and so on).
// The kernels of varlen_tail.cu run it before the attention kernels (the Hopper forward runs
// forward_tail itself); grid-stride over rows; values are written in 16-byte chunks at the array's
// strides, elements of p.elem_bytes (2, or 4 and 8 for float32/float64); the LSE in float, or
// double for float64.  The 16-bit pattern 0x7fff repeated is NaN in float16, bfloat16, float32
// and float64 alike.
#pragma once
#include "metadata.cuh"
#include "params.cuh"

struct PackedRows {  // one (total, nheads, headdim) array at its strides, in bytes
    void* base;
    long long row_stride, head_stride, heads, chunks;  // chunks: 16-byte chunks a row
};

// The PackedRows of an array of p.elem_bytes elements with element strides and headdim (a multiple
// of 8: whole 16-byte chunks in every dtype).
__device__ __forceinline__ PackedRows packed_rows(const FlashParams& p, void* base, long long row_stride, long long head_stride,
                                                  long long heads, long long headdim) {
    const long long e = p.elem_bytes;
    return {base, row_stride * e, head_stride * e, heads, headdim * e / 16};
}

// Write rows [lo, hi) of each array: `fill` (a 16-byte pattern) into out, `lse_fill` into the LSE
// (float, or double with lse_f64); grid-stride over all threads of the launch.
template <int kArrays>
__device__ __forceinline__ void fill_rows(const PackedRows (&a)[kArrays], long long lo, long long hi, uint4 fill, float* lse,
                                          long long lse_heads, long long lse_stride, float lse_fill, bool lse_f64) {
    if (lo >= hi) return;
    const long long first_thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long rows = hi - lo;
#pragma unroll
    for (int k = 0; k < kArrays; ++k) {
        const long long per_row = a[k].heads * a[k].chunks;
        unsigned char* base = static_cast<unsigned char*>(a[k].base);
        for (long long i = first_thread; i < rows * per_row; i += step) {
            const long long r = lo + i / per_row, h = i % per_row / a[k].chunks, c = i % a[k].chunks;
            *reinterpret_cast<uint4*>(base + r * a[k].row_stride + h * a[k].head_stride + c * 16) = fill;
        }
    }
    if (lse)
        for (long long i = first_thread; i < rows * lse_heads; i += step) {
            const long long at = i / rows * lse_stride + lo + i % rows;
            if (lse_f64) reinterpret_cast<double*>(lse)[at] = lse_fill;
            else lse[at] = lse_fill;
        }
}

// The NaN of the rows of bad sequences: 0x7fff repeated, in every dtype, and in the LSE.
__device__ __forceinline__ uint4 nan_chunk() { return make_uint4(0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu); }
__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fffffff); }

// Length of sequence b of a cu_seqlens whose entries b and b + 1 are well formed.
__device__ __forceinline__ long long seq_len(const FlashParams& p, const void* cu, int bit, long long b) {
    return load_index(p, cu, bit, b + 1) - load_index(p, cu, bit, b);
}

// Whether any of sequences [0, good) of cu is longer than max_len (block-uniform: every thread of
// the block calls it; looked for by the whole block at once).
__device__ __forceinline__ bool any_longer(const FlashParams& p, const void* cu, int bit, long long good, long long max_len) {
    bool found = false;
    for (long long b = threadIdx.x; b < good; b += blockDim.x) found |= seq_len(p, cu, bit, b) > max_len;
    return __syncthreads_or(found);
}

// The first bad entry of cu_seqlens_q and of cu_seqlens_k (-1 when well formed), found by every
// block; published into `first_bad` (two words, when not null) for SeqInfo, and reported by block 0.
// The tail kernels' block 0 publishes to p.offsets_first_bad, for the attention kernels launched
// next; each block of the Hopper forward to a shared pair of its own.
__device__ __forceinline__ void find_bad_offsets(const FlashParams& p, long long* first_bad, long long& e_q, long long& e_k) {
    e_q = first_bad_offset(p, p.cu_seqlens_q, kIndexCuQ, p.batch, p.total_q);
    e_k = first_bad_offset(p, p.cu_seqlens_k, kIndexCuK, p.batch, p.total_k);
    if (first_bad && threadIdx.x == 0) {
        first_bad[0] = e_q;
        first_bad[1] = e_k;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (e_q >= 0) report_bad_index(p, kArgCuSeqlensQ, e_q);
        if (e_k >= 0) report_bad_index(p, kArgCuSeqlensK, e_k);
    }
}

// The rows on this side ("mine": cu_mine, written through `a` and the LSE) of the sequences
// whose offsets on the other side are bad: from the other side's first bad entry on, or longer
// than its max_seqlen (reported as `arg_other` with kReport).  Both sides of a sequence then carry
// its NaN in the calls that launch no attention kernel (max_seqlen_* = 0, or no key rows); the
// attention kernels' SeqInfo does the same otherwise.  With one cu as both sides, the rows of its
// own sequences longer than max_other (varlen_tail).
template <bool kReport, int kArrays>
__device__ __forceinline__ void partner_rows(const FlashParams& p, const void* cu_other, int bit_other, long long e_other,
                                             long long max_other, int arg_other, const void* cu_mine,
                                             int bit_mine, long long e_mine, long long total_mine,
                                             const PackedRows (&a)[kArrays], float* lse) {
    auto my_row = [&](long long b) { return load_index(p, cu_mine, bit_mine, b); };
    const long long good_mine = e_mine < 0 ? p.batch : max(e_mine - 1, 0ll);
    const long long good = min(good_mine, e_other < 0 ? p.batch : max(e_other - 1, 0ll));
    if (good < good_mine)  // malformed other side: my rows of the sequences from its first bad entry on
        fill_rows(a, my_row(good), my_row(good_mine), nan_chunk(), lse, p.nheads_q, total_mine, nan_f32(), p.elem_bytes == 8);
    if (!any_longer(p, cu_other, bit_other, good, max_other)) return;
    for (long long b = 0; b < good; ++b) {
        if (seq_len(p, cu_other, bit_other, b) <= max_other) continue;
        fill_rows(a, my_row(b), my_row(b + 1), nan_chunk(), lse, p.nheads_q, total_mine, nan_f32(), p.elem_bytes == 8);
        if (kReport && blockIdx.x == 0 && threadIdx.x == 0) report_bad_index(p, arg_other, b);
    }
}

template <int kArrays>
__device__ __forceinline__ void varlen_tail(const FlashParams& p, const void* cu, int bit, long long e, long long total,
                                            long long max_len, const PackedRows (&a)[kArrays], float* lse, bool zero_tail,
                                            int max_arg) {
    const float kInf = __int_as_float(0x7f800000);
    const long long batch = p.batch, heads = p.nheads_q;
    if (e < 0) {
        if (zero_tail) fill_rows(a, load_index(p, cu, bit, batch), total, make_uint4(0, 0, 0, 0), lse, heads, total, -kInf, p.elem_bytes == 8);
    } else {
        fill_rows(a, e == 0 ? 0 : load_index(p, cu, bit, e - 1), total, nan_chunk(), lse, heads, total, nan_f32(), p.elem_bytes == 8);
    }
    // Sequences longer than max_len: all their rows NaN and the violation reported (one sequence
    // after another, which only a bad call pays for): partner_rows with this side as both sides.
    // The attention kernels launched next give those sequences NaN too (SeqInfo), but reach no row
    // past max_len, and with max_seqlen_* = 0 no attention kernel runs at all.
    partner_rows<true>(p, cu, bit, e, max_len, max_arg, cu, bit, e, total, a, lse);
}

// The common case in one round of loads and one barrier (the general path takes four of each):
// both offsets well formed, and no sequence longer than its side's max_seqlen.  Every thread of
// the block calls it; when true, q_end is cu_seqlens_q[batch] (where the q side's tail starts)
// and "no bad entry" is published into `first_bad` (when not null; as find_bad_offsets).
__device__ __forceinline__ bool offsets_all_good(const FlashParams& p, long long* first_bad, long long& q_end) {
    __shared__ long long s_q_end;
    bool bad = false;
    for (long long i = threadIdx.x; i <= p.batch; i += blockDim.x) {
        const long long q = load_index(p, p.cu_seqlens_q, kIndexCuQ, i), k = load_index(p, p.cu_seqlens_k, kIndexCuK, i);
        if (i == 0) {
            bad |= q != 0 || k != 0;
        } else {
            const long long q0 = load_index(p, p.cu_seqlens_q, kIndexCuQ, i - 1);
            const long long k0 = load_index(p, p.cu_seqlens_k, kIndexCuK, i - 1);
            bad |= q < q0 || q > p.total_q || q - q0 > p.seqlen_q || k < k0 || k > p.total_k || k - k0 > p.seqlen_k;
        }
        if (i == p.batch) s_q_end = q;
    }
    if (__syncthreads_or(bad)) return false;
    q_end = s_q_end;
    if (first_bad && threadIdx.x == 0) first_bad[0] = first_bad[1] = -1;
    return true;
}

// The forward's part, by every thread of a block: the offsets checked (both sides), the rows of
// out and lse that no well-formed sequence owns written, violations reported.  varlen_tail.cu's
// kernel runs it before the sm_80 forward; the Hopper forward runs it in each of its blocks before
// their tiles.  The first bad entries go to `first_bad` (find_bad_offsets); readers in the block
// __syncthreads() first.
__device__ __forceinline__ void forward_tail(const FlashParams& p, long long* first_bad) {
    const PackedRows out[1] = {packed_rows(p, p.out, p.o_row_stride, p.o_head_stride, p.nheads_q, p.headdim_v)};
    long long q_end;
    if (offsets_all_good(p, first_bad, q_end)) {  // only the rows past the last sequence: 0, and the LSE -inf
        fill_rows(out, q_end, p.total_q, make_uint4(0, 0, 0, 0), p.lse, p.nheads_q, p.total_q, -__int_as_float(0x7f800000),
                  p.elem_bytes == 8);
        return;
    }
    long long e_q, e_k;
    find_bad_offsets(p, first_bad, e_q, e_k);
    varlen_tail(p, p.cu_seqlens_q, kIndexCuQ, e_q, p.total_q, p.seqlen_q, out, p.lse, true, kArgMaxSeqlenQ);
    // (the key side is checked, and reported, here only: the forward writes no key rows)
    partner_rows<true>(p, p.cu_seqlens_k, kIndexCuK, e_k, p.seqlen_k, kArgMaxSeqlenK, p.cu_seqlens_q, kIndexCuQ, e_q,
                       p.total_q, out, p.lse);
}
