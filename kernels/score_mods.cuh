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
template <> struct ModElem<double> {  // (a float64 bias of the float64 kernels: read as double)
    using Raw = double;
    using Pair = double2;
    static constexpr bool kMask = false;
    __device__ static double value(double x) { return x; }
    __device__ static void split(double2 two, double& a, double& b) { a = two.x, b = two.y; }
};
template <> struct ModElem<half_t> : ModElem16<half_t> {};
template <> struct ModElem<bf16_t> : ModElem16<bf16_t> {};
template <> struct ModElem<bool> {
    using Raw = unsigned char;
    using Pair = unsigned short;
    static constexpr bool kMask = true;
    __device__ static void split(unsigned short two, unsigned char& a, unsigned char& b) {
        a = static_cast<unsigned char>(two & 0xffu), b = static_cast<unsigned char>(two >> 8);
    }
};

// Whether a score reference (what the callers' accessors return) is a double: the float64
// kernels' scores, which read a float64 bias as double (bias_dtype 3) instead of a float32 copy.
template <class R> struct IsDoubleRef {
    static constexpr bool value = false;
};
template <> struct IsDoubleRef<double&> {
    static constexpr bool value = true;
};

// The additive bias and boolean mask of one (batch, head) problem (params.cuh: CUFLASH_MODS
// kernels), read in place through their strides a fragment at a time (add_bias_mask_row,
// add_bias_mask; broadcast axes have stride 0: the same bytes, from L1/L2).  Positions outside the
// problem (rows past sq, keys past sk) read an element inside it; the callers hide those scores.  Step 4 of the score pipeline of docs/conventions (after ALiBi,
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
    // What every generator call of this problem shares, known to the compiler as warp-uniform
    // (redux.sync leaves it in uniform registers): the key words, whose per-round schedule then runs
    // on the uniform datapath, the counter words of the problem and the offset, and the keep limit
    // (DropoutKey::pair_limit of the threshold, for kept_pair).
    // Every lane of the warp calls it; take it once per tile, outside the loop of calls.
    struct Draw {
        unsigned k0, k1, bh, offset, limit;
    };
    // (kOn false: a value never read, for kernels without dropout.)
    template <bool kOn = true>
    __device__ __forceinline__ Draw dropout_draw() const {
        if constexpr (kOn) {
            const DropoutKey key = dropout_key();
            const unsigned long long bh = static_cast<unsigned long long>(b + p.dropout_first_batch) * p.nheads_q + h;
            auto warp_word = [](unsigned long long x) { return __reduce_max_sync(0xffffffffu, static_cast<unsigned>(x)); };
            return {warp_word(key.seed), warp_word(key.key_hi()), warp_word(bh), warp_word(key.offset),
                    warp_word(DropoutKey::pair_limit(static_cast<unsigned>(key.threshold)))};
        } else {
            return {};
        }
    }
    // The words of the eight elements drawn with (i, j) by one generator call (philox.cuh: rows i & ~8,
    // | 8, keys j & ~9, | 1, | 8, | 9 of this problem; batch entries numbered from dropout_first_batch),
    // DropoutKey::words' from the shared part `d`.  Each pair of draws is tested where it is applied
    // (DropoutKey::kept_pair with d.limit), never gathered into bits (DropoutKey::keep_bits: the
    // host's form).
    __device__ __forceinline__ static PhiloxWords draw_words(const Draw& d, int i, int j) {
        return DropoutKey::draw(d.bh, d.offset, d.k0, d.k1, static_cast<unsigned>(i), static_cast<unsigned>(j));
    }
    // The transposed tiles of the dK/dV kernels: lanes lane and lane ^ 4 hold keys j and j ^ 1 (j & 1 =
    // bit 2 of lane) of the same queries i, i + 1 (i even), so the two generator calls those queries
    // need are the same for both lanes: each draws one and sends its partner the halves of the words
    // the partner tests (DropoutKey::row_halves: two words a call; half the Philox work of two calls
    // per lane).  words[q][r]: the draws of query i + q + 8 r at key j (low half) and j + 8 (high
    // half), for kept_in_pair_tile.  Every lane of the warp calls it.
    __device__ __forceinline__ static void keep_words_pair(const Draw& d, int i, int j, int lane, unsigned (&words)[2][2]) {
        const unsigned odd = (lane >> 2) & 1;
        const PhiloxWords w = draw_words(d, i + static_cast<int>(odd), j);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const unsigned mine = DropoutKey::row_halves(w, r, odd);
            const unsigned other = __shfl_xor_sync(0xffffffffu, DropoutKey::row_halves(w, r, odd ^ 1u), 4);
            words[0][r] = odd ? other : mine;
            words[1][r] = odd ? mine : other;
        }
    }
    // The decisions of keep_words_pair's words for tile t (t = 0, 1: queries i + 8 t, i + 1 + 8 t):
    // kept[q][h], query i + q + 8 t at key j + 8 h (the transposed tiles' counterpart of
    // DropoutKey::kept_in_tile).
    __device__ __forceinline__ static void kept_in_pair_tile(const unsigned (&words)[2][2], int t, const Draw& d,
                                                             bool (&kept)[2][2]) {
#pragma unroll
        for (int q = 0; q < 2; ++q) DropoutKey::kept_pair(words[q][t], d.limit, kept[q][0], kept[q][1]);
    }
    // Kept probabilities are multiplied by 1 / (1 - p): the forward applies it with 1 / l at the end
    // (so that P stays in [0, 1] in 16 bits), the backward with the keep-mask (keep_scale).  A: the
    // kernel's accumulator type (float, or double in the float64 kernels).
    template <class A = float>
    __device__ __forceinline__ A out_scale() const { return p.dropout_scale > 0.0 ? static_cast<A>(p.dropout_scale) : A(1); }
    template <class A = float>
    __device__ __forceinline__ A keep_scale(bool kept) const { return kept ? out_scale<A>() : A(0); }
    // Whether the call has dropout: the float32/float64 kernels have one modifier form (CUFLASH_MODS
    // 2) for calls with and without it, and skip the generator when it is off (the draws or keep bits of
    // their callers then start as all kept, and out_scale is 1).
    __device__ __forceinline__ bool dropout_on() const { return p.dropout_scale > 0.0; }
    // The bias gradient: dS at (i, j) added to the accumulator of dbias (p.dbias: float32, float64
    // for the float64 kernels, A; strides 0 on the bias's broadcast axes, which sum there: atomics,
    // not bitwise repeatable; with deterministic=True the host gives a full-size buffer, each element
    // added once, to 0).
    template <class A = float>
    __device__ __forceinline__ void add_dbias(int i, int j, A ds) const {
        if (!p.dbias || i >= sq || j >= sk || ds == A(0)) return;  // (hidden and dropped entries add nothing)
        atomicAdd(reinterpret_cast<A*>(p.dbias) + b * p.dbias_batch_stride + h * p.dbias_head_stride + i * p.dbias_row_stride +
                      j * p.dbias_col_stride, ds);
    }
    // The mask's tile map (mask_tiles.cu), made for a kernel of kBM x kBN tiles (query rows x
    // keys): a tile whose mask is all False is skipped, one that is all True reads no mask
    // (read_mask false below).  A kernel whose tiles are not the map's (the backward's dQ kernel
    // beside a map for the dK/dV kernel) and a call without a map see every tile as mixed, and
    // nothing narrowed.
    template <int kBM, int kBN>
    __device__ __forceinline__ bool has_tile_map() const {
        return p.mask_tiles && p.mask_tile_m == kBM && p.mask_tile_n == kBN;
    }
    __device__ __forceinline__ long long tile_plane() const {
        return (p.mask_batch_stride ? b : 0) * p.mask_tiles_heads + (p.mask_head_stride ? h : 0);
    }
    __device__ __forceinline__ long long tile_row(int mt) const { return tile_plane() * p.mask_tiles_rows + (p.mask_row_stride ? mt : 0); }
    // 0: every entry of query tile mt x key tile nt False, 1: every entry True, 2: both.
    template <int kBM, int kBN>
    __device__ __forceinline__ int tile_state(int mt, int nt) const {
        return has_tile_map<kBM, kBN>() ? __ldg(p.mask_tiles + tile_row(mt) * p.mask_tiles_cols + nt) : 2;
    }
    // Key tiles [lo, hi) of query tile mt narrowed to the span whose mask is not all False (empty: lo >= hi).
    template <int kBM, int kBN>
    __device__ __forceinline__ void narrow_key_tiles(int mt, int& lo, int& hi) const {
        if (!has_tile_map<kBM, kBN>()) return;
        const int2 r = __ldg(reinterpret_cast<const int2*>(p.mask_tile_row_ranges) + tile_row(mt));
        lo = max(lo, static_cast<int>(p.mask_tiles_cols) - r.x);
        hi = min(hi, r.y);
    }
    // Query tiles [lo, hi) of key tile nt likewise.
    template <int kBM, int kBN>
    __device__ __forceinline__ void narrow_query_tiles(int nt, int& lo, int& hi) const {
        if (!has_tile_map<kBM, kBN>()) return;
        const int2 c = __ldg(reinterpret_cast<const int2*>(p.mask_tile_col_ranges) + tile_plane() * p.mask_tiles_cols + nt);
        if (c.y == 0) {
            hi = lo;
        } else if (p.mask_row_stride) {  // (rows broadcast: every query tile sees what row 0 sees)
            lo = max(lo, static_cast<int>(p.mask_tiles_rows) - c.x);
            hi = min(hi, c.y);
        }
    }
    // The key tile next to nb in the direction kStep (-1 or +1), up to and including `last`, whose
    // mask is not all False in query tile mt; past `last` (last - 1 or last + 1): none.
    template <int kBM, int kBN, int kStep>
    __device__ __forceinline__ int step_key_tile(int mt, int nb, int last) const {
        if (!has_tile_map<kBM, kBN>()) return nb + kStep;
        const unsigned char* states = p.mask_tiles + tile_row(mt) * p.mask_tiles_cols;
        do nb += kStep;
        while ((kStep < 0 ? nb >= last : nb <= last) && __ldg(states + nb) == 0);
        return nb;
    }

    // The bias and mask of kN scores at once: the bias added to x(t) (a float&), x(t) = -inf where
    // the mask hides the key.  Every load is issued before any is used, so that one memory latency
    // covers the fragment (element-by-element reads, each waited for in turn, made the bias forward
    // ~7x slower than without it: docs/perf-notes.md, m3).  Positions past the problem (rows past
    // sq, keys past sk) read an element of the problem instead: their values are not defined, and
    // the callers hide those scores themselves (keys: SeqInfo::visible; rows: never stored, or
    // P = 0 by their LSE).
    // Row form: query row i, keys j0 + 8 (t / 2) + t % 2 (j0 even: one row of a C fragment,
    // mma.cuh).  With unit key stride, even strides and alignment, two elements per load at
    // constant offsets from one row pointer (no per-score address arithmetic).
    // x(t) returns a float& (double& in the float64 kernels, which also read bias_dtype 3, float64).
    template <int kN, class X>
    __device__ __forceinline__ void add_bias_mask_row(int i, int j0, X x, bool read_mask = true) const {
        static_assert(kN % 2 == 0, "a row fragment holds key pairs");
        if (p.bias) {
            if (IsDoubleRef<decltype(x(0))>::value && p.bias_dtype == 3) row_gather<double, kN>(i, j0, x);
            else if (p.bias_dtype == 0) row_gather<float, kN>(i, j0, x);
            else if (p.bias_dtype == 1) row_gather<half_t, kN>(i, j0, x);
            else row_gather<bf16_t, kN>(i, j0, x);
        }
        if (p.mask && read_mask) row_gather<bool, kN>(i, j0, x);
    }
    // Any positions: score t at query row i, key j = pos(t, i, j) (the transposed tiles of the
    // dK/dV kernels).  read_mask false: the tile's mask is all True (tile_state 1).
    template <int kN, class Pos, class X>
    __device__ __forceinline__ void add_bias_mask(Pos pos, X x, bool read_mask = true) const {
        if (p.bias) {
            if (IsDoubleRef<decltype(x(0))>::value && p.bias_dtype == 3) gather<double, kN>(pos, x);
            else if (p.bias_dtype == 0) gather<float, kN>(pos, x);
            else if (p.bias_dtype == 1) gather<half_t, kN>(pos, x);
            else gather<bf16_t, kN>(pos, x);
        }
        if (p.mask && read_mask) gather<bool, kN>(pos, x);
    }

    // (The loads: E = float, half_t, bf16_t for the bias, bool for the mask.)
    template <class E> struct Strides {
        const typename ModElem<E>::Raw* base;  // element (b, h, 0, 0)
        long long rs, cs;
        bool pairs;  // two elements per load: unit key stride, even offsets, aligned
    };
    template <class E>
    __device__ __forceinline__ Strides<E> strides() const {
        using Raw = typename ModElem<E>::Raw;
        constexpr bool kMask = ModElem<E>::kMask;
        const long long bs = kMask ? p.mask_batch_stride : p.bias_batch_stride, hs = kMask ? p.mask_head_stride : p.bias_head_stride;
        const long long rs = kMask ? p.mask_row_stride : p.bias_row_stride, cs = kMask ? p.mask_col_stride : p.bias_col_stride;
        const Raw* array = static_cast<const Raw*>(kMask ? static_cast<const void*>(p.mask) : p.bias);
        const long long at = b * bs + h * hs;
        const bool pairs = cs == 1 && (at | rs) % 2 == 0 &&
                           reinterpret_cast<unsigned long long>(array) % sizeof(typename ModElem<E>::Pair) == 0;
        return {array + at, rs, cs, pairs};
    }
    template <class E, class S>
    __device__ __forceinline__ static void use(S& x, typename ModElem<E>::Raw raw) {
        if constexpr (ModElem<E>::kMask) x = raw ? x : -static_cast<S>(__int_as_float(0x7f800000));
        else x += ModElem<E>::value(raw);
    }
    template <class E, int kN, class X>
    __device__ __forceinline__ void row_gather(int i, int j0, X x) const {
        using Raw = typename ModElem<E>::Raw;
        using Pair = typename ModElem<E>::Pair;
        const Strides<E> st = strides<E>();
        const Raw* row = st.base + static_cast<long long>(min(i, sq - 1)) * st.rs;
        if (st.pairs && j0 + 8 * (kN / 2 - 1) + 1 < sk) {  // every key inside: constant offsets
            const Pair* two = reinterpret_cast<const Pair*>(row + j0);
            Pair raw[kN / 2];
#pragma unroll
            for (int u = 0; u < kN / 2; ++u) raw[u] = __ldg(two + 4 * u);
#pragma unroll
            for (int u = 0; u < kN / 2; ++u) {
                Raw lo, hi;
                ModElem<E>::split(raw[u], lo, hi);
                use<E>(x(2 * u), lo);
                use<E>(x(2 * u + 1), hi);
            }
        } else {
            Raw raw[kN];
#pragma unroll
            for (int t = 0; t < kN; ++t) {
                const int j = j0 + 8 * (t / 2) + t % 2;
                raw[t] = __ldg(row + static_cast<long long>(j < sk ? j : 0) * st.cs);
            }
#pragma unroll
            for (int t = 0; t < kN; ++t) use<E>(x(t), raw[t]);
        }
    }
    template <class E, int kN, class Pos, class X>
    __device__ __forceinline__ void gather(Pos pos, X x) const {
        using Raw = typename ModElem<E>::Raw;
        const Strides<E> st = strides<E>();
        Raw raw[kN];
#pragma unroll
        for (int t = 0; t < kN; ++t) {
            int i, j;
            pos(t, i, j);
            raw[t] = __ldg(st.base + static_cast<long long>(min(i, sq - 1)) * st.rs + static_cast<long long>(j < sk ? j : 0) * st.cs);
        }
#pragma unroll
        for (int t = 0; t < kN; ++t) use<E>(x(t), raw[t]);
    }
};
