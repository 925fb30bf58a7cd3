"""Does compute-sanitizer's racecheck see an mbarrier handover as synchronisation?

The Hopper forward's producer warp writes each tile's number into shared memory with a plain
store, arrives on an mbarrier, and the consumer warps read it after waiting on that barrier; the
producer writes the next number only after every consumer warp has arrived on a second barrier.
racecheck reports hazards between that store and those reads (docs/perf-notes.md h11).  This
probe runs the same handover in a kernel of its own, in four forms, one per process (run each
under `compute-sanitizer --tool racecheck`):

  default   mbarrier.arrive / try_wait.parity as the kernels write them (PTX gives them .release
            and .acquire at CTA scope by default)
  explicit  the same with .release.cta / .acquire.cta spelled out
  named     the handover through named barriers (bar.sync / bar.arrive) instead
  racy      the producer does not wait for the consumers: a real race, which racecheck must report

    python scripts/racecheck_probe.py {default,explicit,named,racy}

It prints the values the consumers read (a correct form gives each round's number to every
consumer warp) and exits 1 if any was wrong.
"""

import sys

import cupy as cp

SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ unsigned smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void init(u64* b, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void arrive(u64* b) {
#if EXPLICIT
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(smem(b)) : "memory");
#else
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem(b)) : "memory");
#endif
}
__device__ __forceinline__ void wait(u64* b, int phase) {
    asm volatile("{\n.reg .pred done;\nW_%=:\n"
#if EXPLICIT
                 "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
#else
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
#endif
                 "@!done bra W_%=;\n}\n" :: "r"(smem(b)), "r"(phase) : "memory");
}

// Warp 0 (lane 0) produces `rounds` numbers; warps 1..4 consume each one (every lane reads it).
extern "C" __global__ void handover(int* wrong, int rounds) {
    __shared__ __align__(8) u64 full, empty;
    __shared__ int slot;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        init(&full, 1), init(&empty, 4);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int r = 0; r < rounds; ++r) {
        if (warp == 0) {
#if NAMED
            if (r > 0) asm volatile("bar.sync 2, 160;" ::: "memory");  // the consumers are done with r - 1
            if (lane == 0) slot = r;
            asm volatile("bar.arrive 1, 160;" ::: "memory");
#else
            if (lane == 0) {
#if !RACY
                wait(&empty, (r & 1) ^ 1);  // (the first pass returns at once)
#endif
                slot = r;
                arrive(&full);
            }
#endif
        } else {
#if NAMED
            asm volatile("bar.sync 1, 160;" ::: "memory");
            const int got = slot;
            if (got != r) atomicAdd(wrong, 1);
            if (r + 1 < rounds) asm volatile("bar.arrive 2, 160;" ::: "memory");
#else
            wait(&full, r & 1);
            const int got = slot;
            if (got != r) atomicAdd(wrong, 1);
            __syncwarp();
            if (lane == 0) arrive(&empty);
#endif
        }
    }
}
"""

FORMS = {"default": {}, "explicit": {"EXPLICIT": 1}, "named": {"NAMED": 1}, "racy": {"RACY": 1}}


def main(form: str) -> int:
    flags = {"EXPLICIT": 0, "NAMED": 0, "RACY": 0, **FORMS[form]}
    options = ("-arch=sm_90a", "-std=c++17") + tuple(f"-D{k}={v}" for k, v in flags.items())
    kernel = cp.RawModule(code=SOURCE, options=options).get_function("handover")
    wrong = cp.zeros(1, dtype=cp.int32)
    kernel((1,), (160,), (wrong, cp.int32(64)))
    cp.cuda.Device().synchronize()
    print(f"{form}: {int(wrong.get()[0])} wrong reads of 64 rounds x 128 consumer threads")
    return 0 if form == "racy" or int(wrong.get()[0]) == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "default"))
