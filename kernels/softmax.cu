// Row softmax with the online normaliser (Milakov & Gimelshein 2018, Algorithm 3).
//
// One block per row of a contiguous (rows, n) array.  Pass 1 streams the row once, each thread
// keeping a running max m and sum l = sum 2^(x - m) rescaled by 2^(m_old - m_new) when the max
// grows; the block then merges the (m, l) pairs.  Pass 2 writes exp(x - m) / l.  A row of all
// -inf has no maximum: it is written as zeros (the convention for an empty row), never NaN.
#include "mma.cuh"

#ifndef CUFLASH_DTYPE
#define CUFLASH_DTYPE float
#endif
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_softmax
#endif
#define CUFLASH_THREADS 256

// Element access: Storage is what the pointer points to (16-bit types are raw u16 bits; half_t and
// bf16_t are empty tags, so pointer arithmetic must never use them), Acc the accumulation type.
template <class T> struct Elem;
template <> struct Elem<float> {
    using Storage = float;
    using Acc = float;
    __device__ static float load(const float* p) { return *p; }
    __device__ static void store(float* p, float x) { *p = x; }
};
template <> struct Elem<double> {
    using Storage = double;
    using Acc = double;
    __device__ static double load(const double* p) { return *p; }
    __device__ static void store(double* p, double x) { *p = x; }
};
template <> struct Elem<half_t> {
    using Storage = u16;
    using Acc = float;
    __device__ static float load(const u16* p) {
        float x;
        asm("{ .reg .b16 h; ld.global.b16 h, [%1]; cvt.f32.f16 %0, h; }" : "=f"(x) : "l"(p));
        return x;
    }
    __device__ static void store(u16* p, float x) {
        asm volatile("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; st.global.b16 [%0], h; }" :: "l"(p), "f"(x));
    }
};
template <> struct Elem<bf16_t> {
    using Storage = u16;
    using Acc = float;
    __device__ static float load(const u16* p) { return __uint_as_float(static_cast<u32>(*p) << 16); }
    __device__ static void store(u16* p, float x) { *p = static_cast<u16>(pack2<bf16_t>(x, 0.f) & 0xffffu); }
};

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }

template <class Acc> __device__ __forceinline__ Acc neg_inf() { return -static_cast<Acc>(__int_as_float(0x7f800000)); }

// Merge two (max, sum) states; an empty state has m = -inf, l = 0.
template <class Acc> __device__ __forceinline__ void merge(Acc& m, Acc& l, Acc m2, Acc l2) {
    Acc mn = m > m2 ? m : m2;
    if (mn == neg_inf<Acc>()) return;
    l = l * acc_exp(m - mn) + l2 * acc_exp(m2 - mn);
    m = mn;
}

template <class T>
__device__ __forceinline__ void softmax_row(const typename Elem<T>::Storage* x, typename Elem<T>::Storage* y, long long n) {
    using Acc = typename Elem<T>::Acc;
    __shared__ Acc sm[CUFLASH_THREADS / 32], sl[CUFLASH_THREADS / 32];
    const auto* xr = x + static_cast<long long>(blockIdx.x) * n;
    auto* yr = y + static_cast<long long>(blockIdx.x) * n;

    Acc m = neg_inf<Acc>(), l = 0;
    for (long long c = threadIdx.x; c < n; c += CUFLASH_THREADS) {
        Acc v = Elem<T>::load(xr + c);
        merge<Acc>(m, l, v, Acc(1));
    }
    for (int s = 16; s > 0; s /= 2) {  // warp, then block
        Acc m2 = __shfl_xor_sync(0xffffffffu, m, s), l2 = __shfl_xor_sync(0xffffffffu, l, s);
        merge<Acc>(m, l, m2, l2);
    }
    if (threadIdx.x % 32 == 0) { sm[threadIdx.x / 32] = m; sl[threadIdx.x / 32] = l; }
    __syncthreads();
    m = sm[0]; l = sl[0];
    for (int w = 1; w < CUFLASH_THREADS / 32; ++w) merge<Acc>(m, l, sm[w], sl[w]);

    const bool empty = m == neg_inf<Acc>();
    const Acc inv_l = empty ? Acc(0) : Acc(1) / l;
    for (long long c = threadIdx.x; c < n; c += CUFLASH_THREADS) {
        Acc v = Elem<T>::load(xr + c);
        Elem<T>::store(yr + c, empty ? Acc(0) : acc_exp(v - m) * inv_l);
    }
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS)
CUFLASH_KERNEL_NAME(const Elem<CUFLASH_DTYPE>::Storage* x, Elem<CUFLASH_DTYPE>::Storage* y, long long n) {
    softmax_row<CUFLASH_DTYPE>(x, y, n);
}
