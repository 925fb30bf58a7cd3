// The producer of the Hopper forward (flash_fwd_sm90.cu): one warp walks the block's tiles in
// the scheduler's order and streams each tile's Q, K and V into shared memory with the bulk
// tensor copy engine (TMA; maps from cuflash/_tma.py), through the full/empty barriers of
// sm90_pipeline.cuh's ring protocol.  Lane 0 issues every copy; the whole warp waits on the
// barriers and re-converges after each copy.
//
// The producer decides the block's tiles (sm90_scheduler.cuh: first blockIdx.x, then
// TileScheduler::next) and hands each to the consumers with its Q: the tile's number goes into
// FwdBarriers::tile before the arrival on q_full, with what it loaded of the tile's sequence
// (FwdBarriers::seq: the consumers then start the tile without a global load), and kNoTile there
// tells them the block is done.
// Tiles past their sequence's rows (varlen) are never handed over.
// Per tile with keys: K of the first key tile (it can land while the consumers still finish the
// previous tile: they released every K/V stage of that tile first), then Q once the consumers
// freed sQ (q_empty: after their last S = Q K^T where O has a buffer of its own, else after the
// epilogue that stages O in sQ), then V of that key tile and K, V of the others, from the last
// key tile down.  A tile without keys gets a plain arrival on q_full instead of Q.  Shah et al.,
// "FlashAttention-3", 2024, §3.1.
#pragma once
#include "score_mods.cuh"
#include "seqinfo.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_scheduler.cuh"

// The tensor maps of one launch (cuflash/_tma.py): Q, K and V as (headdim, rows, heads, batch)
// boxes of (64, rows, 1, 1); packed (varlen) arrays are one batch entry of all their rows.  O
// (boxes of 64 rows, one consumer warpgroup's) is written through its map by sm90_fwd_epilogue.cuh.
struct FwdMaps {
    TensorMap q, k, v, o;
};

// What both roles derive from a tile: its sequence, its K/V head and its key tiles [nb_lo,
// nb_hi), with kMods narrowed to the span where the mask is not all False and nb_hi - 1 a tile
// that is not (ScoreMods' tile map; both roles walk the tiles with next_key_tile, which passes
// over the all-False ones).  A tile that starts past its sequence's rows (varlen) is skipped by both.
template <int kBM, int kBN, bool kMods = false>
struct FwdWork {
    FwdTile tile;
    SeqInfo seq;
    int hk, nb_lo, nb_hi;
    // (the block checked packed offsets itself: flash_fwd_sm90.cu)
    __device__ __forceinline__ FwdWork(const FlashParams& p, FwdTile t) : FwdWork(p, t, SeqInfo(p, t.b, true)) {}
    __device__ __forceinline__ FwdWork(const FlashParams& p, FwdTile t, const SeqInfo& s) : tile(t), seq(s) {
        hk = t.h / static_cast<int>(p.nheads_q / p.nheads_k);
        int n_lo, n_hi;
        seq.key_range(t.m0, t.m0 + kBM, n_lo, n_hi);
        nb_lo = n_lo / kBN, nb_hi = (n_hi + kBN - 1) / kBN;
        if constexpr (kMods) {
            const ScoreMods mods{p, t.b, t.h, seq.sq, seq.sk};
            mods.narrow_key_tiles<kBM, kBN>(t.m0 / kBM, nb_lo, nb_hi);
            nb_hi = mods.step_key_tile<kBM, kBN, -1>(t.m0 / kBM, nb_hi, nb_lo) + 1;
        }
    }
    // The key tile after nb in the walk from nb_hi - 1 down (nb_lo - 1: none), the same in every
    // lane (broadcast from lane 0, as warp_uniform).  Every lane of the warp calls it.  (The walks
    // step by --nb and add this at the end of their bodies for kMods, and the consumers' second tile
    // is nb_hi - 2 without kMods: next_key_tile in the step or in that start, even where it is nb - 1,
    // made the plain d192/d256 kernels spill 16-140 bytes, nvcc 13.0.)
    __device__ __forceinline__ int next_key_tile(const FlashParams& p, int nb) const {
        if constexpr (kMods) {
            const int next = ScoreMods{p, tile.b, tile.h, seq.sq, seq.sk}.step_key_tile<kBM, kBN, -1>(tile.m0 / kBM, nb, nb_lo);
            return __shfl_sync(0xffffffffu, next, 0);
        } else {
            return nb - 1;
        }
    }
    // The bounds the control flow depends on, broadcast from lane 0 (every lane holds the same
    // values): with them known to be warp-uniform, the compiler keeps the consumers' key loop
    // uniform and builds the wgmma descriptors in uniform registers.  From bounds loaded from
    // memory it did not, inside the tile loop: 3x the moves to uniform registers and no uniform
    // ALU work in the SASS, and 13-17 % of the forward lost (docs/perf-notes.md h10).  Every lane
    // of the warp calls it.
    __device__ __forceinline__ void warp_uniform() {
        seq.sq = __shfl_sync(0xffffffffu, seq.sq, 0);
        nb_lo = __shfl_sync(0xffffffffu, nb_lo, 0);
        nb_hi = __shfl_sync(0xffffffffu, nb_hi, 0);
    }
    __device__ __forceinline__ bool skipped() const { return tile.m0 >= seq.sq; }
    __device__ __forceinline__ bool has_keys() const { return nb_lo < nb_hi; }
};

// The block's barriers: sQ (loaded, freed by every consumer) and the K and V rings; and the
// number and sequence of the tile whose Q q_full announces (written before that arrival, read
// after it, rewritten only after every consumer warp's release on q_empty).
constexpr unsigned kNoTile = 0xffffffffu;
template <int kStages>
struct FwdBarriers {
    u64 q_full, q_empty, k_full[kStages], k_empty[kStages], v_full[kStages], v_empty[kStages];
    u64 tile_full;  // the tile's number and sequence written (a plain arrival: q_full's phase ends with the copy's bytes)
    SeqShared seq;  // the tile's sequence as the producer loaded it (the consumers skip the metadata loads)
    unsigned tile;
};

template <int kBM, int kBN, int kD, int kStages, bool kMods>
__device__ __forceinline__ void load_tiles(const FlashParams& p, const FwdMaps& maps, FwdBarriers<kStages>& bars,
                                           unsigned char* sQ, unsigned char* sK, unsigned char* sV, int lane) {
    constexpr int kTileQ = kBM * kD * 2, kTileKV = kBN * kD * 2;  // bytes
    const TileScheduler<kBM> tiles{p};
    const bool packed = p.cu_seqlens_q != nullptr;
    u64 &q_full = bars.q_full, &q_empty = bars.q_empty;
    if (lane == 0) tma_prefetch(maps.q), tma_prefetch(maps.k), tma_prefetch(maps.v);
    auto ring = RingState<kStages>::producer_start();
    int q_phase = 1;  // sQ starts free
    // The next tile after t, taken by lane 0 and known to the whole warp.
    auto next_tile = [&](unsigned t) { return __shfl_sync(0xffffffffu, lane == 0 ? tiles.next(t) : 0u, 0); };
    for (unsigned t = blockIdx.x; t < tiles.tiles(); t = next_tile(t)) {
        const FwdWork<kBM, kBN, kMods> w(p, tiles(t));
        if (w.skipped()) continue;
        const int kv_batch = packed ? 0 : static_cast<int>(w.seq.kv_row());
        // K or V tile nb into the ring's stage.
        auto load_kv = [&](u64* empty, u64* full, unsigned char* ring_base, const TensorMap& map, int nb) {
            mbar_wait(&empty[ring.stage], ring.phase);
            if (lane == 0) {
                mbar_arrive_expect_tx(&full[ring.stage], kTileKV);
                tma_load_tile<kBN, kD>(ring_base + ring.stage * kTileKV, map, &full[ring.stage],
                                       static_cast<int>(w.seq.k_start) + nb * kBN, w.hk, kv_batch);
            }
            __syncwarp();
        };
        auto load_k = [&](int nb) { load_kv(bars.k_empty, bars.k_full, sK, maps.k, nb); };
        auto load_v = [&](int nb) { load_kv(bars.v_empty, bars.v_full, sV, maps.v, nb); };
        if (w.has_keys()) load_k(w.nb_hi - 1);  // the first K, then Q once sQ is free
        mbar_wait(&q_empty, q_phase);
        q_phase ^= 1;
        if (lane == 0) {
            bars.seq = w.seq.shared();
            bars.tile = t;
            mbar_arrive(&bars.tile_full);
            if (w.has_keys()) {
                mbar_arrive_expect_tx(&q_full, kTileQ);
                tma_load_tile<kBM, kD>(sQ, maps.q, &q_full, static_cast<int>(w.seq.q_start) + w.tile.m0, w.tile.h,
                                       packed ? 0 : w.tile.b);
            } else {
                mbar_arrive(&q_full);
            }
        }
        __syncwarp();
        for (int nb = w.nb_hi - 1; nb >= w.nb_lo; --nb, ring.advance()) {  // (kMods: past all-False tiles)
            if (nb != w.nb_hi - 1) load_k(nb);
            load_v(nb);
            if constexpr (kMods) nb = w.next_key_tile(p, nb) + 1;
        }
    }
    mbar_wait(&q_empty, q_phase);  // the consumers read the last tile's number: tell them there is no other
    if (lane == 0) {
        bars.tile = kNoTile;
        mbar_arrive(&bars.tile_full);
        mbar_arrive(&q_full);
    }
    __syncwarp();
    for (int s = 0; s < kStages; ++s, ring.advance()) {  // leave only once the consumers are done
        mbar_wait(&bars.k_empty[ring.stage], ring.phase);
        mbar_wait(&bars.v_empty[ring.stage], ring.phase);
    }
}
