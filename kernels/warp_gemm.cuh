// Warp-level matrix products on 16-row slabs, built from mma.sync m16n8k16 (see mma.cuh for the
// fragment layouts).  Shared-memory tiles are row-major with rows kStride elements apart.
#pragma once
#include "mma.cuh"

// acc (16 x kN) += A (16 x kD) · Bᵀ, where A is 16 rows at sA and B is kN rows at sB, both
// (rows, kD) in shared memory.  Q·Kᵀ in the attention sense: contract over the head dim.
template <class T, int kD, int kN, int kStride>
__device__ __forceinline__ void warp_gemm_abt(float (&acc)[kN / 8][4], const u16* sA, const u16* sB, int lane) {
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
        u32 a[4];
        ldmatrix_x4(a, sA + (lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
#pragma unroll
        for (int np = 0; np < kN / 16; ++np) {
            u32 b[4];  // B fragments of rows 16np..+7 (b[0..1]) and +8..15 (b[2..3])
            ldmatrix_x4(b, sB + (np * 16 + (lane / 16) * 8 + lane % 8) * kStride + ks * 16 + ((lane / 8) % 2) * 8);
            mma_16x8x16<T>(acc[2 * np], a, b[0], b[1]);
            mma_16x8x16<T>(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// acc (16 x kD) += P (16 x kK, A fragments in registers) · B, where B is kK rows at sB, (kK, kD)
// in shared memory.  P·V in the attention sense: contract over the keys.
template <class T, int kK, int kD, int kStride>
__device__ __forceinline__ void warp_gemm_rb(float (&acc)[kD / 8][4], const u32 (&pa)[kK / 16][4], const u16* sB, int lane) {
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
            u32 b[4];  // B fragments of columns 16dp..+7 (b[0..1]) and +8..15 (b[2..3])
            ldmatrix_x4_trans(b, sB + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dp * 16 + (lane / 16) * 8);
            mma_16x8x16<T>(acc[2 * dp], pa[kk], b[0], b[1]);
            mma_16x8x16<T>(acc[2 * dp + 1], pa[kk], b[2], b[3]);
        }
    }
}

// float64 products: the shape of one tensor-core step.  sm_90 has 16-row shapes (m16n8k4, m16n8k8,
// PTX ISA 7.8); its m8n8k4 peaks near half the float64 matmul's rate (perf-notes f10: the H200's
// float64 forward ran 1.4-1.6x faster on m16n8k8).  sm_80 has m8n8k4 only: two of them stacked make
// the 16-row C fragment.  CUFLASH_F64_MMA: 8 (m16n8k8), 4 (m16n8k4; flash_bwd.cu's choice) or 0
// (m8n8k4 pairs, sm_80).
#ifndef CUFLASH_F64_MMA
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUFLASH_F64_MMA 8
#else
#define CUFLASH_F64_MMA 0
#endif
#endif
#if CUFLASH_F64_MMA != 0 && CUFLASH_F64_MMA != 4 && CUFLASH_F64_MMA != 8
#error "CUFLASH_F64_MMA: 0 (m8n8k4 pairs), 4 (m16n8k4) or 8 (m16n8k8)"
#endif

// float64 (mma.cuh's f64 shapes): the same 16-row slabs and C-fragment layout as the 16-bit
// products; operands read from shared memory with plain 64-bit loads (ldmatrix has no 64-bit
// form).  acc (16 x kN) += A (16 x kD) · Bᵀ, as warp_gemm_abt.
// kSwz (steps of 4, flash_bwd.cu): the tiles are stored with tile_io.cuh's swizzle_f64 (columns
// XOR 4 in rows 4-7 of every 8), which both read patterns (rows g, columns t here; rows 2t,
// columns g in warp_gemm_cb_f64) take without bank conflicts; tiles start on rows and columns
// that are multiples of 8.
template <int kD, int kN, int kStride, bool kSwz = false>
__device__ __forceinline__ void warp_gemm_abt_f64(double (&acc)[kN / 8][4], const double* sA, const double* sB, int lane) {
    const int g = lane / 4, t = lane % 4;
#if CUFLASH_F64_MMA == 8
    static_assert(kD % 8 == 0 && !kSwz, "k steps of 8 (swizzled tiles: steps of 4)");
#pragma unroll
    for (int ks = 0; ks < kD / 8; ++ks) {
        const double* a = sA + g * kStride + ks * 8 + t;
        const double av[4] = {a[0], a[8 * kStride], a[4], a[8 * kStride + 4]};  // (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
#pragma unroll
        for (int nt = 0; nt < kN / 8; ++nt) {
            const double* b = sB + (nt * 8 + g) * kStride + ks * 8 + t;
            mma_16x8x8_f64(acc[nt], av, b[0], b[4]);
        }
    }
#else
    // (kSwz: column 4 ks + t of rows g, g + 8 and nt * 8 + g is stored at 4 (ks ^ s) + t, s = bit 2 of g)
    static_assert(!kSwz || kD % 8 == 0, "swizzled tiles: whole 8-column groups");
    const int swz = kSwz ? 4 * ((g >> 2) & 1) : 0;
#pragma unroll
    for (int ks = 0; ks < kD / 4; ++ks) {
        // (kSwz only: indexing through c without the swizzle changed ptxas's code for the ordered
        // float64 backward kernels, which session 28 kept as they were)
        const int c = ks * 4 + t + (ks % 2 ? -swz : swz);
        const double a_hi = kSwz ? sA[g * kStride + c] : sA[g * kStride + ks * 4 + t];
        const double a_lo = kSwz ? sA[(g + 8) * kStride + c] : sA[(g + 8) * kStride + ks * 4 + t];
#pragma unroll
        for (int nt = 0; nt < kN / 8; ++nt) {
            const double b = kSwz ? sB[(nt * 8 + g) * kStride + c] : sB[(nt * 8 + g) * kStride + ks * 4 + t];
#if CUFLASH_F64_MMA == 4
            mma_16x8x4_f64(acc[nt], a_hi, a_lo, b);
#else
            mma_8x8x4_f64(acc[nt][0], acc[nt][1], a_hi, b);
            mma_8x8x4_f64(acc[nt][2], acc[nt][3], a_lo, b);
#endif
        }
    }
#endif
}

// acc (16 x kD) += P (16 x kK, C fragments as S left them) · B (kK rows at sB).  The order of the
// keys inside the contraction is free, so lane t takes the keys its C fragment already holds (P
// never moves between lanes) and B's rows follow: with k steps of 8, tile nt's k = t is the key
// 8 nt + 2 t and k = t + 4 the key 8 nt + 2 t + 1 (as warp_gemm_cb_f32); with steps of 4, step
// (nt, e) gives k = t the key 8 nt + 2 t + e.
// (kSwz: as warp_gemm_abt_f64's; column g of row 8 nt + 2t + e is stored at g ^ 4 (bit 1 of t))
template <int kK, int kD, int kStride, bool kSwz = false>
__device__ __forceinline__ void warp_gemm_cb_f64(double (&acc)[kD / 8][4], const double (&p)[kK / 8][4], const double* sB, int lane) {
    const int g = lane / 4, t = lane % 4;
#if CUFLASH_F64_MMA == 8
    static_assert(!kSwz, "swizzled tiles: steps of 4");
#pragma unroll
    for (int nt = 0; nt < kK / 8; ++nt) {
        const double pv[4] = {p[nt][0], p[nt][2], p[nt][1], p[nt][3]};  // (g, 2t), (g + 8, 2t), (g, 2t + 1), (g + 8, 2t + 1)
        const double* row = sB + (nt * 8 + 2 * t) * kStride + g;
#pragma unroll
        for (int ot = 0; ot < kD / 8; ++ot) mma_16x8x8_f64(acc[ot], pv, row[ot * 8], row[kStride + ot * 8]);
    }
#else
#pragma unroll
    for (int nt = 0; nt < kK / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const double* row = sB + (nt * 8 + 2 * t + e) * kStride + (kSwz ? g ^ (4 * (t >> 1)) : g);
#pragma unroll
            for (int ot = 0; ot < kD / 8; ++ot) {
                const double b = row[ot * 8];
#if CUFLASH_F64_MMA == 4
                mma_16x8x4_f64(acc[ot], p[nt][e], p[nt][2 + e], b);
#else
                mma_8x8x4_f64(acc[ot][0], acc[ot][1], p[nt][e], b);
                mma_8x8x4_f64(acc[ot][2], acc[ot][3], p[nt][2 + e], b);
#endif
            }
        }
#endif
}

// float32 (mma.m16n8k8 .tf32, mma.cuh): kTerms 1 rounds every operand to TF32 (precision="tf32");
// 3 splits each into TF32 parts hi + lo and adds lo·hi + hi·lo + hi·hi (3xTF32: float32's
// accuracy, precision="ieee").  A operand (g = lane / 4, t = lane % 4): rows g, g + 8, columns t,
// t + 4 of the k step; B: k rows t, t + 4 of column g.
template <int kTerms>
__device__ __forceinline__ void tf32_parts(float x, u32& hi, u32& lo) {
    if constexpr (kTerms == 1)
        hi = to_tf32(x), lo = 0;
    else
        split_tf32(x, hi, lo);
}
// 3xTF32: the k step's products go into accumulators of their own, added to d with FADD (rounded
// to nearest).  Added in the tensor core, each step's sum was cut to d's magnitude with truncation
// (the tensor cores' fp32 accumulation rounds toward zero): over a d256 row or a 1000-key P V that
// bias grew to 1.0-1.5x the exactness rule's bound against naive float32.  kChains 3: the three
// products in one accumulator; 2: hi·hi in one, the cross terms in another, so that a step is two
// chained products, not three (the float32 forward waits on chained HMMAs, perf-notes f11).  Which
// one a product gets: CUFLASH_TF32_CHAINS_ABT (S = Q Kᵀ) and CUFLASH_TF32_CHAINS_CB (O += P V),
// set per head dim by _kernels.fwd_tile (TileConfig.tf32_chains); 3 where unset (the backward).
#ifndef CUFLASH_TF32_CHAINS_ABT
#define CUFLASH_TF32_CHAINS_ABT 3
#endif
#ifndef CUFLASH_TF32_CHAINS_CB
#define CUFLASH_TF32_CHAINS_CB 3
#endif
template <int kTerms, int kChains>
__device__ __forceinline__ void mma_tf32_terms(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], float b0, float b1) {
    static_assert(kTerms == 1 || kTerms == 3, "TF32 products: 1 term or 3 (3xTF32)");
    static_assert(kChains == 2 || kChains == 3, "3xTF32 steps: 2 chains of products or 3");
    u32 bh0, bl0, bh1, bl1;
    tf32_parts<kTerms>(b0, bh0, bl0);
    tf32_parts<kTerms>(b1, bh1, bl1);
    if constexpr (kTerms == 3 && kChains == 2) {
        float cross[4] = {0.f, 0.f, 0.f, 0.f}, main[4] = {0.f, 0.f, 0.f, 0.f};
        mma_16x8x8_tf32(cross, al, bh0, bh1);
        mma_16x8x8_tf32(main, ah, bh0, bh1);
        mma_16x8x8_tf32(cross, ah, bl0, bl1);
#pragma unroll
        for (int e = 0; e < 4; ++e) d[e] += main[e] + cross[e];
    } else if constexpr (kTerms == 3) {
        float step[4] = {0.f, 0.f, 0.f, 0.f};
        mma_16x8x8_tf32(step, al, bh0, bh1);
        mma_16x8x8_tf32(step, ah, bl0, bl1);
        mma_16x8x8_tf32(step, ah, bh0, bh1);
#pragma unroll
        for (int e = 0; e < 4; ++e) d[e] += step[e];
    } else {
        mma_16x8x8_tf32(d, ah, bh0, bh1);
    }
}

// acc (16 x kN) += A (16 x kD) · Bᵀ in float32, as warp_gemm_abt.
template <int kTerms, int kD, int kN, int kStride>
__device__ __forceinline__ void warp_gemm_abt_f32(float (&acc)[kN / 8][4], const float* sA, const float* sB, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int ks = 0; ks < kD / 8; ++ks) {
        const float* a = sA + ks * 8 + t;
        const float av[4] = {a[g * kStride], a[(g + 8) * kStride], a[g * kStride + 4], a[(g + 8) * kStride + 4]};
        u32 ah[4], al[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_parts<kTerms>(av[i], ah[i], al[i]);
#pragma unroll
        for (int nt = 0; nt < kN / 8; ++nt) {
            const float* b = sB + (nt * 8 + g) * kStride + ks * 8 + t;
            mma_tf32_terms<kTerms, CUFLASH_TF32_CHAINS_ABT>(acc[nt], ah, al, b[0], b[4]);
        }
    }
}

// acc (16 x kD) += P (16 x kK, C fragments as S left them) · B (kK rows at sB) in float32.  As in
// warp_gemm_cb_f64, the contraction takes the keys in the order the C fragment holds them: the
// step of tile nt gives k = t the key 8 nt + 2 t and k = t + 4 the key 8 nt + 2 t + 1.
template <int kTerms, int kK, int kD, int kStride>
__device__ __forceinline__ void warp_gemm_cb_f32(float (&acc)[kD / 8][4], const float (&p)[kK / 8][4], const float* sB, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nt = 0; nt < kK / 8; ++nt) {
        const float pv[4] = {p[nt][0], p[nt][2], p[nt][1], p[nt][3]};  // (g, 2t), (g + 8, 2t), (g, 2t + 1), (g + 8, 2t + 1)
        u32 ah[4], al[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_parts<kTerms>(pv[i], ah[i], al[i]);
        const float* row = sB + (nt * 8 + 2 * t) * kStride + g;
#pragma unroll
        for (int ot = 0; ot < kD / 8; ++ot) mma_tf32_terms<kTerms, CUFLASH_TF32_CHAINS_CB>(acc[ot], ah, al, row[ot * 8], row[kStride + ot * 8]);
    }
}

// C fragments of a (16 x kN) fp32 tile -> A fragments of the same tile in 16 bits.  Tile nt's
// rows lane/4 and lane/4 + 8 hold keys 8nt.., which are k = 0..7 (nt even) or 8..15 (nt odd) of
// A fragment nt/2.
template <class T, int kN>
__device__ __forceinline__ void c_to_a(u32 (&pa)[kN / 16][4], const float (&c)[kN / 8][4]) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
        pa[nt / 2][2 * (nt % 2)] = pack2<T>(c[nt][0], c[nt][1]);
        pa[nt / 2][2 * (nt % 2) + 1] = pack2<T>(c[nt][2], c[nt][3]);
    }
}

template <int kN, class A>
__device__ __forceinline__ void zero(A (&c)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[i][e] = 0;
}

// acc (16 x kN) += A (16 x kD) · Bᵀ and acc (16 x kD) += C (16 x kK, C fragments) · B for the
// dtype tag T: the 16-bit products above (C converted to A fragments), or the float32 (kTerms TF32
// products, warp_gemm_abt_f32) and float64 ones (C used as it is).
template <class T, int kTerms, int kD, int kN, int kStride, bool kSwz = false, class A, class E>
__device__ __forceinline__ void gemm_abt(A (&acc)[kN / 8][4], const E* sA, const E* sB, int lane) {
    if constexpr (Elem<T>::kF64) warp_gemm_abt_f64<kD, kN, kStride, kSwz>(acc, sA, sB, lane);
    else if constexpr (Elem<T>::kF32) warp_gemm_abt_f32<kTerms, kD, kN, kStride>(acc, sA, sB, lane);
    else warp_gemm_abt<T, kD, kN, kStride>(acc, sA, sB, lane);
}
template <class T, int kTerms, int kK, int kD, int kStride, bool kSwz = false, class A, class E>
__device__ __forceinline__ void gemm_cb(A (&acc)[kD / 8][4], const A (&c)[kK / 8][4], const E* sB, int lane) {
    if constexpr (Elem<T>::kF64) {
        warp_gemm_cb_f64<kK, kD, kStride, kSwz>(acc, c, sB, lane);
    } else if constexpr (Elem<T>::kF32) {
        warp_gemm_cb_f32<kTerms, kK, kD, kStride>(acc, c, sB, lane);
    } else {
        u32 a[kK / 16][4];
        c_to_a<T, kK>(a, c);
        warp_gemm_rb<T, kK, kD, kStride>(acc, a, sB, lane);
    }
}

// Write a warp's (16 x kD) C-fragment tile (fp32; float32/float64 kernels: their Acc), times
// `mul`, in the element type E (16-bit T values, or float/double): staged in the warp's own 16
// rows of shared memory `stage`, then stored 16 bytes at a time to rows < rows_valid and 16-byte
// chunks < chunks_valid of global memory.
template <class T, int kD, int kStride, class A, class E>
__device__ __forceinline__ void store_warp_tile(const A (&c)[kD / 8][4], A mul, E* stage, E* g,
                                                long long row_stride, int rows_valid, int chunks_valid, int lane) {
    constexpr int kPer = 16 / sizeof(E), kChunks = kD / kPer;
#pragma unroll
    for (int ot = 0; ot < kD / 8; ++ot)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            E* at = stage + (lane / 4 + 8 * half) * kStride + ot * 8 + (lane % 4) * 2;
            if constexpr (sizeof(E) == 8)
                *reinterpret_cast<double2*>(at) = make_double2(c[ot][2 * half] * mul, c[ot][2 * half + 1] * mul);
            else if constexpr (sizeof(E) == 4)
                *reinterpret_cast<float2*>(at) = make_float2(c[ot][2 * half] * mul, c[ot][2 * half + 1] * mul);
            else
                *reinterpret_cast<u32*>(at) = pack2<T>(c[ot][2 * half] * mul, c[ot][2 * half + 1] * mul);
        }
    __syncwarp();
#pragma unroll
    for (int i = lane; i < 16 * kChunks; i += 32) {
        const int r = i / kChunks, col = i % kChunks;
        if (r < rows_valid && col < chunks_valid)
            *reinterpret_cast<uint4*>(g + r * row_stride + col * kPer) = *reinterpret_cast<const uint4*>(stage + r * kStride + col * kPer);
    }
}
