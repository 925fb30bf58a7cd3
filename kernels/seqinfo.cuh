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

// Whether the sequence has invalid metadata (SeqInfo::poison).  Kept in shared memory, not in a
// register that would stay live through the kernels' main loops (where it made ptxas spill); one
// copy per warp, as the batch row below, because the warps of a persistent block (the Hopper
// forward) reach its next tile at different times.
__shared__ int s_seq_bad[32];
// The batch row of K/V (cache_batch_idx[b], or b), likewise in shared memory: a K/V address rebuilt
// from it per tile costs a shared load, where one held in registers through the loop made the
// split-KV kernel spill (a row from memory cannot be recomputed from blockIdx, as b can).
__shared__ int s_kv_b[32];  // one copy per warp (written by its lane 0)
// The first bad entries of cu_seqlens_q and _k as one block of the Hopper forward found them
// (varlen_tail.cuh's check runs in each of its blocks: SeqInfo's `block_checked`).
__shared__ long long s_first_bad[2];

// What SeqInfo's constructor derived from the metadata, for a warp that did not load it (the
// Hopper forward's producer hands it to the consumers with the tile: SeqInfo::shared).
struct SeqShared {
    long long q_start, k_start;
    int sq, sk, bad, kv_b;
};

// x, known to the compiler as equal in every lane of the warp (all 32 lanes call it, with the same
// value): redux.sync leaves its result in a uniform register, outside the per-thread register file.
__device__ __forceinline__ int warp_uniform(int x) { return __reduce_max_sync(0xffffffffu, x); }

struct SeqInfo {
    int sq, sk;           // this sequence's query and key lengths
    long long q_start;    // first packed row of this sequence in q/out/lse (0 for padded batches)
    long long k_start;    // first packed row in k/v
    int offset;           // diagonal offset: sk - sq, or 0 for top-left
    int left, right;      // window, -1 = unbounded

    // Every thread of a warp constructs it at the same point (every warp of the block, but for the
    // Hopper forward, whose warps construct it per tile, at their own pace, and whose idle producer
    // warps never do): what it keeps in shared memory is one copy per warp.
    // The metadata is checked against the extents in p (metadata.cuh), in O(1) per sequence: a
    // sequence whose own values break the rules, or that comes at or after the first bad entry of
    // a malformed cu_seqlens (found by varlen_tail.cuh's check, before: a kernel launched first, or
    // the Hopper forward's own blocks), is bad; whatever the
    // values, sq/sk/q_start/k_start/kv_row() stay inside the arrays (a packed side that cannot be
    // trusted gets no rows: varlen_tail fills those).  No loops or barriers here: in this inlined
    // constructor they made ptxas spill in the main loops of kernels at their register cap.
    // block_table entries are checked by check_pages (split-KV kernel only).
    // The offsets check left the first bad entries in p.offsets_first_bad (the tail kernel launched
    // first), or with `block_checked` in s_first_bad (the Hopper forward's blocks check for themselves).
    __device__ __forceinline__ SeqInfo(const FlashParams& p, int b, bool block_checked = false) {
        const long long* first_bad = block_checked ? s_first_bad : p.offsets_first_bad;
        bool bad = false;
        int arg = -1;
        long long at = b;
        q_start = k_start = 0;
        sq = static_cast<int>(p.seqlen_q);
        sk = static_cast<int>(p.seqlen_k);
        int kv_b = b;
        // Entries b and b + 1 of a cu_seqlens are inside the array (b < batch) whatever the values,
        // so they load at once with the first bad entry; they are used only when entries 0 .. b + 1
        // are well formed, hence within [0, total] (< 2^31, checked on the host): 32-bit values,
        // which keep q_start in one register (two made _dkdv_dq spill).
        if (p.cu_seqlens_q) {
            const long long e = first_bad[0];
            const int lo = static_cast<int>(load_index(p, p.cu_seqlens_q, kIndexCuQ, b));
            const int hi = static_cast<int>(load_index(p, p.cu_seqlens_q, kIndexCuQ, b + 1));
            if (e >= 0 && b + 1 >= e) {  // reported by varlen_tail
                sq = 0;
                bad = true;
            } else {
                q_start = lo;
                sq = hi - lo;
                if (sq > p.seqlen_q) arg = kArgMaxSeqlenQ;  // rows past max_seqlen_q: varlen_tail
            }
        }
        if (p.cu_seqlens_k) {
            const long long e = first_bad[1];
            const int lo = static_cast<int>(load_index(p, p.cu_seqlens_k, kIndexCuK, b));
            const int hi = static_cast<int>(load_index(p, p.cu_seqlens_k, kIndexCuK, b + 1));
            if (e >= 0 && b + 1 >= e) {
                sk = 0;
                bad = true;
            } else {
                k_start = lo;
                sk = hi - lo;
                if (sk > p.seqlen_k) arg = kArgMaxSeqlenK;
            }
        } else if (p.seqlens_k) {
            const long long n = load_index(p, p.seqlens_k, kIndexSeqlensK, b);
            const bool ok = n >= 0 && n <= p.seqlen_k;
            sk = ok ? static_cast<int>(n) : 0;
            if (!ok) arg = kArgSeqlensK;
        }
        if (p.cache_batch_idx) {
            const long long r = load_index(p, p.cache_batch_idx, kIndexBatchIdx, b);
            const bool ok = r >= 0 && r < p.kv_rows;
            kv_b = ok ? static_cast<int>(r) : 0;
            if (!ok) sk = 0, arg = kArgBatchIdx;
        }
        if (p.seq_bad && p.seq_bad[b]) {  // the append kernel refused it and reported why
            sk = 0;
            bad = true;
        }
        if (p.block_table && p.kv_rows <= 0 && sk > 0) {  // a paged cache with no pages: nothing to read
            sk = 0;
            arg = kArgBlockTable, at = b * p.block_table_batch_stride;
        }
        if (arg >= 0 && threadIdx.x == 0) report_bad_index(p, arg, at);
        if (threadIdx.x % 32 == 0) {  // one copy per warp: no block barrier needed
            s_seq_bad[threadIdx.x / 32] = bad || arg >= 0;
            s_kv_b[threadIdx.x / 32] = kv_b;
        }
        __syncwarp();
        set_diagonal(p);
    }

    // The same sequence from another warp's SeqShared (no metadata loads, nothing reported: that
    // warp did both).  Every thread of a warp constructs it at the same point, as above.
    __device__ __forceinline__ SeqInfo(const FlashParams& p, const SeqShared& s)
        : sq(s.sq), sk(s.sk), q_start(s.q_start), k_start(s.k_start) {
        if (threadIdx.x % 32 == 0) {
            s_seq_bad[threadIdx.x / 32] = s.bad;
            s_kv_b[threadIdx.x / 32] = s.kv_b;
        }
        __syncwarp();
        set_diagonal(p);
    }

    // This warp's SeqShared of the sequence.
    __device__ __forceinline__ SeqShared shared() const {
        return {q_start, k_start, sq, sk, s_seq_bad[threadIdx.x / 32], s_kv_b[threadIdx.x / 32]};
    }

    // Paged K/V: the block_table entries of the part-th of `parts` equal shares of the pages in
    // use must be pages of the cache (a split-KV block checks its split's share: every row group
    // has a block per share, and the merge of the splits spreads its NaN); a bad entry makes the
    // sequence bad here with no keys (the other blocks' paged reads clamp bad pages to page 0).
    // Every thread of the block calls it (it synchronises).
    __device__ __forceinline__ void check_pages(const FlashParams& p, int b, int part, int parts) {
        if (!p.block_table || sk <= 0) return;
        const int ps = static_cast<int>(p.page_size);
        const long long row = b * p.block_table_batch_stride;
        const int pages = (sk + ps - 1) / ps, share = (pages + parts - 1) / parts;
        const int lo = min(pages, part * share), hi = min(pages, lo + share);
        auto bad_page = [&](int i) {
            const long long page = load_index(p, p.block_table, kIndexTable, row + i);
            return page < 0 || page >= p.kv_rows;
        };
        bool found = false;  // (a plain loop and one barrier: block_first_bad here made ptxas spill)
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) found |= bad_page(i);
        if (!__syncthreads_or(found)) return;
        if (threadIdx.x == 0)
            for (int i = lo; i < hi; ++i)
                if (bad_page(i)) {
                    report_bad_index(p, kArgBlockTable, row + i);
                    break;
                }
        s_seq_bad[threadIdx.x / 32] = 1;  // by every thread before it reads the flag: no barrier needed
        sk = 0;
        set_diagonal(p);
    }

    // The lengths and offsets as warp-uniform values (warp_uniform): for a kernel at its register cap
    // whose K/V addresses, formed from them, then take uniform registers (the split-KV kernel: d128
    // spilled, and a shared load began every tile's copies, 4 % slower on single-sequence decode).
    // Every thread of the warp calls it at the same point.
    __device__ __forceinline__ void make_warp_uniform() {
        sq = warp_uniform(sq);
        sk = warp_uniform(sk);
        q_start = warp_uniform(static_cast<int>(q_start));  // (32-bit values: the constructor)
        k_start = warp_uniform(static_cast<int>(k_start));
    }

    // Batch row of k/v: cache_batch_idx[b] (checked), or b.
    __device__ __forceinline__ long long kv_row() const { return s_kv_b[threadIdx.x / 32]; }

    __device__ __forceinline__ void set_diagonal(const FlashParams& p) {
        offset = p.top_left ? 0 : sk - sq;
        left = static_cast<int>(p.window_left);
        right = static_cast<int>(p.window_right);
    }

    // x, or NaN for a bad sequence: applied to each row's softmax sum (forward) and to the scale
    // of each gradient store (backward), so that every value written for the sequence is NaN.
    __device__ __forceinline__ float poison(float x) const { return s_seq_bad[threadIdx.x / 32] ? __int_as_float(0x7fffffff) : x; }
    __device__ __forceinline__ double poison(double x) const { return s_seq_bad[threadIdx.x / 32] ? __longlong_as_double(0x7ff8000000000000ll) : x; }

    // Index of query row i of head h in the LSE, and in D and dq_accum, which share its rows.
    __device__ __forceinline__ long long lse_row(const FlashParams& p, int b, int h, int i) const {
        return b * p.lse_batch_stride + h * p.lse_head_stride + q_start + i;
    }

    __device__ __forceinline__ bool visible(int i, int j) const {
        return j < sk && (left < 0 || j >= i + offset - left) && (right < 0 || j <= i + offset + right);
    }

    // Keys [lo, hi) that query row i sees, both in [0, sk] (none when lo >= hi): visible(i, j) iff
    // lo <= j < hi for 0 <= j.  The sums in 64 bits: no wrap whatever the window bounds.
    __device__ __forceinline__ void visible_keys(int i, int& lo, int& hi) const {
        const long long x = static_cast<long long>(i) + offset, n = sk;
        lo = left < 0 ? 0 : static_cast<int>(max(0ll, min(n, x - left)));
        hi = right < 0 ? sk : static_cast<int>(max(0ll, min(n, x + right + 1)));
    }

    // Keys [lo, hi) that any query row in [m0, m1) can see; empty when lo >= hi.
    __device__ __forceinline__ void key_range(int m0, int m1, int& lo, int& hi) const {
        lo = left < 0 ? 0 : max(0, m0 + offset - left);
        hi = right < 0 ? sk : min(sk, m1 - 1 + offset + right + 1);
    }

    // Queries [lo, hi) that see key j, clamped to [m0, m1] (none when lo >= hi): visible(i, j) iff
    // lo <= i < hi for i in [m0, m1).  The sums in 64 bits, as in visible_keys.
    __device__ __forceinline__ void visible_queries(int j, int m0, int m1, int& lo, int& hi) const {
        const long long x = static_cast<long long>(j) - offset;
        const long long l = right < 0 ? m0 : x - right, h = left < 0 ? m1 : x + left + 1;
        lo = static_cast<int>(max(static_cast<long long>(m0), min(static_cast<long long>(m1), l)));
        hi = j < sk ? static_cast<int>(max(static_cast<long long>(m0), min(static_cast<long long>(m1), h))) : lo;
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

// CUFLASH_SCORE_SWITCHES 1 (the float32/float64 modifier form, cuflash/_kernels.py): the kernel is
// built with softcap and ALiBi (kSoftcap and kAlibi true) and the call's values switch them, a
// softcap of 0 and null slopes being off, so that one variant serves the three combinations with
// either (each variant is one more build in CI's compile check).  The branches are uniform over
// the block.
#ifndef CUFLASH_SCORE_SWITCHES
#define CUFLASH_SCORE_SWITCHES 0
#endif
constexpr bool kScoreSwitches = CUFLASH_SCORE_SWITCHES != 0;

// The ALiBi slope of head h of batch entry b: float, or double in the float64 kernels (the host
// passes float64 slopes with float64 inputs, float32 ones otherwise); 0 without slopes where the
// call switches ALiBi (kScoreSwitches).
template <class A>
__device__ __forceinline__ A alibi_slope(const FlashParams& p, int b, int h) {
    if (kScoreSwitches && p.alibi_slopes == nullptr) return A(0);
    const long long i = static_cast<long long>(b) * p.nheads_q + h;
    if constexpr (sizeof(A) == 8) return reinterpret_cast<const double*>(p.alibi_slopes)[i];
    else return p.alibi_slopes[i];
}

// The score pipeline of docs/conventions, in order: scale -> softcap -> ALiBi -> bias -> mask.
// final_score_dcap: scale, softcap and ALiBi in natural units (the caller adds the bias, where
// there is one: softmax_tile.cuh, and applies the masks), and d(final score)/d(scale·q·k) (the
// softcap derivative, for the backward's score_grad.cuh) in dcap; final_score without it.
// A: float, or double in the float64 kernels.
template <bool kSoftcap, bool kAlibi, class A>
__device__ __forceinline__ A final_score_dcap(A qk, A scale, A softcap, A slope, int i, int j, int offset, A& dcap) {
    dcap = 1;
    A s = qk * scale;
    if constexpr (kSoftcap) {
        if (!kScoreSwitches || softcap != A(0)) {
            const A t = acc::tanh(s / softcap);
            s = softcap * t;
            dcap = static_cast<A>(1) - t * t;
        }
    }
    if constexpr (kAlibi)
        if (!kScoreSwitches || slope != A(0)) s -= slope * acc::abs(static_cast<A>(i + offset - j));
    return s;
}
template <bool kSoftcap, bool kAlibi, class A>
__device__ __forceinline__ A final_score(A qk, A scale, A softcap, A slope, int i, int j, int offset) {
    A dcap;  // (unused: the compiler drops its arithmetic)
    return final_score_dcap<kSoftcap, kAlibi>(qk, scale, softcap, slope, i, j, offset, dcap);
}

// The same in log2 units (times log2(e)) so the softmax can use exp2.  Without softcap and ALiBi
// this is a single multiply by scale * log2(e).
template <bool kSoftcap, bool kAlibi, class A>
__device__ __forceinline__ A final_score_log2(A qk, A scale, A scale_log2, A softcap, A slope, int i, int j, int offset) {
    constexpr A kLog2e = static_cast<A>(1.4426950408889634);
    if constexpr (!kSoftcap && !kAlibi) return qk * scale_log2;
    return final_score<kSoftcap, kAlibi>(qk, scale, softcap, slope, i, j, offset) * kLog2e;
}
