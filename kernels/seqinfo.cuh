// SeqInfo: where one (batch, head) problem lives and which keys a block of queries may see.
//
// It answers the same questions for padded batches (seqlens_k optional) and packed variable-length
// batches (cu_seqlens), so the kernels never branch on the input layout.  The visibility rule is
// the one of docs/conventions: key j is visible from query i iff j < sk and
//     i + off - window_left <= j <= i + off + window_right      (each bound only if != -1)
// with off = sk - sq (bottom-right diagonal) or 0 (top-left).
#pragma once
#include "params.cuh"

struct SeqInfo {
    int sq, sk;           // this sequence's query and key lengths
    long long q_start;    // first packed row of this sequence in q/out/lse (0 for padded batches)
    long long k_start;    // first packed row in k/v
    int offset;           // diagonal offset: sk - sq, or 0 for top-left
    int left, right;      // window, -1 = unbounded

    __device__ __forceinline__ SeqInfo(const FlashParams& p, int b) {
        if (p.cu_seqlens_q) {
            q_start = p.cu_seqlens_q[b];
            sq = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
        } else {
            q_start = 0;
            sq = static_cast<int>(p.seqlen_q);
        }
        if (p.cu_seqlens_k) {
            k_start = p.cu_seqlens_k[b];
            sk = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
        } else {
            k_start = 0;
            sk = p.seqlens_k ? p.seqlens_k[b] : static_cast<int>(p.seqlen_k);
        }
        offset = p.top_left ? 0 : sk - sq;
        left = static_cast<int>(p.window_left);
        right = static_cast<int>(p.window_right);
    }

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
