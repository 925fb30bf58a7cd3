// Score modifiers of one (batch, head) problem: an additive bias, a boolean mask and dropout, read
// in place through their strides (params.cuh, the CUFLASH_MODS kernels).  Used by the forward's
// score pipeline (softmax_tile.cuh) and by the backward's P and dS (score_grad.cuh, flash_bwd.cu and
// flash_bwd_sm90.cu),
// so that both passes see the same scores and the same keep-mask.
#pragma once
#include "mma.cuh"
#include "params.cuh"
#include "philox.cuh"

// How bias and mask elements are stored (E: float, half_t, bf16_t, or bool for the mask): one
// element's raw bits, two adjacent ones read in one load, and the bias value in float.
template <class E> struct ModElem;
template <> struct ModElem<float> {
    using Raw = float;
    using Pair = float2;
    static constexpr bool kMask = false;
    __device__ static float value(float x) { return x; }
    __device__ static void split(float2 two, float& a, float& b) { a = two.x, b = two.y; }
};
template <class T> struct ModElem16 {  // fp16 / bf16
    using Raw = u16;
    using Pair = u32;
    static constexpr bool kMask = false;
    __device__ static float value(u16 x) { return to_float<T>(x); }
    __device__ static void split(u32 two, u16& a, u16& b) { a = static_cast<u16>(two & 0xffffu), b = static_cast<u16>(two >> 16); }
};
template <> struct ModElem<half_t> : ModElem16<half_t> {};
template <> struct ModElem<bf16_t> : ModElem16<bf16_t> {};
template <> struct ModElem<bool> {
    using Raw = unsigned char;
    using Pair = unsigned short;
    static constexpr bool kMask = true;
    __device__ static float value(unsigned char) { return 0.f; }
    __device__ static void split(unsigned short two, unsigned char& a, unsigned char& b) {
        a = static_cast<unsigned char>(two & 0xffu), b = static_cast<unsigned char>(two >> 8);
    }
};

// The additive bias and boolean mask of one (batch, head) problem (params.cuh: CUFLASH_MODS
// kernels), read in place through their strides a fragment at a time (bias_mask; broadcast axes
// have stride 0: the same bytes, from L1/L2).  Entries outside the problem (rows past sq, keys past
// sk) are never read: bias 0 and hidden there.  Step 4 of the score pipeline of docs/conventions (after ALiBi,
// before the causal/window masks); a mask entry of 0 hides the key like those masks.
struct ScoreMods {
    // Reads its pointers and strides from the kernel's parameters (a __grid_constant__ struct:
    // constant-bank operands) at each use instead of holding them in registers through the main loop.
    const FlashParams& p;
    int b, h, sq, sk;

    // Dropout (after the row statistics: the LSE ignores it).  The call's seed, offset and keep
    // threshold: the seed and offset from the kernel parameters, or read on the device from a (2,)
    // int64 array (dropout_seed_ptr: a captured graph's replays see the values written there since).
    __device__ __forceinline__ DropoutKey dropout_key() const {
        const unsigned long long seed = p.dropout_seed_ptr ? __ldg(p.dropout_seed_ptr) : p.dropout_seed;
        const unsigned long long offset = p.dropout_seed_ptr ? __ldg(p.dropout_seed_ptr + 1) : p.dropout_offset;
        return DropoutKey{seed, offset, static_cast<unsigned long long>(p.dropout_threshold)};
    }
    // The keep decisions of the eight elements drawn with (i, j) by one generator call (philox.cuh:
    // rows i & ~8, | 8, keys j & ~9, | 1, | 8, | 9 of this problem; batch entries numbered from
    // dropout_first_batch), element (i', j')'s in bit DropoutKey::bit(i', j') (kept()).
    __device__ __forceinline__ unsigned keep_bits(int i, int j) const {
        const DropoutKey key = dropout_key();
        const unsigned long long bh = static_cast<unsigned long long>(b + p.dropout_first_batch) * p.nheads_q + h;
        return key.keep_bits(key.words(bh, static_cast<unsigned>(i), static_cast<unsigned>(j)));
    }
    __device__ __forceinline__ static bool kept(unsigned bits, int i, int j) { return (bits >> DropoutKey::bit(i, j)) & 1; }
    // Kept probabilities are multiplied by 1 / (1 - p): the forward applies it with 1 / l at the end
    // (so that P stays in [0, 1] in 16 bits), the backward with the keep-mask (keep_scale).
    __device__ __forceinline__ float out_scale() const { return p.dropout_scale > 0.0 ? static_cast<float>(p.dropout_scale) : 1.f; }
    __device__ __forceinline__ float keep_scale(unsigned bits, int i, int j) const { return kept(bits, i, j) ? out_scale() : 0.f; }
    // The bias gradient: dS at (i, j) added to the float32 accumulator of dbias (p.dbias; strides 0
    // on the bias's broadcast axes, which sum there: atomics, not bitwise repeatable; with
    // deterministic=True the host gives a full-size buffer, each element added once, to 0).
    __device__ __forceinline__ void add_dbias(int i, int j, float ds) const {
        if (!p.dbias || i >= sq || j >= sk || ds == 0.f) return;  // (hidden and dropped entries add nothing)
        atomicAdd(p.dbias + b * p.dbias_batch_stride + h * p.dbias_head_stride + i * p.dbias_row_stride + j * p.dbias_col_stride, ds);
    }
    // Adds the bias to kN scores at once and sets those the mask hides to -inf (with a mask, also
    // those outside the problem): score t is x(t) (a float&), at query row i and key j = pos(t, i, j).
    // Every load is issued before any is used, so that one memory latency covers the fragment
    // (element-by-element reads, each waited for in turn, made the bias forward ~7x slower than
    // without it: docs/perf-notes.md, m3).  kPairs: scores 2u and 2u + 1 are keys j, j + 1 (j even)
    // of one row, read as one load of two elements where the strides and alignment allow it.
    template <bool kPairs, int kN, class Pos, class X>
    __device__ __forceinline__ void add_bias_mask(Pos pos, X x) const {
        if (p.bias) {
            if (p.bias_dtype == 0) gather<kPairs, float, kN>(pos, x);
            else if (p.bias_dtype == 1) gather<kPairs, half_t, kN>(pos, x);
            else gather<kPairs, bf16_t, kN>(pos, x);
        }
        if (p.mask) gather<kPairs, bool, kN>(pos, x);
    }
    // (add_bias_mask's loads: E = float, half_t, bf16_t for the bias, bool for the mask.)  Positions
    // outside the problem read element (0, 0) of the problem instead, and count as bias 0 / hidden.
    template <bool kPairs, class E, int kN, class Pos, class X>
    __device__ __forceinline__ void gather(Pos pos, X x) const {
        using Raw = typename ModElem<E>::Raw;
        using Pair = typename ModElem<E>::Pair;
        constexpr bool kMask = ModElem<E>::kMask;
        const long long bs = kMask ? p.mask_batch_stride : p.bias_batch_stride, hs = kMask ? p.mask_head_stride : p.bias_head_stride;
        const long long rs = kMask ? p.mask_row_stride : p.bias_row_stride, cs = kMask ? p.mask_col_stride : p.bias_col_stride;
        const Raw* array = static_cast<const Raw*>(kMask ? static_cast<const void*>(p.mask) : p.bias);
        const Raw* base = array + b * bs + h * hs;
        auto use = [&](int t, Raw raw) {
            int i, j;
            pos(t, i, j);
            const bool in = i < sq && j < sk;
            if constexpr (kMask) x(t) = in && raw ? x(t) : -__int_as_float(0x7f800000);
            else x(t) += in ? ModElem<E>::value(raw) : 0.f;
        };
        // Two elements per load: unit key stride, an even key count (a pair never passes the last
        // key) and every pair's address a multiple of two elements.
        const bool pairs = kPairs && cs == 1 && sk % 2 == 0 && ((b * bs + h * hs) | rs) % 2 == 0 &&
                           reinterpret_cast<unsigned long long>(array) % sizeof(Pair) == 0;
        if (pairs) {
            Pair raw[kN / 2];
#pragma unroll
            for (int t = 0; t < kN; t += 2) {
                int i, j;
                pos(t, i, j);
                raw[t / 2] = __ldg(reinterpret_cast<const Pair*>(base + (i < sq && j < sk ? i * rs + j : 0)));
            }
#pragma unroll
            for (int t = 0; t < kN; t += 2) {
                Raw lo, hi;
                ModElem<E>::split(raw[t / 2], lo, hi);
                use(t, lo);
                use(t + 1, hi);
            }
        } else {
            Raw raw[kN];
#pragma unroll
            for (int t = 0; t < kN; ++t) {
                int i, j;
                pos(t, i, j);
                raw[t] = __ldg(base + (i < sq && j < sk ? i * rs + j * cs : 0));
            }
#pragma unroll
            for (int t = 0; t < kN; ++t) use(t, raw[t]);
        }
    }
};
