// Online softmax for one query row, in log2 units (Milakov & Gimelshein 2018; FlashAttention-2 §3.1).
//
// After each key tile:   m' = max(m, rowmax(S)),   alpha = 2^(m - m'),
//                        P = 2^(S - m'),           l' = alpha * l + rowsum(P),   O' = alpha * O + P V
// and at the end         O = O / l,                lse = (m + log2 l) * ln 2.
// (float64: m' stays m unless rowmax(S) passes it by CUFLASH_F64_MAX_SLACK, below, and rowmax(S)
// is an upper bound within 2^-20 (f64_key_upper); any common m gives the same O and LSE up to
// rounding, with P <= 2^slack.)
// A row that has seen only hidden keys keeps m = -inf; using 0 in its place makes every 2^(...)
// exactly 0 instead of 2^(-inf - -inf) = NaN.  This is the only place that guard lives.
// kNatural (kernels with an additive bias, softmax_tile.cuh): scores and m in natural units
// instead, alpha = 2^((m - m') log2 e) and lse = m + ln l, so that a bias near float32's lowest
// (which times log2 e would overflow to -inf) gives the reference's finite scores: a row whose
// every key carries it averages V, with lse = that bias + ln n.
#pragma once
#include "mma.cuh"

constexpr float kLog2eF = 1.4426950408889634f;

#ifndef CUFLASH_F64_MAX_SLACK
#define CUFLASH_F64_MAX_SLACK 8  // float64: how far (log2 units) the row max may pass the max subtracted before it moves
#endif

// float64's tile max, on the integer pipe (perf-notes f17): a double's high word, its sign folded so
// that signed integer order is the doubles' order (negative ones: magnitude bits flipped), and back
// to the largest double with that high word (its low word all ones if positive, zero if negative).
// The max of the keys so gives an upper bound of the scores' max within 2^-20 of it, which the
// slack allows (RowStateT::update_max: any m at or above the max keeps P <= 2^slack); -inf (hidden
// keys) comes back exactly, a positive NaN and +inf come back as NaN (softmax_tile.cuh's guard then
// takes the exact max).  It spares the FP64 pipe, which the DMMAs
// share, one DSETP a score and the max's dependent chain of them.
__device__ __forceinline__ int f64_order_key(double x) {
    const int hi = __double2hiint(x);
    return hi ^ ((hi >> 31) & 0x7fffffff);
}
__device__ __forceinline__ double f64_key_upper(int key) {
    const int hi = key ^ ((key >> 31) & 0x7fffffff);
    return __hiloint2double(hi, hi >= 0 ? -1 : 0);
}

// The max of raw scores times the (positive) scale: float as it rounds; double rounded down, so that
// the row's largest score gives 2^(s scale - m) >= 1 even where m's ulp is large (scaled scores past
// ~2^60, whose half-ulp rounding would otherwise put that P near or under double's normal range).
__device__ __forceinline__ float scale_max(float m, float scale) { return m * scale; }
__device__ __forceinline__ double scale_max(double m, double scale) { return __dmul_rd(m, scale); }

// A: float, or double in the float64 kernels (mma.cuh, Elem).
template <class A>
struct RowStateT {
    A m = -static_cast<A>(__int_as_float(0x7f800000));  // the max subtracted: the running max of the scores seen (log2 units; float64: within the slack below it)
    A l = 0;                                            // running sum of 2^(s - m) over this thread's columns

    // Take a new tile maximum (already reduced over the row); return (alpha, the max to subtract).
    template <bool kNatural = false>
    __device__ __forceinline__ A update_max(A tile_max, A& m_use) {
        constexpr A kLog2e = static_cast<A>(1.4426950408889634);
        A m_new = acc::max(m, tile_max);
        constexpr bool kF64 = sizeof(A) == 8;
        if constexpr (kF64) {
            // float64 (perf-notes f15): the max subtracted moves only when the row's max passes it by
            // more than CUFLASH_F64_MAX_SLACK (log2 units; FlashAttention-4's conditional rescale), so
            // P may reach 2^slack, far from overflowing a double, and the result is the same up to
            // rounding (the LSE is m + log2 l whichever m); and alpha = 1 without the exp2 where m
            // stayed (a double exp2 is ~16 FP64 instructions, on sm_90 the DMMAs' pipe, formed by
            // each lane for two rows a tile: 2-4 instructions a score).  An empty row (m = -inf)
            // takes its first visible tile's max; while it has none, alpha = 1 (l and O are 0).
            constexpr A kSlack = static_cast<A>(CUFLASH_F64_MAX_SLACK) * (kNatural ? static_cast<A>(0.6931471805599453) : static_cast<A>(1));
            if (!(m_new > m + kSlack)) m_new = m;
        }
        m_use = safe_max(m_new);
        A alpha = 1;
        if (!kF64 || m_new != m)  // m = -inf (first tile): alpha 0, O and l are still 0
            alpha = acc::exp2_prob(kNatural ? (m - m_use) * static_cast<A>(kLog2e) : m - m_use);
        m = m_new;
        l *= alpha;
        return alpha;
    }

    __device__ __forceinline__ static A safe_max(A m) {
        return m == -static_cast<A>(__int_as_float(0x7f800000)) ? static_cast<A>(0) : m;
    }

    // l must already be summed over the threads sharing the row.  Returns 1/l (0 for an empty row)
    // and writes the natural-log LSE: -inf for an empty row, NaN for a row whose scores held a NaN
    // (or overflowed), whose l is then NaN too.
    template <bool kNatural = false>
    __device__ __forceinline__ A finalize(A l_row, A& lse) const {
        constexpr A kLn2 = static_cast<A>(0.6931471805599453);
        bool empty = l_row == static_cast<A>(0);
        lse = empty ? -static_cast<A>(__int_as_float(0x7f800000)) : kNatural ? m + acc::log2(l_row) * kLn2 : (m + acc::log2(l_row)) * kLn2;
        return empty ? static_cast<A>(0) : static_cast<A>(1) / l_row;
    }

    // An output value o / l from finalize's 1/l: exactly 0 for an empty row, whose accumulator
    // may hold 0 * inf = NaN from a non-finite V at keys it cannot see.
    __device__ __forceinline__ static A normalize(A o, A inv_l) {
        return inv_l == static_cast<A>(0) ? static_cast<A>(0) : o * inv_l;
    }
};
using RowState = RowStateT<float>;
