// Dropout's keep-mask, drawn exactly as cuflash/dropout.py draws it (the NumPy path and
// cuflash.dropout_mask): Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC 2011) on the counter (j >> 2, i, b * nheads + h, offset mod 2^32) with the key
// (seed mod 2^32, (seed >> 32) + (offset >> 32) mod 2^32); element (b, h, i, j) is kept when word
// j & 3 of the output is below round((1 - dropout_p) 2^32).  Each call gives four consecutive keys'
// words, so the backward regenerates the mask instead of storing it (FlashAttention, Dao et al.
// 2022, §3.1).  Host and device: tests/test_philox.py builds it with the host compiler and
// compares it with the NumPy generator.
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
#pragma unroll 1  // (rolled: unrolled, the calls of a tile's elements overlapped and the kernels spilled)
    for (int r = 0; r < 10; ++r) {
        if (r) k0 += kW0, k1 += kW1;
        const unsigned long long p0 = static_cast<unsigned long long>(c0) * kM0;  // one wide multiply each
        const unsigned long long p1 = static_cast<unsigned long long>(c2) * kM1;
        const unsigned n0 = static_cast<unsigned>(p1 >> 32) ^ c1 ^ k0, n2 = static_cast<unsigned>(p0 >> 32) ^ c3 ^ k1;
        c1 = static_cast<unsigned>(p1), c3 = static_cast<unsigned>(p0), c0 = n0, c2 = n2;
    }
    return {{c0, c1, c2, c3}};
}

// The seed and offset of one call (dropout_seed), and the keep threshold round((1 - p) 2^32).
struct DropoutKey {
    unsigned long long seed, offset, threshold;

    // The words of keys 4 (j >> 2) .. 4 (j >> 2) + 3 of query row i of problem bh = b * nheads + h.
    CUFLASH_HOST_DEVICE PhiloxWords words(unsigned long long bh, unsigned long long i, unsigned long long j) const {
        const unsigned k0 = static_cast<unsigned>(seed), k1 = static_cast<unsigned>((seed >> 32) + (offset >> 32));
        return philox4x32_10(static_cast<unsigned>(j >> 2), static_cast<unsigned>(i), static_cast<unsigned>(bh),
                             static_cast<unsigned>(offset), k0, k1);
    }
    CUFLASH_HOST_DEVICE bool keep(unsigned word) const { return word < threshold; }
    CUFLASH_HOST_DEVICE bool keep(unsigned long long bh, unsigned long long i, unsigned long long j) const {
        return keep(words(bh, i, j).w[j & 3]);
    }
};
