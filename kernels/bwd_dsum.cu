// The backward's pre-pass, D_i = rowsum(dO_i ∘ O_i) in fp32, laid out like the LSE (FlashAttention-2,
// Dao 2024, Algorithm 2, line 4), for the sm_80 and the Hopper backward kernels alike.  One warp
// per (row, head); the packed rows of a varlen batch are one long sequence here.  A module of its
// own: small and quick to compile, beside whichever backward module a GPU runs.
#include "mma.cuh"
#include "params.cuh"

#ifndef CUFLASH_DTYPE
#define CUFLASH_DTYPE half_t
#endif
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_bwd_dsum
#endif

// float32/float64 tags (f32_t, f64_t, mma.cuh's Elem): their elements read as they are, D in their
// Acc (float64: a float64 D beside the float64 LSE).  float32 with p.tf32_operands (precision="tf32"):
// dO rounded to TF32 first, as the backward's dP = dO V^T takes it, so that D = sum_j P_j dP_j where
// the forward's O = sum_j P_j V_j holds V rounded likewise, and dS = P (dP - D) is 0 where it is
// exactly (a row with one key) rather than a TF32 rounding of dO.V.  (Rounding O as well was worse:
// at head dim 1 D is one product, and O's own rounding gave dQ 1.1-1.8x the exactness bound.)
template <class T>
__device__ __forceinline__ void bwd_dsum(const FlashParams& p) {
    using E = typename Elem<T>::Storage;
    using A = typename Elem<T>::Acc;
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (w >= p.batch * p.seqlen_q * p.nheads_q) return;
    const long long h = w % p.nheads_q, i = (w / p.nheads_q) % p.seqlen_q, b = w / (p.nheads_q * p.seqlen_q);
    const E* o = static_cast<const E*>(p.out) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
    const E* d = static_cast<const E*>(p.dout) + b * p.do_batch_stride + i * p.do_row_stride + h * p.do_head_stride;
    A acc = 0;
    for (int c = lane; c < p.headdim_v; c += 32) {
        if constexpr (Elem<T>::kWide) {
            A dc = static_cast<A>(d[c]);
            if constexpr (Elem<T>::kF32) {
                if (p.tf32_operands) dc = __uint_as_float(to_tf32(dc));
            }
            acc += static_cast<A>(o[c]) * dc;
        } else
            acc += to_float<T>(o[c]) * to_float<T>(d[c]);
    }
#pragma unroll
    for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) reinterpret_cast<A*>(p.dsum)[b * p.lse_batch_stride + h * p.lse_head_stride + i] = acc;
}

extern "C" __global__ void __launch_bounds__(256) CUFLASH_KERNEL_NAME(const __grid_constant__ FlashParams p) {
    bwd_dsum<CUFLASH_DTYPE>(p);
}
