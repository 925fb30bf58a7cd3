// Tensor-core and asynchronous-copy building blocks for sm_80+, as inline PTX (no CUDA headers,
// so NVRTC compiles them in a fraction of a second and the pip runtime wheels suffice).
//
// Fragment layouts are those of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"):
// the fp32 accumulator C of a 16x8 tile gives lane t the elements (t/4, 2(t%4)+{0,1}) and
// (t/4+8, 2(t%4)+{0,1}); the A operand gives lane t the same positions for k in 0..7 (a0, a1) and
// 8..15 (a2, a3).  That equality is what lets P stay in registers between S = QK^T and O += PV.
#pragma once

typedef unsigned short u16;    // one fp16 or bf16 value, as raw bits
typedef unsigned int u32;

struct half_t {};              // tags selecting the element type of a kernel variant
struct bf16_t {};
struct f32_t {};               // float32 and float64 (issue 24): flash_fwd.cu's TF32 and FP64
struct f64_t {};               // tensor-core forms

// What a dtype tag means to the kernels: the element in memory and the type of the accumulators
// and the softmax state.  kWide: 32- or 64-bit elements, whose products read plain shared-memory
// loads (no ldmatrix) and keep P in the registers of S (warp_gemm.cuh's _f32/_f64 products).
template <class T> struct Elem {
    using Storage = u16;
    using Acc = float;
    static constexpr bool kF32 = false, kF64 = false, kWide = false;
};
template <> struct Elem<f32_t> {
    using Storage = float;
    using Acc = float;
    static constexpr bool kF32 = true, kF64 = false, kWide = true;
};
template <> struct Elem<f64_t> {
    using Storage = double;
    using Acc = double;
    static constexpr bool kF32 = false, kF64 = true, kWide = true;
};

#ifndef CUFLASH_F64_EXP2
#define CUFLASH_F64_EXP2 1  // float64's probabilities (acc::exp2_prob): 0 CUDA's exp2, 1 the polynomial by Horner, 2 by Estrin
// (each variant sets it: cuflash/_kernels.py, _f64_exp2; perf-notes f20)
#endif
static_assert(CUFLASH_F64_EXP2 >= 0 && CUFLASH_F64_EXP2 <= 2, "CUFLASH_F64_EXP2: 0, 1 or 2");

// Accumulator arithmetic for float and double alike (the score pipeline and the online softmax
// are written once for both); the float forms are the single-precision intrinsics.
namespace acc {
__device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max(double a, double b) { return ::fmax(a, b); }
__device__ __forceinline__ float exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2(double x) { return ::exp2(x); }
// 2^x as an attention probability (x <= 0 up to the float64 softmax's slack): float as exp2;
// double by a polynomial of its own (perf-notes f19).  x = n + f with n = rint(x) (the 1.5 * 2^52
// shift) and |f| <= 1/2; 2^f = 1 + f q(f), q of degree 9 (minimax, 2.23e-16 relative, f14 and session 32's review);
// 2^n through the exponent bits.  13 FP64 operations against CUDA's exp2's 16, and its rare cases
// (|x| >= 1020 by the high word read as a float, on the FP32 pipe; -inf from hidden keys; NaN) take
// integer selects only, no FP64 instruction: 0 below -1020 (a probability under 2^-1020 of a row whose
// largest is near 1 is nothing to the row's sum), +inf above 1020, NaN for NaN.  (f14's second form
// spent a DSETP and DMULs on those cases, probably predicated into every call: 0.835x at d64.)
// For probabilities only: past them it is wrong at the edges (+inf for x in [1020, 1024), where 2^x is
// finite; 0 from -1020 down, where 2^x is at most 2^-1020).
__device__ __forceinline__ float exp2_prob(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_prob(double x) {
    if constexpr (CUFLASH_F64_EXP2 == 0) return ::exp2(x);
    constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52: x + kShift holds rint(x) in its low word
    const double t = x + kShift;
    const double f = x - (t - kShift);
    constexpr double c1 = 0x1.62e42fefa3a12p-1, c2 = 0x1.ebfbdff82c431p-3, c3 = 0x1.c6b08d703e17ap-5, c4 = 0x1.3b2ab6fbd6cf1p-7,
                     c5 = 0x1.5d87fe9b8f111p-10, c6 = 0x1.4309126c0457ep-13, c7 = 0x1.ffcb58c9fcb53p-17, c8 = 0x1.62c1479c8a1dap-20,
                     c9 = 0x1.b671b31e47dc1p-24, c10 = 0x1.e3a9112f93612p-28;
    double p;
    if constexpr (CUFLASH_F64_EXP2 == 2) {  // Estrin: 12 operations, 5 deep (f2 and f4 alongside the pairs)
        const double f2 = f * f, f4 = f2 * f2;
        const double b0 = ::fma(::fma(c3, f, c2), f2, ::fma(c1, f, 1.0));
        const double b1 = ::fma(::fma(c7, f, c6), f2, ::fma(c5, f, c4));
        const double b2 = ::fma(c10, f2, ::fma(c9, f, c8));
        p = ::fma(::fma(b2, f4, b1), f4, b0);
    } else {  // Horner: 10 operations, 10 deep
        double q = c10;
        q = ::fma(q, f, c9);
        q = ::fma(q, f, c8);
        q = ::fma(q, f, c7);
        q = ::fma(q, f, c6);
        q = ::fma(q, f, c5);
        q = ::fma(q, f, c4);
        q = ::fma(q, f, c3);
        q = ::fma(q, f, c2);
        q = ::fma(q, f, c1);
        p = ::fma(q, f, 1.0);  // 2^f in [0.707, 1.415]: with n in [-1020, 1020] the exponent stays normal
    }
    int hi = __double2hiint(p) + static_cast<int>(static_cast<unsigned>(__double2loint(t)) << 20);
    int lo = __double2loint(p);
    const int xhi = __double2hiint(x), xlo = __double2loint(x);
    if (!(fabsf(__int_as_float(xhi)) < 4.49609375f)) {  // |x| >= 1020 (1020's high word as a float), inf, NaN
        // (no short-circuit test here: ptxas then makes the whole case selects, no branch between calls)
        const unsigned ahi = static_cast<unsigned>(xhi) & 0x7fffffffu;
        const bool nan = (ahi | static_cast<unsigned>(xlo != 0)) > 0x7ff00000u;  // exponent all ones, mantissa not 0
        hi = nan ? xhi : xhi < 0 ? 0 : 0x7ff00000;
        lo = nan ? xlo : 0;
    }
    return __hiloint2double(hi, lo);
}
__device__ __forceinline__ float log2(float x) { return log2f(x); }
__device__ __forceinline__ double log2(double x) { return ::log2(x); }
__device__ __forceinline__ float fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma(double a, double b, double c) { return ::fma(a, b, c); }
__device__ __forceinline__ float tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh(double x) { return ::tanh(x); }
__device__ __forceinline__ float abs(float x) { return fabsf(x); }
__device__ __forceinline__ double abs(double x) { return ::fabs(x); }
}  // namespace acc

// Two floats -> one register holding two 16-bit values (lo in the low half).
template <class T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<half_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// One 16-bit value -> float.
template <class T> __device__ __forceinline__ float to_float(u16 x);
template <> __device__ __forceinline__ float to_float<half_t>(u16 x) {
    float r;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(r) : "h"(x));
    return r;
}
template <> __device__ __forceinline__ float to_float<bf16_t>(u16 x) {
    return __uint_as_float(static_cast<u32>(x) << 16);
}

// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulators.  Not volatile: a pure register
// operation, so the compiler may interleave it with other work.
template <class T> __device__ __forceinline__ void mma_16x8x16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma_16x8x16<half_t>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16x8x16<bf16_t>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// float32 and float64 operands (issue 24's kernels, docs/perf-notes.md f0): fragment layouts of
// the PTX ISA's mma.m16n8k8 (.tf32) and mma.m8n8k4 (.f64), with g = lane / 4, t = lane % 4:
//   m16n8k8 tf32: A (16 x 8, row) a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4);
//                 B (8 x 8, col) b0 (k t, n g), b1 (k t + 4, n g); C as m16n8k16's above.
//   m8n8k4 f64:   A (8 x 4) a0 (g, t); B (4 x 8) b0 (k t, n g); C (8 x 8) c0, c1 (g, 2 t + {0, 1}),
//                 so two of them stacked (rows g and g + 8) are the 16 x 8 C fragment above.
// x rounded to TF32 (10 mantissa bits, to nearest, ties away: what cuflash._precision.tf32_round
// computes), as the .b32 operand of a tf32 product.
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// x = hi + lo, both TF32: hi·hi + hi·lo + lo·hi (3xTF32) keeps a float32 product's accuracy on the
// tensor cores (Ootomo and Yokota, "Recovering single precision accuracy from Tensor Cores while
// surpassing the FP32 theoretical peak performance", IJHPCA 2022).
// On sm_90 both parts are rounded by cvt.rn (ties to even), one instruction there, where cvt.rna
// takes four (a finiteness test, an add, a select and a mask; sm_80 has no cvt.rn to TF32): the
// split's accuracy does not depend on how ties go (perf-notes f10).  precision="tf32" keeps
// to_tf32's ties away, the rounding of the NumPy path it must match.
#ifndef CUFLASH_TF32_SPLIT_RN
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUFLASH_TF32_SPLIT_RN 1
#else
#define CUFLASH_TF32_SPLIT_RN 0
#endif
#endif
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
#if CUFLASH_TF32_SPLIT_RN
    asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
#else
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
#endif
}
// D = A(16x8, row) * B(8x8, col) + D with TF32 operands, fp32 accumulators.
__device__ __forceinline__ void mma_16x8x8_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// D = A(8x4, row) * B(4x8, col) + D in float64 (the FP64 tensor cores, sm_80+).
__device__ __forceinline__ void mma_8x8x4_f64(double& d0, double& d1, double a, double b) {
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(d0), "+d"(d1)
        : "d"(a), "d"(b));
}
__device__ __forceinline__ void mma_8x8x4_f64(double (&d)[2], double a, double b) { mma_8x8x4_f64(d[0], d[1], a, b); }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// D = A(16x8, row) * B(8x8, col) + D in float64: sm_90's 16-row shape (PTX ISA 7.8), fragments as
// m16n8k8 tf32's above with one double per element; one DMMA.16x8x8 where m8n8k4 needs four.
__device__ __forceinline__ void mma_16x8x8_f64(double (&d)[4], const double (&a)[4], double b0, double b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b0), "d"(b1));
}
// The same with k = 4: a0 (g, t), a1 (g + 8, t); b0 (k t, n g).
__device__ __forceinline__ void mma_16x8x4_f64(double (&d)[4], double a0, double a1, double b) {
    asm("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
        : "d"(a0), "d"(a1), "d"(b));
}
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory; lane l supplies the address of row l%8 of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// 16-byte global -> shared copy that bypasses L1; bytes past src_bytes (0 or 16) are zero-filled,
// which is how tail rows and padded head-dim columns become zeros without a branch.
// kFetchLine: L2 fetches the whole 128-byte line from DRAM on a miss, for tiles streamed once
// (decode K/V rows: +4-5 % of DRAM throughput, docs/perf-notes.md, d7).
template <bool kFetchLine = false>
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    if constexpr (kFetchLine)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"
                     :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
    else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ double quad_max(double x) {
    x = ::fmax(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return ::fmax(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ double quad_sum(double x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
