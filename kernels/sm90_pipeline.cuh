// Hopper (sm_90a) producer/consumer pieces as inline PTX: transaction mbarriers, the bulk tensor
// copy (TMA) of a tile into the 128-byte-swizzled layout of swizzled_tile.cuh, named barriers and
// register re-balancing.  Building blocks of the warp-specialised kernels (issue 21): a producer
// warp fills a ring of shared-memory stages, consumer warpgroups compute on them.
//
// Ring protocol (Shah et al., "FlashAttention-3", 2024, §3.1; PTX ISA, "mbarrier" and
// "cp.async.bulk.tensor"): stage i has a `full` barrier (1 arrival: the producer's
// arrive.expect_tx, completed when the copy's bytes land) and an `empty` barrier (one arrival per
// consumer warpgroup).  Both sides walk the stages with a RingState (stage, phase): the producer
// waits `empty` with the flipped phase (a fresh barrier reads its previous phase as complete, so
// the first pass does not block), the consumers wait `full` with the phase itself.
#pragma once
#include "wgmma.cuh"

// --- transaction barriers (64-bit mbarrier objects in shared memory) ---------------------------

__device__ __forceinline__ void mbar_init(u64* bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// After the barriers of a block are initialised, before any thread or the copy engine uses them.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also announces `bytes` of copies to complete on this barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
// Block until the phase with parity `phase` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, int phase) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" :: "r"(smem_addr(bar)), "r"(phase) : "memory");
}

// Position in a ring of kStages stages: the consumers start at phase 0 (nothing has landed), the
// producer at phase 1 (producer_start: the stages are free).
template <int kStages>
struct RingState {
    int stage = 0, phase = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == kStages) stage = 0, phase ^= 1;
    }
    // The producer's start: every stage free (waits on `empty` pass at once).
    __device__ __forceinline__ static RingState producer_start() {
        RingState r;
        r.phase = 1;
        return r;
    }
};

// --- the bulk tensor copy engine --------------------------------------------------------------

// A CUtensorMap as the driver encodes it (cuflash/_tma.py): 128 opaque bytes, 64-byte aligned,
// passed to the kernel as a __grid_constant__ parameter (its generic address is what TMA takes).
struct __align__(64) TensorMap {
    u64 words[16];
};

__device__ __forceinline__ void tma_prefetch(const TensorMap& map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(&map)) : "memory");
}

// Copy the box at coordinates (c0 innermost, c1, c2, c3) of a 4-D map into shared memory at dst
// (1024-byte aligned for the 128-byte swizzle), completing `bar`'s transaction count.  Elements
// outside the tensor arrive as zeros.  One thread issues it.
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, u64* bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(smem_addr(dst)), "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
        : "memory");
}

// A (kRows x kD) tile of 16-bit values at row `row` of head `head`, batch entry `batch`: kD / 64
// boxes of (64 columns x kRows rows), one per 64-column panel of swizzled_tile.cuh's layout (the
// copy engine's 128-byte swizzle is that layout).  Bytes that complete on `bar`: kRows * kD * 2.
template <int kRows, int kD>
__device__ __forceinline__ void tma_load_tile(unsigned char* dst, const TensorMap& map, u64* bar, int row, int head, int batch) {
#pragma unroll
    for (int panel = 0; panel < kD / 64; ++panel)
        tma_load_4d(dst + panel * kRows * 128, map, bar, panel * 64, row, head, batch);
}

// The reverse copy: the box at (c0 innermost, c1, c2, c3) of a 4-D map from shared memory at src
// (1024-byte aligned, the 128-byte swizzle) to global memory; elements outside the tensor are not
// written.  One thread issues it, into its open bulk group (bulk_commit closes the group); the
// copy engine reads src after the call returns: the issuing thread waits with bulk_wait_read
// before src is written again, and with bulk_wait before the block exits.
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 :: "l"(reinterpret_cast<u64>(&map)), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// [dst, dst + bytes) += the floats at src in shared memory, by the copy engine (a bulk reduction
// in this thread's bulk group; 16-byte aligned, bytes a multiple of 16).  The threads that wrote
// src ran fence_async_smem() and a barrier with this one before; this thread waits with
// bulk_wait_read before src is written again and with bulk_wait before the block exits.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until this thread's bulk groups but the newest kPending have read their shared memory (_read) or are done.
template <int kPending> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(kPending) : "memory");
}
template <int kPending> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(kPending) : "memory");
}

// --- warpgroup coordination ------------------------------------------------------------------

// Named barriers 1..15 (0 is __syncthreads): `threads` is a multiple of 32, the same at every use.
// The id is an immediate, so that ptxas counts only the barriers a kernel uses.
template <int kId> __device__ __forceinline__ void named_barrier_sync(int threads) {
    asm volatile("bar.sync %0, %1;" :: "n"(kId), "r"(threads) : "memory");
}
template <int kId> __device__ __forceinline__ void named_barrier_arrive(int threads) {
    asm volatile("bar.arrive %0, %1;" :: "n"(kId), "r"(threads) : "memory");
}

// Move registers between warpgroups (every thread of the warpgroup executes it): the producer
// gives registers up, the consumers take them (counts are multiples of 8 in [24, 256]).
template <int kRegs> __device__ __forceinline__ void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void regs_acquire() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(kRegs));
}

// --- ordering across blocks ----------------------------------------------------------------------

// A counter in global memory that blocks take turns on (the deterministic backward's dQ order,
// flash_bwd_sm90.cu's kDqOrdered): a block waits until the counter reads its turn, makes its
// additions, and once they are done passes the turn on by adding 1.  One thread calls these.
// The bulk reductions are copies of the async proxy: the fence orders them with the counter's
// generic accesses, after the wait (the additions start after the turn was seen) and before the
// release (they are complete, bulk_wait, and visible before the next block sees its turn).
// A turn that never comes (a counting error: a block that never adds) ends the launch with a trap
// after about a minute instead of hanging.
__device__ __forceinline__ void sem_wait_eq(const int* sem, int value) {
    int seen;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(sem) : "memory");
    if (seen != value) {
        u64 start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do {
            __nanosleep(64);
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(sem) : "memory");
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > 60ull * 1000000000ull) __trap();
        } while (seen != value);
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ void sem_release_add(int* sem) {
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(sem) : "memory");
}
