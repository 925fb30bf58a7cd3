// The walk of the Hopper dK/dV kernel (flash_bwd_sm90.cu) over its query tiles, and the two helper
// warps of its warp-specialised form (CUFLASH_PRODUCER): the producer, which streams each step's Q
// and dO tiles (bulk tensor copies) with their LSE and D rows into a 2-stage ring, and the dQ
// writer, which adds each consumer warpgroup's staged dQ panel to dq_accum with one bulk reduction.
// The consumer warpgroups then neither issue copies nor wait for them: they wait on a stage's
// `full` barrier, hand dQ over through shared memory with a named-barrier arrival, and free the
// stage with an arrival on its `empty` barrier (Shah et al., "FlashAttention-3", 2024, §3.1 and the
// backward's Appendix B.3: the producer warp, the dQ writer warp with its bulk reduce-add).
#pragma once
#include "score_grad.cuh"
#include "seqinfo.cuh"
#include "sm90_pipeline.cuh"

// The tensor maps of a dkdv launch (cuflash/_gpu.py's _bwd_maps): Q and dO as (headdim, rows,
// heads, batch) boxes of (64, kBM, 1, 1); packed (varlen) arrays are one batch entry of all their rows.
struct BwdMaps {
    TensorMap q, dout;
};

// A step of the dkdv loop over (query head of the GQA group, query tile) pairs, head-major.
struct StepPos {
    int head, tile;
    __device__ __forceinline__ void advance(int tiles, int group) {  // to the next pair, wrapping
        if (++tile == tiles) {
            tile = 0;
            if (++head == group) head = 0;
        }
    }
};

// A dK/dV block's steps: `steps` = group * tiles (query head, query tile) pairs from `first` on,
// the tiles [mb_lo, mb_lo + tiles) of kBM queries, the heads hk * group + [0, group).
template <int kBM>
struct BwdSteps {
    int hk, group, mb_lo, tiles, steps;
    StepPos first;
    __device__ __forceinline__ int head(StepPos s) const { return hk * group + s.head; }
    __device__ __forceinline__ int m0(StepPos s) const { return (mb_lo + s.tile) * kBM; }
};

// Announce the Q and dO bytes of query tile m0 of head h on `full` and issue their copies into one
// stage's sQ and sdO (one thread; rows past the tensor and columns past the head dim arrive as zeros).
template <int kBM, int kD>
__device__ __forceinline__ void copy_q_dout(const FlashParams& p, const BwdMaps& maps, const SeqInfo& seq, int b, int h,
                                            int m0, unsigned char* sQ, unsigned char* sdO, u64* full) {
    const int q_row = static_cast<int>(seq.q_start) + m0, batch = p.cu_seqlens_q ? 0 : b;
    mbar_arrive_expect_tx(full, 2 * kBM * kD * 2);
    tma_load_tile<kBM, kD>(sQ, maps.q, full, q_row, h, batch);
    tma_load_tile<kBM, kD>(sdO, maps.dout, full, q_row, h, batch);
}

// Stage `stage`'s LSE rows (as lse_for_prob reads them; +inf past the sequence's rows_valid: P = 0)
// and D rows (0 there) of the kBM-row stages at sLse2 and sDsum, from the tile's first LSE row
// `stat`: rows first, first + kStride, ... of kBM.
template <int kBM, int kStride, bool kMods>
__device__ __forceinline__ void store_stat_rows(const FlashParams& p, long long stat, int rows_valid, float* sLse2,
                                                float* sDsum, int stage, int first) {
    for (int r = first; r < kBM; r += kStride) {
        sLse2[stage * kBM + r] = r >= rows_valid ? __int_as_float(0x7f800000) : lse_for_prob<kMods>(p.lse[stat + r]);
        sDsum[stage * kBM + r] = r < rows_valid ? p.dsum[stat + r] : 0.f;
    }
}

// Named barriers of the warp-specialised form: 1 the two consumer warpgroups (256 threads);
// 2 + w consumer w's dQ panel staged (its 128 threads arrive, the writer warp syncs); 4 + w
// consumer w alone (128 threads).
namespace bwd_ws {
// (the block's pool is what __launch_bounds__(384, 1) gives each thread, 168, times 384: setmaxnreg.inc
// waits until the registers it asks for are free, so the split must not exceed the pool)
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * (65536 / 384 / 8 * 8), "the split fits the block's registers");
constexpr int kConsumerBarrier = 1, kDqFullBarrier = 2, kWarpgroupBarrier = 4;
constexpr int kDqFullThreads = 128 + 32;
}  // namespace bwd_ws

// The producer (one warp): for each step, once the consumers freed the stage (`empty`, 8 arrivals:
// lane 0 of each consumer warp), the warp stores the tile's LSE (as lse_for_prob reads it; +inf past
// the sequence: P = 0) and D (0 there) in the stage, each lane arrives on `full` (32 arrivals: the
// rows' release), and lane 0 announces and issues the Q and dO copies (rows past the tensor arrive
// as zeros; rows past a packed sequence are the consumers' to zero).  It leaves once every copy was
// issued: the consumers wait for the last ones, and no stage is written after that.
template <int kBM, int kD, bool kMods>
__device__ __forceinline__ void bwd_load_steps(const FlashParams& p, const BwdMaps& maps, const SeqInfo& seq, int b,
                                               const BwdSteps<kBM>& w, unsigned char* sQ, unsigned char* sdO,
                                               float* sLse2, float* sDsum, u64 (&full)[2], u64 (&empty)[2], int lane) {
    constexpr int kTileQ = kBM * kD * 2;
    auto ring = RingState<2>::producer_start();
    StepPos s = w.first;
    for (int t = 0; t < w.steps; ++t, ring.advance(), s.advance(w.tiles, w.group)) {
        const int h = w.head(s), m0 = w.m0(s), rows_valid = min(kBM, seq.sq - m0);
        const long long stat = seq.lse_row(p, b, h, m0);
        mbar_wait(&empty[ring.stage], ring.phase);
        store_stat_rows<kBM, 32, kMods>(p, stat, rows_valid, sLse2, sDsum, ring.stage, lane);
        if (lane == 0) {
            copy_q_dout<kBM, kD>(p, maps, seq, b, h, m0, sQ + ring.stage * kTileQ, sdO + ring.stage * kTileQ, &full[ring.stage]);
        } else {
            mbar_arrive(&full[ring.stage]);
        }
        __syncwarp();
    }
}

// The dQ writer (one warp): consumer w stages its (kBM x kPanelCols) fp32 panel at panels + w *
// kPanelFloats, puts the float offset in dq_accum where it goes in dst[w] (-1: the block is done)
// and arrives on barrier kDqFullBarrier + w; lane 0 adds the panel by one bulk reduction and, once
// the copy engine has read it, arrives on empty[w] (1 arrival), which the consumer waits for before
// it stages its next panel.  Both consumers hand over once a step, so the writer takes them in turn.
// kOrdered (deterministic dQ): consumer w also puts in turn[w] the counter of its panel's tile
// (its index in `counters`) and this block's turn there; lane 0 waits for the turn before the
// reduction and passes it on once the reduction is done (d64's two panels of one tile go to two
// copies of dq_accum, each under turns of its own: dq_accum_copies).
template <int kPanelFloats, bool kOrdered = false>
__device__ __forceinline__ void bwd_write_dq(float* dq_accum, const float* panels, const volatile long long* dst,
                                             u64 (&empty)[2], int lane, int* counters = nullptr,
                                             const volatile int2* turn = nullptr) {
    for (;;) {
        named_barrier_sync<bwd_ws::kDqFullBarrier>(bwd_ws::kDqFullThreads);
        const long long off0 = dst[0];
        int counter0 = 0;  // (kOrdered, lane 0: read before the arrival on empty[0] lets the consumer rewrite it)
        if (off0 >= 0 && lane == 0) {
            if constexpr (kOrdered) {
                counter0 = turn[0].x;
                sem_wait_eq(counters + counter0, turn[0].y);
            }
            bulk_reduce_add(dq_accum + off0, panels, kPanelFloats * 4);
            bulk_commit();
        }
        if constexpr (kOrdered) __syncwarp();  // (the warp together again after lane 0's wait)
        named_barrier_sync<bwd_ws::kDqFullBarrier + 1>(bwd_ws::kDqFullThreads);
        if (off0 < 0) break;  // (both consumers end in the same round)
        if (lane == 0) {
            // (lane 0 alone reads dst[1]: its own arrival on empty[1] below lets consumer 1 rewrite it)
            const long long off1 = dst[1];
            const int counter1 = kOrdered ? turn[1].x : 0;
            if constexpr (kOrdered) sem_wait_eq(counters + counter1, turn[1].y);
            bulk_reduce_add(dq_accum + off1, panels + kPanelFloats, kPanelFloats * 4);
            bulk_commit();
            bulk_wait_read<1>();
            mbar_arrive(&empty[0]);
            if constexpr (kOrdered) {  // panel 0's sums done: the next key block's turn there
                bulk_wait<1>();        // (not held until panel 1's are: slot 0's order waits on slot 1's less)
                sem_release_add(counters + counter0);
            }
            bulk_wait_read<0>();
            mbar_arrive(&empty[1]);
            if constexpr (kOrdered) {  // the last sums done: the next key block's turn
                bulk_wait<0>();
                sem_release_add(counters + counter1);
            }
        }
        __syncwarp();
    }
    if (lane == 0) bulk_wait<0>();  // (the reductions done before the block exits)
}
