// Benchmark reference, not attention: read two contiguous buffers once and keep nothing, as fast
// as plain 16-byte loads go (grid-stride, four loads in flight per thread; the best of the forms
// measured on the H200, docs/perf-notes.md d9).  `cuflash bench --suite decode` times it on the
// K and V caches of each row: the TB/s any kernel that must read them reaches, with its launch.
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_read_bandwidth
#endif

extern "C" __global__ void __launch_bounds__(1024) CUFLASH_KERNEL_NAME(const uint4* a, long long a_chunks, const uint4* b,
                                                                      long long b_chunks, unsigned* sink) {
    constexpr int kInFlight = 4;
    const long long total = a_chunks + b_chunks, step = static_cast<long long>(gridDim.x) * blockDim.x;
    unsigned acc = 0;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total; i += kInFlight * step) {
        uint4 x[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
            const long long j = i + u * step;
            x[u] = j < a_chunks ? __ldcs(a + j) : j < total ? __ldcs(b + (j - a_chunks)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;  // practically never: keeps the loads from being dropped
}
