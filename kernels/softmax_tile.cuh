// One online-softmax step on a 16-row tile of raw scores q.k in the C-fragment layout of mma.cuh
// (which wgmma's accumulators share, see wgmma.cuh): score pipeline, mask, running max and sum,
// and P packed to 16 bits as the A operand of O += P V.  Shared by the mma.sync (flash_fwd.cu) and
// wgmma (flash_fwd_sm90.cu) forward kernels.
#pragma once
#include "mma.cuh"
#include "online_softmax.cuh"
#include "score_mods.cuh"
#include "seqinfo.cuh"

template <class A>
struct ScoreArgsT {
    A scale, scale_log2, softcap, slope;  // softmax_scale, times log2(e), softcap, ALiBi slope of the head
};
using ScoreArgs = ScoreArgsT<float>;

// P (fp32, in the C-fragment layout of S) packed to 16 bits as the A operand of O += P V: the C
// fragment of S tile nt is half of the A fragment of P for keys 16(nt/2)..+15, rows lane/4 (+8 for
// e = 2, 3), keys +0..7 (nt even) or +8..15 (nt odd).
template <class T, int kNT>
__device__ __forceinline__ void pack_probs(const float (&p)[kNT][4], u32 (&pk)[kNT / 2][4]) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) pk[nt / 2][half + 2 * (nt % 2)] = pack2<T>(p[nt][half * 2], p[nt][half * 2 + 1]);
}

// s: the (16 x 8 kNT) scores of rows lane/4 (e = 0, 1) and lane/4 + 8 (e = 2, 3), keys n0 + 8 nt +
// 2 (lane % 4) + e % 2; qpos: the query positions of those two rows.  masked: the tile touches a
// band edge or the key tail.  Writes pk (A fragments of P) and alpha (the O rescale per row).
// kKeepFp32: leave P in s (fp32) and pk untouched, for a caller whose previous P is still being
// read from pk by an asynchronous P V (the intra-warpgroup overlap of flash_fwd_sm90.cu); it
// packs P with pack_probs once that product is done.
// kRangeMask: the mask as each row's visible key range, a compare and a select per score instead
// of visible()'s branches (~14 instructions a score on masked tiles); where the caller's registers
// allow it (the Hopper forward's bias/mask/dropout kernels at d192/d256 spill with it).
// kMods: bias and mask from `mods` (ScoreMods) on every tile (kDropout: and dropout), with scores, the running max and
// the LSE in natural units (RowState's kNatural: a bias near float32's lowest stays finite);
// read_mask false: the tile's mask is all True (ScoreMods::tile_state), no mask is read.
// kRaw: the call has no bias (the host's _raw variants), see kRawScores below.
// The float32/float64 kernels (T = f32_t, f64_t) run it in Elem<T>::Acc with kKeepFp32: P stays in s;
// their one modifier form (kMods, kDropout) skips the generator for calls without dropout
// (ScoreMods::dropout_on), and float64 scores read a float64 bias as double.
template <class T, int kNT, bool kSoftcap, bool kAlibi, bool kKeepFp32 = false, bool kRangeMask = false,
          bool kMods = false, bool kDropout = false, bool kRaw = false, class A = typename Elem<T>::Acc>
__device__ __forceinline__ void softmax_tile(A (&s)[kNT][4], RowStateT<A> (&row)[2], u32 (&pk)[kNT / 2][4],
                                             A (&alpha)[2], const int (&qpos)[2], int n0, bool masked,
                                             const SeqInfo& seq, const ScoreArgsT<A>& a, int lane,
                                             const ScoreMods* mods = nullptr, bool read_mask = true) {
    static_assert(!Elem<T>::kWide || kKeepFp32, "float32/float64: P stays in s");
    // Without softcap, ALiBi and bias the max is taken over raw q.k and the scale folded into the
    // exponent; this needs softmax_scale > 0, which the host guarantees (it negates q for a
    // negative scale and zeroes q for a zero scale, both exact).
    constexpr bool kPlain = !kSoftcap && !kAlibi && !kMods;
    // kRaw (kMods kernels for calls without a bias: a mask, dropout): raw q.k as kPlain's, the
    // running max in natural units (the scale times q.k's), P = 2^(q.k scale log2 e - m log2 e) in
    // one FFMA; the scores are finite, so m log2 e cannot overflow.
    constexpr bool kRawScores = kMods && kRaw && !kSoftcap && !kAlibi;
    const A kNegInf = -static_cast<A>(__int_as_float(0x7f800000));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int i = qpos[half];
        if constexpr (kMods) {  // final scores in natural units + bias, -inf where the boolean mask hides the key (the causal/window masks below)
            if constexpr (!kRawScores) {
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        s[nt][half * 2 + e] = final_score<kSoftcap, kAlibi>(s[nt][half * 2 + e], a.scale, a.softcap, a.slope, i,
                                                                            n0 + nt * 8 + (lane % 4) * 2 + e, seq.offset);
            }
            // this row's keys n0 + 8 (t / 2) + 2 (lane % 4) + t % 2, their bias and mask loaded at once
            mods->template add_bias_mask_row<kNT * 2>(i, n0 + (lane % 4) * 2, [&](int t) -> A& { return s[t / 2][half * 2 + t % 2]; },
                                                      read_mask);
        } else if constexpr (!kPlain) {  // softcap / ALiBi: final scores in log2 units
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    s[nt][half * 2 + e] = final_score_log2<kSoftcap, kAlibi>(
                        s[nt][half * 2 + e], a.scale, a.scale_log2, a.softcap, a.slope, i, n0 + nt * 8 + (lane % 4) * 2 + e, seq.offset);
        }
        if (kRangeMask && masked) {  // keys [lo, hi) of row i, relative to this thread's first column
            int lo, hi;
            seq.visible_keys(i, lo, hi);
            const int c0 = n0 + (lane % 4) * 2;
            lo -= c0, hi -= c0;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = nt * 8 + e;
                    s[nt][half * 2 + e] = (c < lo) | (c >= hi) ? kNegInf : s[nt][half * 2 + e];
                }
        } else if (masked) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (!seq.visible(i, n0 + nt * 8 + (lane % 4) * 2 + e)) s[nt][half * 2 + e] = kNegInf;
        }
        auto scaled = [&](A m) {  // a max of raw q.k in log2 (kPlain) or natural (kRawScores) units (scale > 0, so -inf stays -inf)
            if constexpr (kPlain) m = scale_max(m, a.scale_log2);
            if constexpr (kRawScores) m = scale_max(m, a.scale);
            return m;
        };
        auto exact_max = [&]() {  // the row's max over this thread's columns, then over its quad
            A part_max[2] = {kNegInf, kNegInf};
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) part_max[e] = acc::max(part_max[e], s[nt][half * 2 + e]);  // two chains
            return scaled(quad_max(acc::max(part_max[0], part_max[1])));
        };
        A tile_max;
        if constexpr (sizeof(A) == 8) {  // float64: an upper bound within 2^-20, from integer keys (online_softmax.cuh)
            int key[2] = {f64_order_key(s[0][half * 2]), f64_order_key(s[0][half * 2 + 1])};
#pragma unroll
            for (int nt = 1; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) key[e] = max(key[e], f64_order_key(s[nt][half * 2 + e]));
            int k = max(key[0], key[1]);
            k = max(k, __shfl_xor_sync(0xffffffffu, k, 1));
            tile_max = scaled(f64_key_upper(max(k, __shfl_xor_sync(0xffffffffu, k, 2))));
            // The bound is off by up to 2^-20 |max|: from |max| >= 2^19 (log2 or natural units) that is
            // half a unit or more, which would leave the row's largest P below 2^-1/2 (e^-1/2) and, past ~2^30,
            // every P of the row below double's normal range (l = 0: an "empty" row).  There the
            // exact max instead (a warp-uniform branch; scores that large are rare).
            if (__any_sync(0xffffffffu, !(::fabs(tile_max) < static_cast<A>(0x1p19)) && tile_max != kNegInf))
                tile_max = exact_max();
        } else {
            tile_max = exact_max();
        }
        A m_use;
        alpha[half] = row[half].template update_max<kMods>(tile_max, m_use);
        A part_sum[2] = {0, 0};
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            A p0, p1;
            if constexpr (kPlain || kRawScores) {  // 2^(s * scale log2 e - m): one FFMA and one EX2 per score
                const A m_sub = kPlain ? m_use : m_use * static_cast<A>(kLog2eF);
                p0 = acc::exp2_prob(acc::fma(s[nt][half * 2], a.scale_log2, -m_sub));
                p1 = acc::exp2_prob(acc::fma(s[nt][half * 2 + 1], a.scale_log2, -m_sub));
            } else if constexpr (kMods) {  // natural units: the difference first (both may be near float32's lowest)
                constexpr A kL2e = static_cast<A>(1.4426950408889634);
                p0 = acc::exp2_prob((s[nt][half * 2] - m_use) * kL2e);
                p1 = acc::exp2_prob((s[nt][half * 2 + 1] - m_use) * kL2e);
            } else {
                p0 = acc::exp2_prob(s[nt][half * 2] - m_use);
                p1 = acc::exp2_prob(s[nt][half * 2 + 1] - m_use);
            }
            part_sum[nt % 2] += p0 + p1;
            if constexpr (kKeepFp32 || kDropout) {  // (dropout: packed below, once it has run)
                s[nt][half * 2] = p0, s[nt][half * 2 + 1] = p1;
            } else {
                pk[nt / 2][half + 2 * (nt % 2)] = pack2<T>(p0, p1);
            }
        }
        row[half].l += part_sum[0] + part_sum[1];  // this thread's columns; quad-summed at the end
    }
    if constexpr (kDropout) {  // after the row sums (the LSE ignores dropout): one generator call per 8 probabilities
        if (Elem<T>::kWide && !mods->dropout_on()) return;  // (the float32/float64 modifier form without dropout: P as it is)
        const ScoreMods::Draw draw = mods->dropout_draw();
#pragma unroll
        for (int q = 0; q < kNT / 2; ++q) {
            // Rows qpos[0] (bit 3 clear: 16-row warp tiles, no packed rows with dropout) and qpos[1] =
            // qpos[0] + 8, keys j, j + 1 (tile 2q) and j + 8, j + 9 (tile 2q + 1): the call's eight elements.
            const int j = n0 + q * 16 + (lane % 4) * 2;
            const PhiloxWords w = ScoreMods::draw_words(draw, qpos[0], j);
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                bool kept[4];
                DropoutKey::kept_in_tile(w, t, draw.limit, kept);
#pragma unroll
                for (int e = 0; e < 4; ++e) s[2 * q + t][e] = kept[e] ? s[2 * q + t][e] : A(0);
            }
        }
        if constexpr (!kKeepFp32) pack_probs<T, kNT>(s, pk);
    }
}

