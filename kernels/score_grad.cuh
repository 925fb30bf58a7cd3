// Recomputing P from the scores and the saved LSE in the backward kernels (flash_bwd.cu and
// flash_bwd_sm90.cu), with the softcap derivative; with a bias and mask (prob_mods) as the
// forward's score pipeline forms them (score_mods.cuh).
#pragma once
#include "mma.cuh"
#include "score_mods.cuh"
#include "seqinfo.cuh"

constexpr float kLog2e = 1.4426950408889634f;

// A: float, or double in the float64 kernels; the float forms are the single-precision ones.
// The row's LSE in log2 units, with -inf (no visible key) turned into +inf so that P = 0.
template <class A>
__device__ __forceinline__ A lse_log2(A lse) {
    const A inf = static_cast<A>(__int_as_float(0x7f800000));
    return lse == -inf ? inf : lse * static_cast<A>(1.4426950408889634);
}

// P for one score, and the softcap derivative in dcap.
template <bool kSoftcap, bool kAlibi, class A>
__device__ __forceinline__ A prob(A qk, A scale, A softcap, A slope, int i, int j, int offset, A lse2, A& dcap) {
    constexpr A kL2e = static_cast<A>(1.4426950408889634);
    if constexpr (!kSoftcap && !kAlibi) {
        dcap = 1;
        return acc::exp2_prob(acc::fma(qk, scale * kL2e, -lse2));  // one FFMA per score
    }
    return acc::exp2_prob(final_score_dcap<kSoftcap, kAlibi>(qk, scale, softcap, slope, i, j, offset, dcap) * kL2e - lse2);
}

// The row's LSE as prob_mods reads it: natural units (the forward's kNatural rows: a bias near
// float32's lowest stays finite there), -inf (no visible key) turned into +inf so that P = 0.
template <class A>
__device__ __forceinline__ A lse_natural(A lse) {
    const A inf = static_cast<A>(__int_as_float(0x7f800000));
    return lse == -inf ? inf : lse;
}

// A row's LSE as the backward's P reads it: lse_natural for the kMods kernels, lse_log2 otherwise.
template <bool kMods, class A>
__device__ __forceinline__ A lse_for_prob(A lse) {
    if constexpr (kMods)
        return lse_natural(lse);
    else
        return lse_log2(lse);
}

// P for one score with its bias added after ALiBi, bm from tile_bias_mask (-inf where the boolean
// mask hides the key: P = 0), in natural units against lse_natural; dcap as prob's.  The
// causal/window masks stay the caller's.
template <bool kSoftcap, bool kAlibi, class A>
__device__ __forceinline__ A prob_mods(A qk, A scale, A softcap, A slope, int i, int j, int offset, A lse, A bm, A& dcap) {
    constexpr A kL2e = static_cast<A>(1.4426950408889634);
    return acc::exp2_prob((final_score_dcap<kSoftcap, kAlibi>(qk, scale, softcap, slope, i, j, offset, dcap) + bm - lse) * kL2e);
}

// The bias and mask of a tile of scores in the C-fragment layout (ScoreMods, every load issued
// before any is used): bm[nt][e] for score [nt][e] at query row i, key j = pos(nt, e, i, j), the
// bias there (0 without one; -inf where the mask hides the key).  kRows: the layout of S (rows i, i + 8
// = pos(0, 0) + 0, 8 for e / 2 = 0, 1; keys j0 + 8 nt + e % 2), read row by row; else any (Sᵀ).
// read_mask false: the tile's mask is all True (ScoreMods::tile_state), only the bias is read.
// B: float, or double in the float64 kernels (which read a float64 bias as double).
template <bool kRows, int kNT, class B, class Pos>
__device__ __forceinline__ void tile_bias_mask(const ScoreMods& mods, B (&bm)[kNT][4], Pos pos, bool read_mask = true) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) bm[nt][e] = 0;
    if constexpr (kRows) {
        int i, j0;
        pos(0, 0, i, j0);
#pragma unroll
        for (int half = 0; half < 2; ++half)
            mods.add_bias_mask_row<kNT * 2>(i + 8 * half, j0, [&](int t) -> B& { return bm[t / 2][2 * half + t % 2]; }, read_mask);
    } else {
        mods.add_bias_mask<kNT * 4>([&](int t, int& i, int& j) { pos(t / 4, t % 4, i, j); },
                                    [&](int t) -> B& { return bm[t / 4][t % 4]; }, read_mask);
    }
}

// Runs body(MaskedTile<true>{}) on tiles that need the per-element mask and body(MaskedTile<false>{})
// on the others, so that the element loop of an unmasked tile is straight-line code: a mask test
// inside the loop put every element's exp2 in a basic block of its own (docs/perf-notes.md, h6).
template <bool kMasked>
struct MaskedTile {
    static constexpr bool value = kMasked;
};
template <class Body>
__device__ __forceinline__ void with_tile_mask(bool masked, Body&& body) {
    if (masked) body(MaskedTile<true>{});
    else body(MaskedTile<false>{});
}

// The atomic-dQ backward's last pass (flash_bwd.cu and flash_bwd_sm90.cu, kernel _dq_convert):
// dq = softmax_scale * dq_accum (fp32; float64 for float64) in the element type, for the kBM rows
// of query block blockIdx.x of a sequence (the grid of _dq); rows no key reached are 0 (dq_accum
// starts at 0), a bad sequence's NaN.  16-byte chunks: 8 16-bit elements from two float4, or 4
// floats, or 2 doubles.
template <class T, int kD, int kBM, int kThreads>
__device__ __forceinline__ void dq_convert(const FlashParams& p) {
    using E = typename Elem<T>::Storage;
    using A = typename Elem<T>::Acc;
    constexpr int kPer = 16 / sizeof(E);
    const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * p.nheads_q) return;
    const int b = static_cast<int>(bh / p.nheads_q), h = static_cast<int>(bh % p.nheads_q);
    const SeqInfo seq(p, b);
    __syncthreads();  // seq.poison reads what every thread wrote (racecheck)
    const int m0 = blockIdx.x * kBM;
    if (m0 >= seq.sq) return;
    const int rows_valid = min(kBM, seq.sq - m0), chunks = static_cast<int>(p.headdim_qk / kPer);
    const A scale = seq.poison(static_cast<A>(p.softmax_scale));
    const A* acc = reinterpret_cast<const A*>(p.dq_accum) + seq.lse_row(p, b, h, m0) * kD;
    E* gdQ = static_cast<E*>(p.dq) + b * p.dq_batch_stride + (seq.q_start + m0) * p.dq_row_stride + h * p.dq_head_stride;
    for (int c = threadIdx.x; c < rows_valid * chunks; c += kThreads) {
        const int r = c / chunks, col = c % chunks;
        uint4 chunk;
        if constexpr (sizeof(E) == 2) {
            const float4 lo = *reinterpret_cast<const float4*>(acc + r * kD + col * 8);
            const float4 hi = *reinterpret_cast<const float4*>(acc + r * kD + col * 8 + 4);
            chunk = make_uint4(pack2<T>(lo.x * scale, lo.y * scale), pack2<T>(lo.z * scale, lo.w * scale),
                               pack2<T>(hi.x * scale, hi.y * scale), pack2<T>(hi.z * scale, hi.w * scale));
        } else {
            alignas(16) E v[kPer];
#pragma unroll
            for (int i = 0; i < kPer; ++i) v[i] = static_cast<E>(acc[r * kD + col * kPer + i] * scale);
            chunk = *reinterpret_cast<const uint4*>(v);
        }
        *reinterpret_cast<uint4*>(gdQ + r * p.dq_row_stride + col * kPer) = chunk;
    }
}
