// SeqInfo: where one (batch, head) problem lives and which keys a block of queries may see.
//
// It answers the same questions for padded batches (seqlens_k optional) and packed variable-length
// batches (cu_seqlens), so the kernels never branch on the input layout.  The visibility rule is
// the one of docs/conventions: key j is visible from query i iff j < sk and
//     i + off - window_left <= j <= i + off + window_right      (each bound only if != -1)
// with off = sk - sq (bottom-right diagonal) or 0 (top-left).
#pragma once
#include "metadata.cuh"
#include "params.cuh"

struct SeqInfo {
    int sq, sk;           // this sequence's query and key lengths
    long long q_start;    // first packed row of this sequence in q/out/lse (0 for padded batches)
    long long k_start;    // first packed row in k/v
    long long kv_b;       // batch row of k/v: cache_batch_idx[b], or b
    int offset;           // diagonal offset: sk - sq, or 0 for top-left
    int left, right;      // window, -1 = unbounded
    bool bad;             // its metadata is invalid: every row of it becomes NaN (poison)

    // Every thread of the block constructs it at the same point (the checks synchronise the block).
    // The metadata is checked against the extents in p (metadata.cuh): a sequence whose own
    // values, or any earlier offset of a malformed cu_seqlens, break the rules is bad; whatever
    // the values, sq/sk/q_start/k_start/kv_b stay inside the arrays (a packed side that cannot be
    // trusted gets no rows: the varlen_tail kernel fills those).  block_table entries are checked
    // for the part-th of `parts` equal shares of the pages in use (a split-KV block checks its
    // split's share; the merge of the splits spreads the NaN); paged reads clamp bad pages anyway.
    __device__ __forceinline__ SeqInfo(const FlashParams& p, int b, int part = 0, int parts = 1) {
        bad = false;
        int arg = -1;
        long long at = 0;
        auto fail = [&](int a, long long index) {
            if (arg < 0) arg = a, at = index;
            bad = true;
        };
        q_start = 0;
        sq = static_cast<int>(p.seqlen_q);
        if (p.cu_seqlens_q) {
            const long long e = first_bad_offset(p, p.cu_seqlens_q, kIndexCuQ, b + 1, p.total_q);
            if (e >= 0) {
                sq = 0;
                fail(kArgCuSeqlensQ, e);
            } else {
                q_start = load_index(p, p.cu_seqlens_q, kIndexCuQ, b);
                const long long n = load_index(p, p.cu_seqlens_q, kIndexCuQ, b + 1) - q_start;
                sq = static_cast<int>(n);
                if (n > p.seqlen_q) fail(kArgMaxSeqlenQ, b);  // rows past max_seqlen_q: varlen_tail
            }
        }
        k_start = 0;
        sk = static_cast<int>(p.seqlen_k);
        if (p.cu_seqlens_k) {
            const long long e = first_bad_offset(p, p.cu_seqlens_k, kIndexCuK, b + 1, p.total_k);
            if (e >= 0) {
                sk = 0;
                fail(kArgCuSeqlensK, e);
            } else {
                k_start = load_index(p, p.cu_seqlens_k, kIndexCuK, b);
                const long long n = load_index(p, p.cu_seqlens_k, kIndexCuK, b + 1) - k_start;
                sk = static_cast<int>(n);
                if (n > p.seqlen_k) fail(kArgMaxSeqlenK, b);
            }
        } else if (p.seqlens_k) {
            const long long n = load_index(p, p.seqlens_k, kIndexSeqlensK, b);
            sk = n < 0 || n > p.seqlen_k ? 0 : static_cast<int>(n);
            if (n < 0 || n > p.seqlen_k) fail(kArgSeqlensK, b);
        }
        kv_b = b;
        if (p.cache_batch_idx) {
            const long long r = load_index(p, p.cache_batch_idx, kIndexBatchIdx, b);
            if (r < 0 || r >= p.kv_rows) {
                kv_b = 0;
                sk = 0;
                fail(kArgBatchIdx, b);
            } else {
                kv_b = r;
            }
        }
        if (p.seq_bad && p.seq_bad[b]) {  // the append kernel refused it and reported why
            sk = 0;
            bad = true;
        }
        if (p.block_table && sk > 0) {
            const long long ps = p.page_size, row = b * p.block_table_batch_stride;
            const long long pages = (sk + ps - 1) / ps, share = (pages + parts - 1) / parts;
            const long long lo = min(pages, part * share), hi = min(pages, lo + share);
            const long long j = block_first_bad(lo, hi, [&](long long i) {
                const long long page = load_index(p, p.block_table, kIndexTable, row + i);
                return page < 0 || page >= p.kv_rows;
            });
            if (j >= 0) {
                sk = 0;
                fail(kArgBlockTable, row + j);
            }
        }
        if (arg >= 0 && threadIdx.x == 0) report_bad_index(p, arg, at);
        offset = p.top_left ? 0 : sk - sq;
        left = static_cast<int>(p.window_left);
        right = static_cast<int>(p.window_right);
    }

    // x, or NaN for a bad sequence: applied to each row's softmax sum (forward) and to the scale
    // of each gradient store (backward), so that every value written for the sequence is NaN.
    __device__ __forceinline__ float poison(float x) const { return bad ? __int_as_float(0x7fffffff) : x; }

    // Index of query row i of head h in the LSE, and in D and dq_accum, which share its rows.
    __device__ __forceinline__ long long lse_row(const FlashParams& p, int b, int h, int i) const {
        return b * p.lse_batch_stride + h * p.lse_head_stride + q_start + i;
    }

    __device__ __forceinline__ bool visible(int i, int j) const {
        return j < sk && (left < 0 || j >= i + offset - left) && (right < 0 || j <= i + offset + right);
    }

    // Keys [lo, hi) that any query row in [m0, m1) can see; empty when lo >= hi.
    __device__ __forceinline__ void key_range(int m0, int m1, int& lo, int& hi) const {
        lo = left < 0 ? 0 : max(0, m0 + offset - left);
        hi = right < 0 ? sk : min(sk, m1 - 1 + offset + right + 1);
    }

    // Queries [lo, hi) that can see any key in [n0, n1) (the backward's loop over query blocks).
    __device__ __forceinline__ void query_range(int n0, int n1, int& lo, int& hi) const {
        lo = right < 0 ? 0 : max(0, n0 - offset - right);
        hi = left < 0 ? sq : min(sq, n1 - 1 - offset + left + 1);
    }

    // True when every (i, j) of the tile rows [m0, m1) x keys [n0, n1) is visible: such tiles
    // skip the per-element mask (only tiles on the band edges and the key tail pay for it).
    __device__ __forceinline__ bool tile_all_visible(int m0, int m1, int n0, int n1) const {
        return n1 <= sk && (left < 0 || n0 >= m1 - 1 + offset - left) && (right < 0 || n1 - 1 <= m0 + offset + right);
    }
};

// The score pipeline of docs/conventions, in order: scale -> softcap -> ALiBi -> mask.
// Returns the final score in log2 units (times log2(e)) so the softmax can use exp2; the caller
// applies the mask.  Without softcap and ALiBi this is a single multiply by scale * log2(e).
template <bool kSoftcap, bool kAlibi>
__device__ __forceinline__ float final_score_log2(float qk, float scale, float scale_log2, float softcap,
                                                  float slope, int i, int j, int offset) {
    constexpr float kLog2e = 1.4426950408889634f;
    if constexpr (!kSoftcap && !kAlibi) return qk * scale_log2;
    float s = qk * scale;
    if constexpr (kSoftcap) s = softcap * tanhf(s / softcap);
    if constexpr (kAlibi) s -= slope * fabsf(static_cast<float>(i + offset - j));
    return s * kLog2e;
}
