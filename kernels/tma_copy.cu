// Check of the Hopper producer/consumer pieces (sm90_pipeline.cuh), not attention: a producer
// thread copies (kRows x kD) tiles of a (batch, seqlen, heads, headdim) array through a ring of
// kStages shared-memory stages with the bulk tensor copy engine, and a consumer warpgroup writes
// each stage back out, read through swizzled_tile.cuh's layout, as dense (kRows, kD) tiles.  The
// output equals the input tile by tile (rows past seqlen zero) only if the tensor map encoding
// (cuflash/_tma.py), the swizzle, the barrier phases and the stage hand-over all agree.  Tests
// (tests/test_gpu_tma.py) and the warp-specialised forward (issue 21) build on it.
#include "sm90_pipeline.cuh"
#include "swizzled_tile.cuh"

#ifndef CUFLASH_HEADDIM
#define CUFLASH_HEADDIM 128
#endif
#ifndef CUFLASH_TILE_ROWS
#define CUFLASH_TILE_ROWS 64
#endif
#ifndef CUFLASH_STAGES
#define CUFLASH_STAGES 2
#endif
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_tma_copy
#endif

// Tile t of the array: batch entry t / (heads * row_tiles), head (t / row_tiles) % heads, rows
// [(t % row_tiles) * kRows, + kRows).  Block b copies tiles [b * tiles_per_block, ...).
extern "C" __global__ void __launch_bounds__(256, 1)
CUFLASH_KERNEL_NAME(const __grid_constant__ TensorMap src, u16* out, int tiles_per_block, int row_tiles, int heads,
                    long long total_tiles) {
    constexpr int kRows = CUFLASH_TILE_ROWS, kD = CUFLASH_HEADDIM, kStages = CUFLASH_STAGES;
    constexpr int kTileBytes = kRows * kD * 2, kChunks = kD / 8;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // host adds 1 KB
    __shared__ u64 full[kStages], empty[kStages];

    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 1);
        mbar_init_fence();
    }
    __syncthreads();
    const long long first = static_cast<long long>(blockIdx.x) * tiles_per_block;
    const int tiles = static_cast<int>(min(static_cast<long long>(tiles_per_block), total_tiles - first));

    if (tid < 128) {  // producer warpgroup: one thread issues every copy
        if (tid != 0) return;
        tma_prefetch(src);
        auto ring = RingState<kStages>::producer_start();
        for (int i = 0; i < tiles; ++i, ring.advance()) {
            const long long t = first + i;
            const int rt = static_cast<int>(t % row_tiles), h = static_cast<int>((t / row_tiles) % heads);
            const int b = static_cast<int>(t / (static_cast<long long>(row_tiles) * heads));
            mbar_wait(&empty[ring.stage], ring.phase);
            mbar_arrive_expect_tx(&full[ring.stage], kTileBytes);
            tma_load_tile<kRows, kD>(smem + ring.stage * kTileBytes, src, &full[ring.stage], rt * kRows, h, b);
        }
        for (int s = 0; s < kStages; ++s, ring.advance()) mbar_wait(&empty[ring.stage], ring.phase);  // drained
        return;
    }
    const int ctid = tid - 128;  // consumer warpgroup
    RingState<kStages> ring;
    for (int i = 0; i < tiles; ++i, ring.advance()) {
        mbar_wait(&full[ring.stage], ring.phase);
        const unsigned char* tile = smem + ring.stage * kTileBytes;
        u16* dst = out + (first + i) * kRows * kD;
        for (int c = ctid; c < kRows * kChunks; c += 128) {
            const int r = c / kChunks, col = c % kChunks;
            *reinterpret_cast<uint4*>(dst + r * kD + col * 8) = *reinterpret_cast<const uint4*>(tile + swizzled_chunk<kRows>(r, col));
        }
        fence_async_smem();  // these generic reads before the copy engine's next write of the stage
        named_barrier_sync<1>(128);  // every consumer thread is done reading the stage
        if (ctid == 0) mbar_arrive(&empty[ring.stage]);
    }
}
