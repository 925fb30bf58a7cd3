// Which query tile of which (batch, head) a block of the Hopper forward computes.  Tiles are
// numbered 0 .. tiles - 1; a block's first tile is blockIdx.x.  The host picks the grid: one
// block per tile, or one per SM (persistent: a block's next tile's loads overlap its current
// tile's last product and epilogue; FA3, Shah et al. 2024, §3.1 and its tile scheduler).  On a
// persistent grid the next tile is the next ticket of a launch-wide counter (p.split_counters),
// so tiles start in their numbered order whatever each costs, as the hardware starts the blocks
// of a one-per-tile grid; a fixed stride (blockIdx.x + k gridDim.x) let the blocks drift apart
// until the tiles in flight spanned more heads than L2 holds (d256 16k causal: 0.72x the old
// kernel, docs/perf-notes.md h10).  Without a counter the stride stays (the one-per-tile grid,
// whose blocks have no next tile).
//
// Order: the (batch, head) pairs are cut into sections of p.tile_heads pairs, chosen on the host as
// few as give every SM a tile (and whose K and V fit in half the L2 cache), so that the tiles in
// flight share the K and V of few pairs (_gpu.py's _sm90_tile_grid); within a section the tiles run longest first
// (the last query tile of every pair, then the one before, ...: under a causal mask later query
// rows see more keys), so that a grid of blocks taking the numbers in order ends on short tiles.
// Which block computes a tile never changes what it computes: the result stays bitwise repeatable.
//
// The backward's dK/dV blocks (flash_bwd_sm90.cu): bwd_block below.
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

    // The tile after t for this block (>= tiles() when it has none).  Called by one thread.  Each
    // block takes tickets until one is past the end, so the launch takes each of the tickets
    // 0 .. tiles() - 1 once (the grid has at most tiles() blocks): the one that takes the last
    // is the last to touch the counter, and resets it to 0 for the next launch.
    __device__ __forceinline__ unsigned next(unsigned t) const {
        if (!p.split_counters) return t + gridDim.x;
        const unsigned ticket = atomicAdd(reinterpret_cast<unsigned*>(p.split_counters), 1u);
        if (ticket == tiles() - 1) *p.split_counters = 0;
        return ticket + gridDim.x;
    }

    __device__ __forceinline__ FwdTile operator()(unsigned t) const {
        const unsigned m = m_blocks(), all = pairs(), heads = static_cast<unsigned>(p.nheads_q);
        const unsigned section = max(1u, min(all, static_cast<unsigned>(p.tile_heads)));  // (the host sets 1..pairs)
        const unsigned first = t / (section * m) * section;           // first pair of t's section
        const unsigned size = min(section, all - first), r = t - first * m;
        const unsigned pair = first + r % size, m_block = m - 1 - r / size;
        return {static_cast<int>(pair / heads), static_cast<int>(pair % heads), static_cast<int>(m_block * kBM)};
    }
};

// Which key block of which (batch, K/V head) pair a block of the Hopper backward's dK/dV kernel
// computes when dQ's additions are ordered (deterministic=True: flash_bwd_sm90.cu's kDqOrdered;
// otherwise key block blockIdx.x of pair blockIdx.z * gridDim.y + blockIdx.y, the key blocks of a
// pair side by side, reading the same Q and dO tiles at about the same time).  `ticket` numbers the
// blocks in the order they started (each block's thread 0 takes one from a zeroed counter: CUDA does
// not promise that a grid's blocks start in blockIdx order).  The tickets are in sections of
// p.tile_heads pairs; within a section the key blocks from the last to the first, the section's pairs
// in turn.  A block waits only for higher key blocks of its own pair (they add to a query tile before
// it), which hold smaller tickets: they started before it, and every block waited for is running or
// done.  The last first also lets a causal mask's blocks add without waiting: key block n reaches
// query tile m a step after key block n + 1 did.
struct BwdBlock {
    int key_block;
    long long pair;  // b * nheads_k + K/V head
};
__device__ __forceinline__ BwdBlock bwd_block(const FlashParams& p, unsigned ticket) {  // (32 bits: the host launches < 2^31 blocks)
    const unsigned all = static_cast<unsigned>(p.batch * p.nheads_k), blocks = gridDim.x / all;
    const unsigned section = max(1u, min(all, static_cast<unsigned>(p.tile_heads)));  // (the host sets 1..pairs)
    const unsigned first = ticket / (section * blocks) * section;                       // first pair of the section
    const unsigned size = min(section, all - first), r = ticket - first * blocks;
    return {static_cast<int>(blocks - 1 - r / size), static_cast<long long>(first + r % size)};
}
