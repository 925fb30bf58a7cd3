// The tile map of a boolean mask (issue 23), launched before an attention kernel that takes the
// mask: for that kernel's tiles of mask_tile_m query rows x mask_tile_n keys, whether every entry
// of the tile is False (the kernel skips the tile: it adds nothing to the softmax, forward or
// backward), every entry True (the kernel reads no mask there), or both occur; and for each row
// of tiles the key tiles, for each column the query tiles, that are not all False (the kernels
// narrow their loops to them: a key-padding mask then costs what seqlens_k costs).
//
// Only the mask's distinct planes are mapped: a broadcast batch or head axis (stride 0) has one
// plane, broadcast rows one row of tiles (row 0 stands for every row).  Entries past the problem
// (rows past seqlen_q, keys past seqlen_k) do not count.  One block per tile (grid x: key tiles
// times planes, y: query tiles); the ranges are
// atomicMax'ed into zeroed int pairs (count - first, last + 1), so that 0 0 reads "none" and the
// result does not depend on the order of the blocks.
#include "params.cuh"

extern "C" __global__ void __launch_bounds__(128) cuflash_mask_tiles(const __grid_constant__ FlashParams p) {
    const int heads = static_cast<int>(p.mask_tiles_heads), tiles_m = static_cast<int>(p.mask_tiles_rows);
    const int tiles_n = static_cast<int>(p.mask_tiles_cols);
    const int nt = blockIdx.x % tiles_n, plane = blockIdx.x / tiles_n, mt = blockIdx.y;  // grid: (tiles_n x planes, tiles_m)
    const long long r0 = static_cast<long long>(mt) * p.mask_tile_m, c0 = static_cast<long long>(nt) * p.mask_tile_n;
    const int rows = p.mask_row_stride ? static_cast<int>(min(p.mask_tile_m, p.seqlen_q - r0)) : 1;
    const int cols = static_cast<int>(min(p.mask_tile_n, p.seqlen_k - c0));
    const unsigned char* tile = p.mask + (plane / heads) * p.mask_batch_stride + (plane % heads) * p.mask_head_stride +
                                r0 * p.mask_row_stride + c0 * p.mask_col_stride;
    bool any_true = false, any_false = false;
    for (int r = threadIdx.x / 32; r < rows; r += 4)
        for (int c = threadIdx.x % 32; c < cols; c += 32) {
            const bool attend = __ldg(tile + r * p.mask_row_stride + c * p.mask_col_stride) != 0;
            any_true |= attend;
            any_false |= !attend;
        }
    any_true = __syncthreads_or(any_true);
    any_false = __syncthreads_or(any_false);
    if (threadIdx.x == 0) {
        const int state = any_true ? (any_false ? 2 : 1) : 0;
        p.mask_tiles[(static_cast<long long>(plane) * tiles_m + mt) * tiles_n + nt] = static_cast<unsigned char>(state);
        if (state) {
            int* row = p.mask_tile_row_ranges + 2 * (static_cast<long long>(plane) * tiles_m + mt);
            int* col = p.mask_tile_col_ranges + 2 * (static_cast<long long>(plane) * tiles_n + nt);
            atomicMax(row, tiles_n - nt), atomicMax(row + 1, nt + 1);
            atomicMax(col, tiles_m - mt), atomicMax(col + 1, mt + 1);
        }
    }
}
