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
