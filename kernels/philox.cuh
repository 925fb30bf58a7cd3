// Dropout's keep-mask, drawn exactly as cuflash/dropout.py draws it (the NumPy path and
// cuflash.dropout_mask): Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC 2011) on the counter (j & ~9, i & ~8, b * nheads + h, offset mod 2^32) with the key
// (seed mod 2^32, (seed >> 32) + (offset >> 32) mod 2^32).  One call draws the eight elements of
// rows i, i + 8 and keys j, j + 1, j + 8, j + 9 (i with bit 3 clear; j with bits 0 and 3 clear),
// the ones a thread holds of two 8-key score fragments (mma.cuh's C layout): element (i, j) takes
// 16-bit half (n & 1) of word n >> 1, n = 4 ((i >> 3) & 1) + 2 ((j >> 3) & 1) + (j & 1), and is
// kept when it is below round((1 - dropout_p) 2^16).  The backward regenerates the mask instead of
// storing it (FlashAttention, Dao et al. 2022, §3.1).  Host and device: tests/test_philox.py builds
// it with the host compiler and compares it with the NumPy generator.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define CUFLASH_HOST_DEVICE __host__ __device__
#else
#define CUFLASH_HOST_DEVICE
#endif

struct PhiloxWords {
    unsigned w[4];
};

CUFLASH_HOST_DEVICE inline PhiloxWords philox4x32_10(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0,
                                                     unsigned k1) {
    const unsigned kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) k0 += kW0, k1 += kW1;
#if defined(__CUDA_ARCH__)
        // High and low halves as two multiplies: the 64-bit product's high word cost ptxas an
        // extra add per multiply (nvcc 13.0: 248 -> 192 instructions in a loop of calls).
        const unsigned hi0 = __umulhi(c0, kM0), lo0 = c0 * kM0, hi1 = __umulhi(c2, kM1), lo1 = c2 * kM1;
#else
        const unsigned long long p0 = static_cast<unsigned long long>(c0) * kM0;
        const unsigned long long p1 = static_cast<unsigned long long>(c2) * kM1;
        const unsigned hi0 = static_cast<unsigned>(p0 >> 32), lo0 = static_cast<unsigned>(p0);
        const unsigned hi1 = static_cast<unsigned>(p1 >> 32), lo1 = static_cast<unsigned>(p1);
#endif
        const unsigned n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c1 = lo1, c3 = lo0, c0 = n0, c2 = n2;
    }
    return {{c0, c1, c2, c3}};
}

// The seed and offset of one call (dropout_seed), and the keep threshold round((1 - p) 2^16).
struct DropoutKey {
    unsigned long long seed, offset, threshold;

    // The key's second word (its first is the seed's low word).
    CUFLASH_HOST_DEVICE unsigned key_hi() const { return static_cast<unsigned>((seed >> 32) + (offset >> 32)); }
    // The words of the eight elements drawn with (i, j) (rows i & ~8, | 8; keys j & ~9, | 1, | 8,
    // | 9) of problem bh = b * nheads + h, from the call's 32-bit words (kernels that hold those in
    // uniform registers call this form: ScoreMods::keep_bits).
    CUFLASH_HOST_DEVICE static PhiloxWords draw(unsigned bh, unsigned offset, unsigned k0, unsigned k1, unsigned i, unsigned j) {
        return philox4x32_10(j & ~9u, i & ~8u, bh, offset, k0, k1);
    }
    CUFLASH_HOST_DEVICE PhiloxWords words(unsigned long long bh, unsigned long long i, unsigned long long j) const {
        return draw(static_cast<unsigned>(bh), static_cast<unsigned>(offset), static_cast<unsigned>(seed), key_hi(),
                    static_cast<unsigned>(i), static_cast<unsigned>(j));
    }
    // Bit n of the result: whether element n of `w` (see above) is kept, its draw below `threshold`.
    CUFLASH_HOST_DEVICE static unsigned kept_bits(const PhiloxWords& w, unsigned threshold) {
        unsigned bits = 0;
#pragma unroll
        for (int n = 0; n < 8; ++n) bits |= ((w.w[n >> 1] >> (16 * (n & 1))) & 0xffffu) < threshold ? 1u << n : 0u;
        return bits;
    }
    CUFLASH_HOST_DEVICE unsigned keep_bits(const PhiloxWords& w) const { return kept_bits(w, static_cast<unsigned>(threshold)); }
    // The keep decisions of word w's two elements, its low and high 16-bit draws (elements n and n + 1
    // of keep_bits, n even), without forming the bits: draw < threshold is draw <= threshold - 1, and
    // with limit = (threshold - 1) 2^16 + 0xffff (pair_limit; threshold in [1, 2^16]: dropout_p <=
    // 1 - 2^-10 makes it >= 64) a 32-bit compare tests each half: w <= limit the high one, (w << 16)
    // <= limit the low one (two ISETPs and a shift; sm_90's VIMNMX.U16x2 with two predicate
    // outputs came with two PRMTs from NVRTC 13.0 and saved nothing).
    CUFLASH_HOST_DEVICE static void kept_pair(unsigned w, unsigned limit, bool& lo, bool& hi) {
        lo = (w << 16) <= limit;
        hi = w <= limit;
    }
    CUFLASH_HOST_DEVICE static unsigned pair_limit(unsigned threshold) { return ((threshold - 1u) << 16) | 0xffffu; }
    // The C-fragment layout's decisions (mma.cuh's, which wgmma's accumulators share; the forwards and
    // the dQ kernels): a thread holds rows i, i + 8 (i with bit 3 clear) and keys j, j + 1 of 8-key
    // tiles (j with bits 0 and 3 clear), and the call drawn with (i, j) serves tiles t = 0 (keys j,
    // j + 1) and t = 1 (keys j + 8, j + 9).  kept[e]: element e of tile t's fragment, row i + 8 (e / 2),
    // key j + 8 t + e % 2.
    CUFLASH_HOST_DEVICE static void kept_in_tile(const PhiloxWords& w, int t, unsigned limit, bool (&kept)[4]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) kept_pair(w.w[bit(8 * r, 8 * t) >> 1], limit, kept[2 * r], kept[2 * r + 1]);
    }
    // Half h (0 low, 1 high) of words 2r and 2r + 1, side by side (low, high): with rows i, i + 8 and
    // keys j, j + 1, j + 8, j + 9 drawn, the draws of row i + 8r at keys j + h and j + 8 + h, as
    // kept_pair takes them (one PRMT).
    CUFLASH_HOST_DEVICE static unsigned row_halves(const PhiloxWords& w, int r, unsigned h) {
#if defined(__CUDA_ARCH__)
        return __byte_perm(w.w[2 * r], w.w[2 * r + 1], h ? 0x7632u : 0x5410u);
#else
        return h ? (w.w[2 * r] >> 16) | (w.w[2 * r + 1] & 0xffff0000u) : (w.w[2 * r] & 0xffffu) | (w.w[2 * r + 1] << 16);
#endif
    }
    // Element (i, j)'s bit in keep_bits.
    CUFLASH_HOST_DEVICE static int bit(unsigned long long i, unsigned long long j) {
        return static_cast<int>(4 * ((i >> 3) & 1) + 2 * ((j >> 3) & 1) + (j & 1));
    }
    CUFLASH_HOST_DEVICE bool keep(unsigned long long bh, unsigned long long i, unsigned long long j) const {
        return (keep_bits(words(bh, i, j)) >> bit(i, j)) & 1;
    }
};
