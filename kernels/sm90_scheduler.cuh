// Which query tile of which (batch, head) a block of the Hopper forward computes.  Tiles are
// numbered 0 .. tiles - 1; a block takes tiles blockIdx.x, blockIdx.x + gridDim.x, ...  The host
// picks the grid: one block per tile, or one per SM (persistent: a block's next tile's loads
// overlap its current tile's epilogue; FA3, Shah et al. 2024, §3.1 and its tile scheduler).
//
// Order: the (batch, head) pairs are cut into sections of p.tile_heads pairs, chosen on the host so
// that a section's K and V fit in half the L2 cache; within a section the tiles run longest first
// (the last query tile of every pair, then the one before, ...: under a causal mask later query
// rows see more keys), so that a grid of blocks striding over the numbers ends on short tiles.
// Which block computes a tile never changes what it computes: the result stays bitwise repeatable.
#pragma once
#include "params.cuh"

struct FwdTile {
    int b, h, m0;  // batch entry, query head, first query row
};

// Reads its sizes from the kernel's parameters (a __grid_constant__ struct: constant-bank loads)
// at each use, rather than keeping them in registers through the main loop.  32-bit arithmetic:
// 2^31 query tiles would be terabytes of q (the host checks the count).
template <int kBM>
struct TileScheduler {
    const FlashParams& p;

    __device__ __forceinline__ unsigned m_blocks() const { return static_cast<unsigned>((p.seqlen_q + kBM - 1) / kBM); }
    __device__ __forceinline__ unsigned pairs() const { return static_cast<unsigned>(p.batch * p.nheads_q); }
    __device__ __forceinline__ unsigned tiles() const { return pairs() * m_blocks(); }

    __device__ __forceinline__ FwdTile operator()(unsigned t) const {
        const unsigned m = m_blocks(), all = pairs(), heads = static_cast<unsigned>(p.nheads_q);
        const unsigned section = max(1u, min(all, static_cast<unsigned>(p.tile_heads)));  // (the host sets 1..pairs)
        const unsigned first = t / (section * m) * section;           // first pair of t's section
        const unsigned size = min(section, all - first), r = t - first * m;
        const unsigned pair = first + r % size, m_block = m - 1 - r / size;
        return {static_cast<int>(pair / heads), static_cast<int>(pair % heads), static_cast<int>(m_block * kBM)};
    }
};
