// Exact attention forward for Hopper (sm_90a), warp-specialised (issue 21): a producer thread
// streams Q, K and V tiles with the bulk tensor copy engine (TMA) into rings of shared-memory
// stages (sm90_pipeline.cuh); two or three consumer warpgroups only compute, and take turns issuing
// their matrix products (ping-pong) so that one warpgroup's softmax runs under the others' wgmma;
// setmaxnreg moves registers from the producer to the consumers.  With kOverlap, S of the next
// tile is issued together with P V of the current one, so that a warpgroup's own softmax also
// runs under its P V.
//
// Shah et al., "FlashAttention-3", 2024: §3.1 (producer/consumer warp specialisation, ping-pong
// scheduling of consumer warpgroups), §3.2 (intra-warpgroup overlap of softmax and GEMMs).
// By role: sm90_fwd_load.cuh (the producer), this file (the consumers' main loop), softmax_tile.cuh
// (the score pipeline, shared with flash_fwd.cu), sm90_fwd_epilogue.cuh, sm90_scheduler.cuh (tile
// order), sm90_pipeline.cuh (barriers, bulk copies, register re-balancing).
//
// Block: warpgroup 0 = producer (its warp 0 walks the tiles, lane 0 issues every copy; the other
// three warps exit at once), warpgroups 1 .. kConsumers = consumers, consumer w owning query rows
// [64 w, 64 w + 64) of a query tile of kBM = 64 kConsumers rows.  The producer picks the block's
// query tiles (sm90_scheduler.cuh: one each, or several on a persistent grid) and hands each to
// the consumers with its Q; the rings, the barriers' phases and the consumers' turns run on from
// one tile to the next, and sQ passes between the roles through q_full (Q landed, the tile's
// number in FwdBarriers::tile) and q_empty (every consumer is done with Q: after its last S with
// kSeparateO, else once the copy engine has read out the O staged in it), so the producer loads the next tile's first K, and with
// kSeparateO its Q, while the consumers finish the last.  Shared memory, swizzled as
// swizzled_tile.cuh (the copy engine's 128-byte swizzle): Q (kBM x kD), then kStages stages of K
// (kBN x kD) and of V (kBN x kD), then with kSeparateO O's staging buffer (kBM x kD).  K and V have their own full/empty barriers,
// so a consumer can start S = Q K^T before V has landed.  Tiles run from the last key tile down.
// Without the overlap, per tile in each consumer: wait K -> [turn] issue S [end] -> wait S,
// release K -> softmax (softmax_tile.cuh) -> wait V -> [turn] issue P V [end] -> wait, release V.
// With it: [turn] issue S_n and P_{n+1} V_{n+1} [end] -> wait S_n, release K -> softmax of S_n (P
// kept in fp32) -> wait P V, release V -> rescale O, pack P_n (the loop in the consumer below).
// Turns: named barrier 1 + w is consumer w's; it syncs on its own and arrives on the next one's
// (the last consumer pre-arrives on consumer 0's, so consumer 0 goes first; consumer 0 absorbs the
// last arrival when the block's last tile is done).  The tail tile's V rows past the sequence's
// keys are set to zero by consumer 0 before its P V (TMA reads them from the array: another
// sequence's rows, or padding that may hold NaN), inside its turn, so the other consumers' P V of
// that stage come after.
#include "params.cuh"
#include "sm90_fwd_epilogue.cuh"
#include "sm90_fwd_load.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_scheduler.cuh"
#include "softmax_tile.cuh"
#include "swizzled_tile.cuh"
#include "varlen_tail.cuh"
#include "warp_gemm.cuh"

#ifndef CUFLASH_DTYPE
#define CUFLASH_DTYPE bf16_t
#endif
#ifndef CUFLASH_HEADDIM
#define CUFLASH_HEADDIM 128
#endif
#ifndef CUFLASH_BLOCK_N
#define CUFLASH_BLOCK_N 128
#endif
#ifndef CUFLASH_STAGES
#define CUFLASH_STAGES 2
#endif
#ifndef CUFLASH_CONSUMERS
#define CUFLASH_CONSUMERS 2
#endif
#ifndef CUFLASH_OVERLAP
#define CUFLASH_OVERLAP 1
#endif
// O staged in a buffer of its own after the K/V rings (where shared memory holds it: the host
// decides, head dims 64 and 128), so that sQ goes back to the producer before the epilogue.
#ifndef CUFLASH_SEPARATE_O
#define CUFLASH_SEPARATE_O 0
#endif
#ifndef CUFLASH_MODS
#define CUFLASH_MODS 0  // 1: additive bias and boolean mask (softmax_tile.cuh, ScoreMods); 2: and dropout
#endif
#ifndef CUFLASH_MODS_RAW
#define CUFLASH_MODS_RAW 0  // 1 (with CUFLASH_MODS, no softcap or ALiBi): the call has no bias, scores stay raw q.k (softmax_tile.cuh)
#endif
#ifndef CUFLASH_SOFTCAP
#define CUFLASH_SOFTCAP 0
#endif
#ifndef CUFLASH_ALIBI
#define CUFLASH_ALIBI 0
#endif
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_fwd_sm90
#endif

namespace ws {
// Registers per thread after setmaxnreg: (producer, consumer) for 2 and 3 consumer warpgroups
// (128 * 24 + 256 * 240 and 128 * 32 + 384 * 160: at most 65536).
template <int kConsumers> constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
template <int kConsumers> constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
constexpr int kTurnBarrier = 1;      // + consumer index: 1 .. kConsumers
constexpr int kConsumerBarrier = 4;  // + consumer index: 4 .. 3 + kConsumers (one warpgroup)

// Named barrier kBase + i for a runtime i < kCount (the ids must be immediates).
template <int kBase, int kCount>
__device__ __forceinline__ void sync_nth(int i, int threads) {
    if constexpr (kCount > 0) {
        if (i == 0) named_barrier_sync<kBase>(threads);
        else sync_nth<kBase + 1, kCount - 1>(i - 1, threads);
    }
}
template <int kBase, int kCount>
__device__ __forceinline__ void arrive_nth(int i, int threads) {
    if constexpr (kCount > 0) {
        if (i == 0) named_barrier_arrive<kBase>(threads);
        else arrive_nth<kBase + 1, kCount - 1>(i - 1, threads);
    }
}
}  // namespace ws

// varlen_tail.cuh's forward part in a call of its own: inlined, its 64-bit loops changed ptxas's
// allocation of the main loops (d192 and d256 spilled 64-160 bytes, nvcc 13.0).
__device__ __noinline__ void forward_tail_of_block(const FlashParams& p) { forward_tail(p, s_first_bad); }

template <class T, int kD, int kBN, int kStages, int kConsumers, bool kSoftcap, bool kAlibi, bool kOverlap, bool kSeparateO,
          bool kMods, bool kDropout, bool kRaw>
__device__ __forceinline__ void flash_fwd_sm90(const FlashParams& p, const FwdMaps& maps) {
    constexpr int kBM = 64 * kConsumers, kNT = kBN / 8, kOT = kD / 8;
    // (softmax_tile.cuh's range form of the mask; at d192/d256 the bias/mask/dropout kernels spill
    // with it, NVRTC 13.0: perf-notes h14)
    constexpr bool kRangeMask = kD <= 128 || !kMods;
    constexpr int kTileQ = kBM * kD * 2, kTileKV = kBN * kD * 2;  // bytes
    static_assert(kD % 64 == 0 && kBN % 16 == 0 && kBN <= 256, "bad tile shape");  // (kBN x 128-byte panels: 1 KB-aligned)
    static_assert(kConsumers == 2 || kConsumers == 3, "2 or 3 consumer warpgroups (registers, barrier ids)");

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // host adds 1 KB
    unsigned char* sQ = smem;                      // (kBM, kD), also staging O without kSeparateO
    unsigned char* sK = sQ + kTileQ;               // kStages x (kBN, kD)
    unsigned char* sV = sK + kStages * kTileKV;    // kStages x (kBN, kD)
    unsigned char* sO = sV + kStages * kTileKV;    // (kBM, kD) with kSeparateO: where O is staged
    __shared__ FwdBarriers<kStages> bars;
    u64 &q_full = bars.q_full, &q_empty = bars.q_empty;
    u64 (&k_full)[kStages] = bars.k_full, (&k_empty)[kStages] = bars.k_empty;
    u64 (&v_full)[kStages] = bars.v_full, (&v_empty)[kStages] = bars.v_empty;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const TileScheduler<kBM> tiles{p};
    if (tid == 0) {
        // sQ: loaded by the producer, freed by every consumer warp.  Each warp reads the tile's number
        // (lane 0) and sequence (every lane) after tile_full and q_full, and frees them only through
        // release_q, whose __syncwarp orders the other lanes' reads before lane 0's arrival on q_empty.
        mbar_init(&q_full, 1), mbar_init(&q_empty, 4 * kConsumers), mbar_init(&bars.tile_full, 1);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(&k_full[s], 1), mbar_init(&v_full[s], 1);
            mbar_init(&k_empty[s], kConsumers), mbar_init(&v_empty[s], kConsumers);  // one arrival per consumer warpgroup
        }
        mbar_init_fence();
    }
    // Varlen: every block checks the offsets, keeps their first bad entries for its own SeqInfo (in
    // shared memory, s_first_bad: no block reads another's) and writes its share of the rows no
    // sequence owns (varlen_tail.cuh), where the sm_80 forward has a kernel launched before it do
    // that: that launch and its drain cost ~4 % of a call at 512-token sequences (perf-notes r4).
    if constexpr (!kMods || kDropout) {  // (bias and mask reach no packed call: not in their variants)
        if (p.cu_seqlens_q) forward_tail_of_block(p);
    }
    __syncthreads();

    if (warp < 4) {  // ---- producer: warp 0 (sm90_fwd_load.cuh); the other three leave ----
        regs_release<ws::kProducerRegs<kConsumers>>();
        if (warp == 0) load_tiles<kBM, kBN, kD, kStages, kMods>(p, maps, bars, sQ, sK, sV, lane);
        return;
    }

    // ---- consumers ----
    regs_acquire<ws::kConsumerRegs<kConsumers>>();
    const int wg = warp / 4 - 1, wtid = tid - 128 * (wg + 1);  // consumer index, thread within it
    // Turns go round the consumers: w syncs on its barrier and arrives on the next one's.
    auto take_turn = [&] { ws::sync_nth<ws::kTurnBarrier, kConsumers>(wg, 256); };
    auto end_turn = [&] { ws::arrive_nth<ws::kTurnBarrier, kConsumers>(wg + 1 == kConsumers ? 0 : wg + 1, 256); };
    auto consumer_barrier = [&] { ws::sync_nth<ws::kConsumerBarrier, kConsumers>(wg, 128); };
    // The turns run on through all the block's tiles: consumer 0 goes first, and absorbs the last
    // consumer's last arrival when the block is done.
    if (wg == kConsumers - 1) end_turn();
    const int r_lo = wg * 64 + (warp % 4) * 16 + lane / 4;  // block row of this thread's first row; the other is + 8
    const u32 q_base = smem_addr(sQ), k_base = smem_addr(sK), v_base = smem_addr(sV);
    RingState<kStages> ring;
    int q_phase = 0;

    for (;;) {
        mbar_wait(&bars.tile_full, q_phase);  // the producer's next tile: its number and sequence
        mbar_wait(&q_full, q_phase);          // and its Q (without keys: a plain arrival)
        q_phase ^= 1;
        unsigned t = 0;
        if (lane == 0) t = bars.tile;  // (lane 0 alone reads it: the thread that frees it, below)
        t = __shfl_sync(0xffffffffu, t, 0);
        if (t == kNoTile) break;
        FwdWork<kBM, kBN, kMods> w(p, tiles(t), SeqInfo(p, bars.seq));  // (read by every lane: __syncwarp before the release)
        w.warp_uniform();
        const SeqInfo& seq = w.seq;
        const int b = w.tile.b, h = w.tile.h, m0 = w.tile.m0, nb_lo = w.nb_lo, nb_hi = w.nb_hi;
        const ScoreArgs score_args = {static_cast<float>(p.softmax_scale), static_cast<float>(p.softmax_scale * 1.4426950408889634),
                                      static_cast<float>(p.softcap), kAlibi ? p.alibi_slopes[b * p.nheads_q + h] : 0.f};
        const ScoreMods mods{p, b, h, seq.sq, seq.sk};  // (read only by kMods kernels)
        const int qpos[2] = {m0 + r_lo, m0 + r_lo + 8};

        float o[kOT][4];  // O accumulator of rows r_lo, r_lo + 8 (wgmma = C-fragment layout), fp32
        zero(o);
        RowState row[2];
        // sQ back to the producer, for the next tile's Q: once this warpgroup's last S = Q K^T is
        // done where O has a buffer of its own (the overlapped loop), else after the epilogue.
        const bool early_release = kSeparateO && kOverlap && nb_lo < nb_hi;
        auto release_q = [&] {
            __syncwarp();  // (every lane read bars.seq; lane 0 frees it)
            if (!kSeparateO && wtid == 0) bulk_wait_read<0>();  // O staged in sQ: read out by the copy engine
            if (lane == 0) mbar_arrive(&q_empty);
        };

        if (w.has_keys()) {
            float s[kNT][4];   // S of the current tile, then (overlap) its P in fp32
            float (&s_flat)[kBN / 2] = reinterpret_cast<float (&)[kBN / 2]>(s);
            float (&o_flat)[kD / 2] = reinterpret_cast<float (&)[kD / 2]>(o);
            u32 pk[kBN / 16][4];  // P as the register A operand of O += P V
            float alpha[2];

            // S = Q K^T of the K tile in `stage`, 16-wide steps over the head dim (not waited for).
            // (The tiles' addresses through uniform(), swizzled_tile.cuh, as every product's here.)
            auto issue_s = [&](int stage) {
                const u32 q_tile = uniform(q_base + wg * 64 * 128), k_tile = uniform(k_base + stage * kTileKV);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < kD / 16; ++ks)
                    wgmma_ss<T, kBN>(s_flat, desc_k_major<kBM>(q_tile, 0, ks), desc_k_major<kBN>(k_tile, 0, ks), ks > 0);
                wgmma_commit();
            };
            // O += P V with the V tile of keys [n0, n0 + kBN) in `stage`, 16 keys per step (not waited
            // for).  Called in the caller's turn: consumer 0 first sets the tail tile's V rows past the
            // keys to zero (the copy engine read them from the array: another sequence's rows, or
            // padding that may hold NaN); the other consumers' products of that stage come in later turns.
            auto issue_pv = [&](int stage, int n0) {
                if (wg == 0 && n0 + kBN > seq.sk) {
                    unsigned char* tile = sV + stage * kTileKV;
                    const int first = max(seq.sk - n0, 0);
                    for (int c = wtid; c < (kBN - first) * kOT; c += 128)
                        *reinterpret_cast<uint4*>(tile + swizzled_chunk<kBN>(first + c / kOT, c % kOT)) = make_uint4(0, 0, 0, 0);
                    fence_async_smem();
                    consumer_barrier();
                }
                const u32 v_tile = uniform(v_base + stage * kTileKV);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kBN / 16; ++kk)
                    wgmma_rs<T, kD>(o_flat, pk[kk], desc_n_major<kBN>(v_tile, kk));
                wgmma_commit();
                wgmma_pin(o_flat);  // the accumulator stays in its registers while the product runs
            };
            auto rescale_o = [&] {
                if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // see flash_fwd.cu
#pragma unroll
                    for (int ot = 0; ot < kOT; ++ot)
#pragma unroll
                        for (int e = 0; e < 4; ++e) o[ot][e] *= alpha[e / 2];
                }
            };
            auto masked = [&](int n0) { return !seq.tile_all_visible(m0, m0 + kBM, n0, n0 + kBN); };
            // Whether tile nb reads the mask (kMods: not where it is all True) and the next tile of the walk.
            auto read_mask = [&](int nb) { return !kMods || mods.tile_state<kBM, kBN>(m0 / kBM, nb) != 1; };
            auto next_tile = [&](int nb) { return w.next_key_tile(p, nb); };

            // One product alone in a turn, waited for at once, its stage then released: S = Q K^T of
            // the K tile in stage `at`, or O += P V of the V tile there (keys [n0, n0 + kBN)).
            auto s_alone = [&](const RingState<kStages>& at) {
                mbar_wait(&k_full[at.stage], at.phase);
                take_turn();
                issue_s(at.stage);
                end_turn();
                wgmma_wait<0>();
                wgmma_pin(s_flat);
                if (wtid == 0) mbar_arrive(&k_empty[at.stage]);
            };
            auto pv_alone = [&](const RingState<kStages>& at, int n0) {
                mbar_wait(&v_full[at.stage], at.phase);
                take_turn();
                issue_pv(at.stage, n0);
                end_turn();
                wgmma_wait<0>();
                wgmma_pin(o_flat);
                if (wtid == 0) mbar_arrive(&v_empty[at.stage]);
            };

            if constexpr (!kOverlap) {
                // Per tile: [turn] S [end] -> softmax -> [turn] P V [end], each product waited for at once.
                for (int nb = nb_hi - 1; nb >= nb_lo; --nb, ring.advance()) {  // (kMods: past all-False tiles, below)
                    const int n0 = nb * kBN;
                    s_alone(ring);
                    softmax_tile<T, kNT, kSoftcap, kAlibi, false, kRangeMask, kMods, kDropout, kRaw>(s, row, pk, alpha, qpos, n0, masked(n0), seq, score_args, lane,
                                                                   &mods, read_mask(nb));
                    rescale_o();
                    pv_alone(ring, n0);
                    if constexpr (kMods) nb = next_tile(nb) + 1;
                }
            } else {
                // FA3 §3.2: S of tile n is issued together with P V of tile n + 1 (the one before it in
                // this descending order) in one turn, and tile n's softmax runs while that P V does.
                // P stays fp32 in s until the product reading pk is done; O is rescaled after it.
                // (The first tile stays peeled off the loop: one loop body for both, with the first
                // P V skipped by a branch, made ptxas serialise every wgmma of the kernel, C7514.)
                int n0 = (nb_hi - 1) * kBN;
                s_alone(ring);
                softmax_tile<T, kNT, kSoftcap, kAlibi, true, kRangeMask, kMods, kDropout, kRaw>(s, row, pk, alpha, qpos, n0, masked(n0), seq, score_args, lane,
                                                                   &mods, read_mask(nb_hi - 1));
                pack_probs<T, kNT>(s, pk);  // (O is still 0: no rescale)
                for (int nb = kMods ? next_tile(nb_hi - 1) : nb_hi - 2; nb >= nb_lo; --nb) {  // (kMods: past all-False tiles, at the end)
                    const int prev_stage = ring.stage, prev_n0 = n0;
                    ring.advance();
                    n0 = nb * kBN;
                    mbar_wait(&k_full[ring.stage], ring.phase);
                    mbar_wait(&v_full[prev_stage], ring.phase ^ (ring.stage == 0));  // (the previous tile's phase)
                    take_turn();
                    issue_s(ring.stage);
                    issue_pv(prev_stage, prev_n0);
                    end_turn();
                    wgmma_wait<1>();  // S is done (P V may still run)
                    wgmma_pin(s_flat);
                    if (wtid == 0) mbar_arrive(&k_empty[ring.stage]);
                    softmax_tile<T, kNT, kSoftcap, kAlibi, true, kRangeMask, kMods, kDropout, kRaw>(s, row, pk, alpha, qpos, n0, masked(n0), seq, score_args, lane,
                                                                   &mods, read_mask(nb));
                    wgmma_wait<0>();  // P V is done: pk and O are free
                    wgmma_pin(o_flat);
                    if (wtid == 0) mbar_arrive(&v_empty[prev_stage]);
                    rescale_o();
                    pack_probs<T, kNT>(s, pk);
                    if constexpr (kMods) nb = next_tile(nb) + 1;
                }
                if (early_release) release_q();  // every S of the tile is done
                pv_alone(ring, n0);
                ring.advance();
            }
        }

        store_o<T, kBM, kMods>(p, maps.o, seq, b, h, m0, o, row, kSeparateO ? sO : sQ, wg, r_lo, wtid, lane, consumer_barrier,
                                kDropout ? mods.out_scale() : 1.f);
        if (!early_release) release_q();
    }
    if (wg == 0) take_turn();  // absorbs the last consumer's last arrival
    if (wtid == 0) bulk_wait<0>();  // the last tile's O stored before shared memory goes
}

// One block per SM: 128 threads per warpgroup (the producer's and the consumers'); ptxas gives
// each 65536 / threads registers, which setmaxnreg re-balances.
extern "C" __global__ void __launch_bounds__(128 * (1 + CUFLASH_CONSUMERS), 1)
CUFLASH_KERNEL_NAME(const __grid_constant__ FlashParams p, const __grid_constant__ FwdMaps maps) {
    flash_fwd_sm90<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_BLOCK_N, CUFLASH_STAGES, CUFLASH_CONSUMERS,
                   CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0, CUFLASH_OVERLAP != 0, CUFLASH_SEPARATE_O != 0,
                   CUFLASH_MODS != 0, CUFLASH_MODS == 2, CUFLASH_MODS_RAW != 0>(p, maps);
}
