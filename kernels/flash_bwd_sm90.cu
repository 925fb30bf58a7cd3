// Exact attention backward for Hopper (sm_90a): the dq and dkdv kernels of flash_bwd.cu with their
// matrix products on warpgroup MMA (wgmma); the D = rowsum(dO ∘ O) pre-pass stays flash_bwd.cu's.
//
// Dao, "FlashAttention-2", Algorithm 2, in two forms: split as in flash_bwd.cu (_dq + _dkdv, no
// atomics, bitwise repeatable: deterministic=True), or one pass (_dkdv_dq, the default) that also
// forms dQ += dS K per query tile and adds it to an fp32 dq_accum, which _dq_convert scales and
// rounds: 5 matrix products and one P/dS recomputation instead of 7 and two.  Each warpgroup stages
// its dQ columns in shared memory and the copy engine adds them in one bulk reduction (FA3's dQ
// path), dq_accum in dq_tile_offset's tiled order.  At head dim 128 (CUFLASH_PRODUCER) a third
// warpgroup serves the two that compute: its producer warp copies Q, dO and their LSE/D rows, its
// writer warp issues the dQ reductions (sm90_bwd_load.cuh); elsewhere the consumers do both.  The
// output side (dq_accum's panel order, the _dq_convert pass, the staged tile stores) is
// sm90_bwd_epilogue.cuh's.
// Shah et al., "FlashAttention-3", 2024, §3 for the wgmma operand placement.  Warpgroup w of a
// block owns 64 rows (query rows in _dq, key rows in _dkdv); tiles live in the swizzled layout of
// swizzled_tile.cuh, and the tiles the inner loop walks over are double-buffered behind one barrier
// per step: K/V in _dq by cp.async, Q/dO in the dK/dV kernels by the bulk tensor copy engine (one
// thread issues them on the stage's mbarrier; tensor maps BwdMaps).
//   _dq   : per key tile, S = Q Kᵀ and dP = dO Vᵀ (A and B from shared memory), dS = P ∘ (dP - D)
//           in registers, dQ += dS K (dS from registers, K read transposed).
//   _dkdv : per query tile of each GQA head, Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q.
//   _dkdv_dq : the same, and dSᵀ staged in shared memory; warpgroup w forms its kD / kWG columns
//           of dQ = dS K (both operands read transposed) and adds them to dq_accum; dK's product
//           is issued after dQ's and runs while dQ is stored.
// Head dims 64 and 128 in the form above; 256 (and the buckets between 128 and 256, their columns
// past the head dim zero) with the warpgroups of a _dkdv_dq block splitting the columns of dK and
// dV (whole, they do not fit in one warpgroup's registers; each forms Sᵀ, dPᵀ of half the queries
// and shares Pᵀ, dSᵀ through shared memory): CUFLASH_COL_SPLIT.  Deterministic (bitwise
// repeatable) dQ: CUFLASH_DQ_ORDER builds _dkdv_dq with the key blocks adding to each query tile in
// turn, one pass, at every head dim (the dispatch above 64, and at 64 under
// CUFLASH_SM90_ORDERED_DQ: cuflash/_kernels.py's sm90_bwd_variant); CUFLASH_DETERMINISTIC builds
// _dq + _dkdv, which deterministic=True runs at 64 (at 256 its _dq tiles do not fit in shared memory).
// CUFLASH_MODS as flash_bwd.cu's (score_mods.cuh): 1 bias and mask in P (natural units, against the
// forward's LSE), the bias gradient added by the dK/dV kernel (in both dQ schemes it visits every
// (query, key) pair once); 2 also dropout: dV += (P ∘ Z)ᵀ dO, dS = P ∘ (dP ∘ Z - D).
#include "params.cuh"
#include "score_grad.cuh"
#include "sm90_bwd_epilogue.cuh"
#include "sm90_bwd_load.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_scheduler.cuh"
#include "swizzled_tile.cuh"
#include "warp_gemm.cuh"

#ifndef CUFLASH_DTYPE
#define CUFLASH_DTYPE bf16_t
#endif
#ifndef CUFLASH_HEADDIM
#define CUFLASH_HEADDIM 128
#endif
// Rows of the tiles the inner loop walks over: keys in _dq, queries in _dkdv.
#ifndef CUFLASH_INNER
#define CUFLASH_INNER 64
#endif
#ifndef CUFLASH_WARPGROUPS
#define CUFLASH_WARPGROUPS 2
#endif
#ifndef CUFLASH_MIN_BLOCKS
#define CUFLASH_MIN_BLOCKS 1
#endif
#ifndef CUFLASH_SOFTCAP
#define CUFLASH_SOFTCAP 0
#endif
#ifndef CUFLASH_DETERMINISTIC
#define CUFLASH_DETERMINISTIC 0
#endif
#ifndef CUFLASH_ALIBI
#define CUFLASH_ALIBI 0
#endif
// Head dims above 128: the warpgroups of a dkdv block share its 64 key rows and split dK, dV by
// columns (flash_bwd_dkdv_sm90's kColSplit).
#ifndef CUFLASH_COL_SPLIT
#define CUFLASH_COL_SPLIT 0
#endif
#ifndef CUFLASH_MODS
#define CUFLASH_MODS 0  // 1: additive bias and boolean mask (score_mods.cuh); 2: and dropout
#endif
// 1: _dkdv_dq with a producer warpgroup before its consumers (flash_bwd_dkdv_sm90's kProducer):
// 128 more threads a block
#ifndef CUFLASH_PRODUCER
#define CUFLASH_PRODUCER 0
#endif
// 1: _dkdv_dq with dQ's additions in a fixed order (deterministic=True; flash_bwd_dkdv_sm90's kDqOrdered)
#ifndef CUFLASH_DQ_ORDER
#define CUFLASH_DQ_ORDER 0
#endif
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_bwd_sm90
#endif
#define CUFLASH_CAT2(a, b) a##b
#define CUFLASH_CAT(a, b) CUFLASH_CAT2(a, b)

template <class T, int kD, int kBN, int kWG, bool kSoftcap, bool kAlibi, bool kMods, bool kDropout>
__device__ __forceinline__ void flash_bwd_dq_sm90(const FlashParams& p) {
    constexpr int kBM = 64 * kWG, kThreads = 128 * kWG, kNT = kBN / 8;
    constexpr int kTileQ = kBM * kD * 2, kTileKV = kBN * kD * 2;  // bytes
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sQ = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // (kBM, kD), reused to stage dQ
    unsigned char* sdO = sQ + kTileQ;        // (kBM, kD)
    unsigned char* sK = sdO + kTileQ;        // 2 stages of (kBN, kD)
    unsigned char* sV = sK + 2 * kTileKV;    // 2 stages of (kBN, kD)

    const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;
    const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * p.nheads_q) return;
    const int b = static_cast<int>(bh / p.nheads_q), h = static_cast<int>(bh % p.nheads_q);
    const int hk = h / static_cast<int>(p.nheads_q / p.nheads_k);
    const SeqInfo seq(p, b);
    const int m0 = blockIdx.x * kBM;
    if (m0 >= seq.sq) return;
    const int rows_valid = min(kBM, seq.sq - m0);
    const int qk_chunks = static_cast<int>(p.headdim_qk / 8), v_chunks = static_cast<int>(p.headdim_v / 8);

    const u16* gQ = static_cast<const u16*>(p.q) + b * p.q_batch_stride + (seq.q_start + m0) * p.q_row_stride + h * p.q_head_stride;
    const u16* gdO = static_cast<const u16*>(p.dout) + b * p.do_batch_stride + (seq.q_start + m0) * p.do_row_stride + h * p.do_head_stride;
    const u16* gK = static_cast<const u16*>(p.k) + b * p.k_batch_stride + seq.k_start * p.k_row_stride + hk * p.k_head_stride;
    const u16* gV = static_cast<const u16*>(p.v) + b * p.v_batch_stride + seq.k_start * p.v_row_stride + hk * p.v_head_stride;
    u16* gdQ = static_cast<u16*>(p.dq) + b * p.dq_batch_stride + (seq.q_start + m0) * p.dq_row_stride + h * p.dq_head_stride;
    const long long stat = seq.lse_row(p, b, h, m0);

    const float scale = static_cast<float>(p.softmax_scale), softcap = static_cast<float>(p.softcap);
    const float slope = kAlibi ? p.alibi_slopes[b * p.nheads_q + h] : 0.f;
    const int r_lo = wg * 64 + wg_row(tid);  // block rows r_lo and r_lo + 8
    const ScoreMods mods{p, b, h, seq.sq, seq.sk};  // (read only by kMods kernels)
    float lse2[2], dsum[2];  // (kMods: the LSE in natural units)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = r_lo + 8 * half;
        lse2[half] = r >= rows_valid ? __int_as_float(0x7f800000)
                     : lse_for_prob<kMods>(p.lse[stat + r]);
        dsum[half] = r < rows_valid ? p.dsum[stat + r] : 0.f;
    }

    float dq[kD / 8][4];
    zero(dq);
    int n_lo, n_hi;
    seq.key_range(m0, m0 + kBM, n_lo, n_hi);
    int nb_lo = n_lo / kBN, nb_hi = (n_hi + kBN - 1) / kBN;
    // kMods: the key tiles whose mask is not all False (ScoreMods' tile map, where it was made for these tiles)
    if constexpr (kMods) mods.narrow_key_tiles<kBM, kBN>(blockIdx.x, nb_lo, nb_hi);
    auto next_tile = [&](int nb) { return kMods ? mods.step_key_tile<kBM, kBN, 1>(blockIdx.x, nb, nb_hi - 1) : nb + 1; };
    const int nb_first = next_tile(nb_lo - 1);
    auto load_kv = [&](int nb, int stage) {
        const int n0 = nb * kBN;
        load_tile_swizzled<kBN, kD, kThreads>(sK + stage * kTileKV, gK + n0 * p.k_row_stride, p.k_row_stride, seq.sk - n0, qk_chunks, tid);
        load_tile_swizzled<kBN, kD, kThreads>(sV + stage * kTileKV, gV + n0 * p.v_row_stride, p.v_row_stride, seq.sk - n0, v_chunks, tid);
        cp_async_commit();
    };
    load_tile_swizzled<kBM, kD, kThreads>(sQ, gQ, p.q_row_stride, rows_valid, qk_chunks, tid);
    load_tile_swizzled<kBM, kD, kThreads>(sdO, gdO, p.do_row_stride, rows_valid, v_chunks, tid);
    if (nb_first < nb_hi) load_kv(nb_first, 0);
    else cp_async_commit();
    const u32 q_base = smem_addr(sQ), do_base = smem_addr(sdO), k_base = smem_addr(sK), v_base = smem_addr(sV);

    for (int nb = nb_first, stage = 0, nb_next; nb < nb_hi; nb = nb_next, stage ^= 1) {
        const int n0 = nb * kBN;
        nb_next = next_tile(nb);
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();  // this K/V tile (and Q, dO) landed; every warp is done with the other stage
        if (nb_next < nb_hi) load_kv(nb_next, stage ^ 1);

        float s[kNT][4], dp[kNT][4];  // rows r_lo, r_lo + 8 x kBN keys
        float (&s_flat)[kBN / 2] = reinterpret_cast<float (&)[kBN / 2]>(s);
        float (&dp_flat)[kBN / 2] = reinterpret_cast<float (&)[kBN / 2]>(dp);
        // (the tiles' addresses through uniform(): descriptors on the uniform datapath, swizzled_tile.cuh)
        const u32 q_tile = uniform(q_base + wg * 64 * 128), do_tile = uniform(do_base + wg * 64 * 128);
        const u32 k_tile = uniform(k_base + stage * kTileKV), v_tile = uniform(v_base + stage * kTileKV);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks)  // S = Q Kᵀ
            wgmma_ss<T, kBN>(s_flat, desc_k_major<kBM>(q_tile, 0, ks), desc_k_major<kBN>(k_tile, 0, ks), ks > 0);
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks)  // dP = dO Vᵀ
            wgmma_ss<T, kBN>(dp_flat, desc_k_major<kBM>(do_tile, 0, ks), desc_k_major<kBN>(v_tile, 0, ks), ks > 0);
        wgmma_commit();
        float bm[kNT][4];  // (kMods) the bias of S, -inf where the mask hides the key: loads in flight during the products
        if constexpr (kMods)
            tile_bias_mask<true>(mods, bm, [&](int nt, int e, int& i, int& j) {
                i = m0 + r_lo + 8 * (e / 2), j = n0 + nt * 8 + (lane % 4) * 2 + e % 2;
            }, mods.tile_state<kBM, kBN>(blockIdx.x, nb) != 1);
        wgmma_wait<0>();
        wgmma_pin(s_flat);
        wgmma_pin(dp_flat);

        const ScoreMods::Draw draw = mods.dropout_draw<kDropout>();
        with_tile_mask(!seq.tile_all_visible(m0, m0 + kBM, n0, n0 + kBN), [&](auto tile) {
            PhiloxWords words{};  // dropout: the draws of tiles nt, nt + 1 (nt even) from one generator call
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                if (kDropout && nt % 2 == 0) words = ScoreMods::draw_words(draw, m0 + r_lo, n0 + nt * 8 + (lane % 4) * 2);
                bool kept[4];
                DropoutKey::kept_in_tile(words, nt % 2, draw.limit, kept);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = m0 + r_lo + 8 * (e / 2), j = n0 + nt * 8 + (lane % 4) * 2 + e % 2;
                    float dcap, pr;
                    if constexpr (kMods) pr = prob_mods<kSoftcap, kAlibi>(s[nt][e], scale, softcap, slope, i, j, seq.offset, lse2[e / 2], bm[nt][e], dcap);
                    else pr = prob<kSoftcap, kAlibi>(s[nt][e], scale, softcap, slope, i, j, seq.offset, lse2[e / 2], dcap);
                    if (decltype(tile)::value && !seq.visible(i, j)) pr = 0.f;
                    const float dpz = kDropout ? dp[nt][e] * mods.keep_scale(kept[e]) : dp[nt][e];
                    s[nt][e] = pr * (dpz - dsum[e / 2]) * dcap;  // dS, without the softmax scale
                }
            }
        });
        u32 ds[kBN / 16][4];
        c_to_a<T, kBN>(ds, s);
        float (&dq_flat)[kD / 2] = reinterpret_cast<float (&)[kD / 2]>(dq);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk)  // dQ += dS K
            wgmma_rs<T, kD>(dq_flat, ds[kk], desc_n_major<kBN>(k_tile, kk));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_pin(dq_flat);
    }
    cp_async_wait<0>();  // the Q/dO copies are complete even when no key tile was visited
    __syncthreads();     // every warpgroup is done reading sQ before it stages dQ
    store_tile<T, kD, kBM, kThreads>(dq, seq.poison(scale), sQ, wg * 64, gdQ, p.dq_row_stride, rows_valid, qk_chunks, tid);
}

// kColSplit (head dims above 128): the warpgroups share the block's 64 key rows and split the
// head-dim columns of dK and dV (kD / kWG each), which do not fit in one warpgroup's registers
// whole.  Warpgroup w forms Sᵀ, dPᵀ, P and dS of its own kBM / kWG queries and stages Pᵀ and dSᵀ in
// shared memory, from where dV += Pᵀ dO and dK += dSᵀ Q (all queries, its own columns) read them as
// their A operand; dQ = dS K in 64-column slices (FA3's d256 split).  Otherwise warpgroup w owns key
// rows [64 w, 64 w + 64) and keeps P and dS in registers for dV and dK.
//
// kProducer (with kDqAtomic, not the column split): a third warpgroup, first in the block, gives up
// its registers (bwd_ws::kProducerRegs) to the two consumer warpgroups; its warp 0 streams Q, dO and
// their LSE/D rows into the ring (sm90_bwd_load.cuh's bwd_load_steps), its warp 1 adds the
// consumers' dQ panels to dq_accum (bwd_write_dq).  The consumers meet once a step (dSᵀ staged,
// two dSᵀ buffers in turn) and never wait for a copy they issued.
//
// kDqOrdered (deterministic=True): dQ's panels are added to each query tile in one order, the key
// blocks that reach the tile from the last to the first (FlashAttention-3's deterministic mode):
// a counter per tile and panel owner (dq_order_counter) says whose turn it is; the block adds its
// panels when the counter reads its turn and adds 1 once they are done.  The blocks take their
// work in bwd_block's order of the tickets they draw as they start (the counters' first int), so a
// block only waits for blocks already started; the steps walk the query
// tiles from the first (no shift), every block that reaches a tile takes its turn there (the mask's
// tile map narrows nothing; a tile it skips passes the turn on), and dQ, dK, dV are bitwise
// repeatable.  The waits are the writer warp's (kProducer) or thread 0's of each warpgroup, which
// passes its turn on at its next wait for the reductions (bulk_wait instead of bulk_wait_read).
template <class T, int kD, int kBM, int kWG, bool kSoftcap, bool kAlibi, bool kDqAtomic, bool kColSplit, bool kMods,
          bool kDropout, bool kProducer, bool kDqOrdered>
__device__ __forceinline__ void flash_bwd_dkdv_sm90(const FlashParams& p, const BwdMaps& maps) {
    constexpr int kBN = kColSplit ? 64 : 64 * kWG, kThreads = 128 * kWG;  // kBN key rows, kBM-query tiles
    constexpr int kQW = kColSplit ? kBM / kWG : kBM, kNT = kQW / 8;  // the queries of Sᵀ and dPᵀ each warpgroup forms
    constexpr int kTileKV = kBN * kD * 2, kTileQ = kBM * kD * 2;        // bytes
    constexpr int kDc = kColSplit ? kD / kWG : kD;  // the head-dim columns of dK and dV each warpgroup holds
    // (Where it spilled, visible() stays: d64's 168-register cap of three blocks per SM, the softcap
    // forms and the column split at d256 spilled 8-248 bytes with the range form; d128 went from 4-8 to 0.)
    constexpr bool kRangeMask = kD == 128 && !kSoftcap && !kColSplit && !kMods;
    // kDqByKeys (d64 with two warpgroups, whose shares of dQ's columns would be 32 wide): each
    // warpgroup forms all of the tile's dQ over its own 64 keys, and both panels are added to the same
    // tile (kDqOrdered: each to a copy of dq_accum of its own, kDqCopies); a warpgroup then reads only
    // the dSᵀ rows it staged itself.
    constexpr bool kDqByKeys = kDqAtomic && !kColSplit && kD / kWG < 64;
    constexpr int kDqCopies = dq_accum_copies(kD, kWG, kColSplit, kDqOrdered);  // (2: kDqByKeys ordered)
    static_assert(kDqCopies == 1 || (kDqByKeys && kProducer && kDqOrdered), "a dq_accum copy per consumer: d64's ordered producer form");
    constexpr int kDqCols = kDqByKeys ? kD : kD / kWG;  // kDqAtomic: the head-dim columns of dQ each warpgroup forms
    constexpr int kDqSlice = dq_panel_cols(kD, kWG, kColSplit);  // ... in slices (dq_tile_offset's panels) of this many columns
    static_assert(!kDqAtomic || (kBM == 64 && (kDqSlice == 64 || kDqSlice == 128)), "dQ = dS K: 64 query rows, whole 64-column panels");
    // kDqAtomic: dQ staged in shared memory and added by the copy engine, thread 0 of each warpgroup
    // issuing the reductions: in sdQ of its own, where it fits, or with the column split (kDqInStage)
    // in the step's own dO and Q tiles, free once dV and dK are done, read by the copy engine before
    // the next step's barrier lets that stage be loaded again.
    constexpr bool kDqInStage = kDqAtomic && kColSplit;
    static_assert(!kDqInStage || kWG * kBM * kDqSlice * 4 <= kTileQ, "the column split's dQ panels fit a stage's dO and Q tiles");
    static_assert(4 * kBM * 4 <= 1024, "two stages of LSE and D rows fit the 1 KB before sdS");
    // dK's product issued after dQ's and waited for after dQ's store (FA3's order): it overlaps that store
    constexpr bool kDkAfterDq = kDqAtomic && !kColSplit;
    static_assert(kDc % 64 == 0, "dK and dV columns: whole 64-column panels per warpgroup");
    static_assert(!kColSplit || (kDqAtomic && kQW % 16 == 0), "the column split: _dkdv_dq, whole 16-query steps per warpgroup");
    static_assert(!kProducer || (kDqAtomic && !kColSplit && kWG == 2 && kDqCols == kDqSlice), "the producer form: two consumers, a dQ panel each");
    static_assert(!(kProducer && kMods), "the producer form walks every step (no tile-map skips in the producer or writer)");
    static_assert(!kDqOrdered || (kDqAtomic && (kProducer || !kDqByKeys)), "ordered dQ: _dkdv_dq; kDqByKeys (a dq_accum copy per consumer) in the producer form only");
    constexpr int kDsBufs = kProducer ? 2 : 1;  // dSᵀ buffers (the producer form: one a step, in turn)
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sK = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // (kBN, kD), reused to stage dK
    unsigned char* sV = sK + kTileKV;        // (kBN, kD), reused to stage dV
    unsigned char* sQ = sV + kTileKV;        // 2 stages of (kBM, kD)
    unsigned char* sdO = sQ + 2 * kTileQ;    // 2 stages of (kBM, kD)
    float* sLse2 = reinterpret_cast<float*>(sdO + 2 * kTileQ);  // 2 stages of (kBM): LSE in log2 units (kMods: natural)
    float* sDsum = sLse2 + 2 * kBM;                             // 2 stages of (kBM): D
    unsigned char* sdS = sdO + 2 * kTileQ + 1024;               // kDqAtomic: dSᵀ (kBN keys, kBM queries), swizzled
    float* sdQ = reinterpret_cast<float*>(sdS + kDsBufs * kBN * kBM * 2);  // kDqAtomic without kDqInStage: the step's dQ tile (kBM x kD floats)
    unsigned char* sP = sdS + kBN * kBM * 2;                    // kColSplit: Pᵀ (kBN keys, kBM queries), swizzled

    // Q and dO of stage s landed: thread 0 (kProducer: the producer warp) announces the bytes and
    // issues the bulk tensor copies.  kProducer: the consumers free stage s (stage_empty), the
    // writer has read consumer w's dQ panel (dq_empty[w]), which goes to dq_accum + dq_dst[w].
    // Thread tid of the consumers (every thread without kProducer; with it, warpgroup 0 is the producer's)
    const int tid = static_cast<int>(threadIdx.x) - (kProducer ? 128 : 0), wg = tid / 128, lane = tid % 32;
    __shared__ u64 stage_full[2], stage_empty[2], dq_empty[2];
    __shared__ long long dq_dst[2];
    __shared__ int2 dq_order[2];  // kProducer with kDqOrdered: (counter, turn) of each consumer's panel
    __shared__ unsigned ticket;   // kDqOrdered: this block's place in the order the blocks started
    if (threadIdx.x == 0) {
        if constexpr (kDqOrdered) ticket = atomicAdd(reinterpret_cast<unsigned*>(p.split_counters), 1u);
        for (int s = 0; s < 2; ++s) {
            mbar_init(&stage_full[s], kProducer ? 32 : 1);
            if constexpr (kProducer) mbar_init(&stage_empty[s], 4 * kWG), mbar_init(&dq_empty[s], 1);
        }
        mbar_init_fence();
        tma_prefetch(maps.q);
        tma_prefetch(maps.dout);
    }
    __syncthreads();
    // key block blockIdx.x of (batch, K/V head) pair blockIdx.z * gridDim.y + blockIdx.y, or kDqOrdered
    // bwd_block's of the ticket
    const long long bh = kDqOrdered ? bwd_block(p, ticket).pair : static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * p.nheads_k) return;
    const int b = static_cast<int>(bh / p.nheads_k), hk = static_cast<int>(bh % p.nheads_k);
    const int group = static_cast<int>(p.nheads_q / p.nheads_k);
    const SeqInfo seq(p, b);
    const int key_block = kDqOrdered ? bwd_block(p, ticket).key_block : blockIdx.x;
    const int n0 = key_block * kBN;
    // Padded batches own every row up to seqlen_k (rows past seqlens_k get zero gradients);
    // packed sequences own only their own rows.
    const int write_rows = p.cu_seqlens_k ? seq.sk : static_cast<int>(p.seqlen_k);
    if (n0 >= write_rows) return;
    const int qk_chunks = static_cast<int>(p.headdim_qk / 8), v_chunks = static_cast<int>(p.headdim_v / 8);
    const long long k_row = seq.k_start + n0;
    const u16* gK = static_cast<const u16*>(p.k) + b * p.k_batch_stride + k_row * p.k_row_stride + hk * p.k_head_stride;
    const u16* gV = static_cast<const u16*>(p.v) + b * p.v_batch_stride + k_row * p.v_row_stride + hk * p.v_head_stride;
    u16* gdK = static_cast<u16*>(p.dk) + b * p.dk_batch_stride + k_row * p.dk_row_stride + hk * p.dk_head_stride;
    u16* gdV = static_cast<u16*>(p.dv) + b * p.dv_batch_stride + k_row * p.dv_row_stride + hk * p.dv_head_stride;
    const float scale = static_cast<float>(p.softmax_scale), softcap = static_cast<float>(p.softcap);
    const int r_lo = (kColSplit ? 0 : wg * 64) + wg_row(tid);  // key rows r_lo and r_lo + 8 of the block
    const int q_off = kColSplit ? wg * kQW : 0;  // this warpgroup's first query column of Sᵀ and dPᵀ in the tile
    const int c_panel = kColSplit ? wg * kDc / 64 : 0;  // the first 64-column panel of this warpgroup's dK, dV

    float dk[kDc / 8][4], dv[kDc / 8][4];
    zero(dk);
    zero(dv);
    int i_lo = 0, i_hi = 0;
    if (n0 < seq.sk) seq.query_range(n0, n0 + kBN, i_lo, i_hi);
    int mb_lo = i_lo / kBM, mb_hi = i_lo < i_hi ? (i_hi + kBM - 1) / kBM : mb_lo;
    if constexpr (kMods && !kDqOrdered) {  // the query tiles whose mask is not all False for some head of the group (tile map)
        int lo = mb_hi, hi = mb_lo;
        for (int g = 0; g < group; ++g) {
            int l = mb_lo, u = mb_hi;
            ScoreMods{p, b, hk * group + g, seq.sq, seq.sk}.narrow_query_tiles<kBM, kBN>(key_block, l, u);
            if (l < u) lo = min(lo, l), hi = max(hi, u);
        }
        mb_lo = lo < hi ? lo : mb_lo;
        mb_hi = lo < hi ? hi : mb_lo;
    }
    // Step t of the loop: query head hk * group + u / tiles, query tile mb_lo + u % tiles, where
    // u = t, or with atomic dQ in any order u = (t + key block) % steps, so that the key blocks of
    // one head do not all add to the same dQ rows at the same time.
    // The loop walks u without divisions: `cur` holds step t's (u / tiles, u % tiles), `next` step t + 1's.
    BwdSteps<kBM> walk{hk, group, mb_lo, mb_hi - mb_lo, group * (mb_hi - mb_lo), {0, 0}};
    const int tiles = walk.tiles, steps = walk.steps;
    const int shift = kDqAtomic && !kDqOrdered && steps > 0 ? static_cast<int>(static_cast<unsigned>(key_block) % steps) : 0;
    if (tiles > 0) walk.first = {shift / tiles, shift % tiles};

    if constexpr (kProducer) {  // ---- warpgroup 0: the producer warp and the dQ writer warp ----
        if (threadIdx.x < 128) {
            regs_release<bwd_ws::kProducerRegs>();
            const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
            if (warp == 0)
                bwd_load_steps<kBM, kD, kMods>(p, maps, seq, b, walk, sQ, sdO, sLse2, sDsum, stage_full, stage_empty, lane);
            else if (warp == 1)
                bwd_write_dq<kBM * kDqSlice, kDqOrdered>(p.dq_accum, sdQ, dq_dst, dq_empty, lane,
                                                                               p.split_counters, dq_order);
            return;
        }
        regs_acquire<bwd_ws::kConsumerRegs>();
    }
    // ---- the consumers ----
    auto consumer_sync = [&] {  // every consumer thread (kProducer: not the producer warpgroup)
        if constexpr (kProducer) named_barrier_sync<bwd_ws::kConsumerBarrier>(kThreads);
        else __syncthreads();
    };
    StepPos cur = walk.first, next = cur;
    next.advance(tiles, group);
    static_assert(kBM <= kThreads, "a row of LSE and D per thread");
    // kStatsAhead (one block an SM, no producer): a tile's LSE and D are loaded with its copies and
    // stored in the stage at the top of its step, their loads' latency off the step that issues them
    // (with several blocks an SM they are stored at once: two more registers across the loop made
    // d64's 168 spill)
    constexpr bool kStatsAhead = kWG > 1 && !kProducer;
    float next_lse = 0.f, next_dsum = 0.f;
    auto store_stats = [&](int stage) {  // read after the barrier that publishes the stage
        if (tid < kBM) {
            sLse2[stage * kBM + tid] = lse_for_prob<kMods>(next_lse);
            sDsum[stage * kBM + tid] = next_dsum;
        }
    };
    auto load_q = [&](StepPos s, int stage) {  // (without kProducer)
        const int h = walk.head(s), m0 = walk.m0(s);
        const int rows_valid = min(kBM, seq.sq - m0);
        if (tid == 0) copy_q_dout<kBM, kD>(p, maps, seq, b, h, m0, sQ + stage * kTileQ, sdO + stage * kTileQ, &stage_full[stage]);
        // the tile's LSE and D: row tid (threads [0, kBM)); rows past the sequence: P = 0, D = 0
        const long long stat = seq.lse_row(p, b, h, m0);
        if constexpr (kStatsAhead) {
            if (tid < kBM) {  // (an LSE of -inf, which lse_for_prob turns into P = 0)
                next_lse = tid < rows_valid ? p.lse[stat + tid] : -__int_as_float(0x7f800000);
                next_dsum = tid < rows_valid ? p.dsum[stat + tid] : 0.f;
            }
        } else {
            store_stat_rows<kBM, kThreads, kMods>(p, stat, rows_valid, sLse2, sDsum, stage, tid);
        }
    };
    if (tiles > 0) {
        load_tile_swizzled<kBN, kD, kThreads>(sK, gK, p.k_row_stride, seq.sk - n0, qk_chunks, tid);
        load_tile_swizzled<kBN, kD, kThreads>(sV, gV, p.v_row_stride, seq.sk - n0, v_chunks, tid);
        cp_async_commit();
        if constexpr (kProducer) {  // (the loop's barriers do not cover K and V there)
            cp_async_wait<0>();
            fence_async_smem();
            consumer_sync();
        } else {
            load_q(cur, 0);
        }
    }
    // kProducer: the stage this step's consumers free (lane 0 of each warp, once the warp is done
    // with its Q, dO, LSE and D); the dSᵀ buffer of this step; the parity of the dQ handovers
    auto release_stage = [&](int stage) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&stage_empty[stage]);
    };
    int ds_buf = 0, dq_phase = 0;
    // kDqOrdered: this block's turn at query tile m0 (the key blocks that reach it add from the last
    // to the first; the last is the one holding the tile's last visible key, or the last launched:
    // a packed key sequence longer than max_seqlen_k, reported as an error, has keys no block
    // holds), the slot of this warpgroup's panels (dq_order_counter), and, without kProducer, the
    // counter whose turn thread 0 of the warpgroup holds until its reductions are done (-1: none)
    auto turn_at = [&](int m0) {
        int lo, hi;
        seq.key_range(m0, min(m0 + kBM, seq.sq), lo, hi);
        const int launched = static_cast<int>(gridDim.x / static_cast<unsigned>(p.batch * p.nheads_k));
        return min((hi - 1) / kBN, launched - 1) - n0 / kBN;
    };
    const int dq_slot = wg;  // (kDqByKeys with kDqOrdered: each consumer's own copy of dq_accum)
    int turn_held = -1;
    auto pass_turn = [&] {  // (thread 0 of a warpgroup) its reductions are done: the next key block's turn
        bulk_wait<0>();
        if (turn_held >= 0) sem_release_add(p.split_counters + turn_held);
        turn_held = -1;
    };
    auto wait_dq_read = [&] {  // (thread 0 of a warpgroup) the copy engine has read its dQ panels (kDqOrdered: added them)
        if constexpr (kDqOrdered) pass_turn();
        else bulk_wait_read<0>();
    };
    const u32 k_base = smem_addr(sK), v_base = smem_addr(sV), q_base = smem_addr(sQ), do_base = smem_addr(sdO);

    for (int t = 0, stage = 0; t < steps; ++t, stage ^= 1, cur = next, next.advance(tiles, group)) {
        const int h = walk.head(cur), m0 = walk.m0(cur);
        const float slope = kAlibi ? p.alibi_slopes[b * p.nheads_q + h] : 0.f;
        const ScoreMods mods{p, b, h, seq.sq, seq.sk};  // (read only by kMods kernels)
        if constexpr (kStatsAhead) store_stats(stage);
        mbar_wait(&stage_full[stage], (t >> 1) & 1);  // this Q/dO tile landed
        if (!kProducer && t == 0) cp_async_wait<0>();  // (and K, V)
        const bool packed_tail = p.cu_seqlens_q && m0 + kBM > seq.sq;
        if (packed_tail) {
            // The copy engine read the rows past a packed sequence from the array (another
            // sequence's rows, or unwritten rows that may hold NaN): zeros, as P and dS must be 0 there
            const int first = seq.sq - m0;
            for (int c = tid; c < (kBM - first) * (kD / 8); c += kThreads) {
                const int off = swizzled_chunk<kBM>(first + c / (kD / 8), c % (kD / 8));
                *reinterpret_cast<uint4*>(sQ + stage * kTileQ + off) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(sdO + stage * kTileQ + off) = make_uint4(0, 0, 0, 0);
            }
        }
        if (!kProducer || packed_tail) {
            fence_async_smem();
            consumer_sync();  // this Q/dO tile (and K, V) landed; every warp is done with the other stage
        }
        // The next step's copies: here, or (kDqInStage) once the copy engine has read the previous
        // step's dQ panels from that stage, after the barrier in the middle of this step (the
        // reductions then run while this step's Sᵀ and dPᵀ are formed)
        auto load_next = [&] {
            if (t + 1 < steps) load_q(next, stage ^ 1);
        };
        if constexpr (!kDqInStage && !kProducer) load_next();
        const int mask_state = kMods ? mods.tile_state<kBM, kBN>(m0 / kBM, key_block) : 2;
        if (mask_state == 0) {  // (kMods) the mask hides the whole tile: it adds nothing
            if constexpr (kDqOrdered) {  // (and passes its turn there on at once)
                if (tid % 128 == 0) {
                    pass_turn();
                    const int counter = dq_order_counter(p, seq, b, h, m0, dq_slot);
                    sem_wait_eq(p.split_counters + counter, turn_at(m0));
                    sem_release_add(p.split_counters + counter);
                }
                __syncwarp();  // (the warp together again after thread 0's wait, before the barriers)
            }
            if constexpr (kDqInStage) {
                if (tid % 128 == 0) wait_dq_read();
                __syncthreads();
                load_next();
            }
            if constexpr (kProducer) release_stage(stage);
            continue;
        }

        float st[kNT][4], dpt[kNT][4];  // key rows r_lo, r_lo + 8 x queries [q_off, q_off + kQW) of the tile
        float (&st_flat)[kQW / 2] = reinterpret_cast<float (&)[kQW / 2]>(st);
        float (&dpt_flat)[kQW / 2] = reinterpret_cast<float (&)[kQW / 2]>(dpt);
        // (the tiles' addresses through uniform(): descriptors on the uniform datapath, swizzled_tile.cuh)
        const u32 k_rows = uniform(k_base + (r_lo - wg_row(tid)) * 128), v_rows = uniform(v_base + (r_lo - wg_row(tid)) * 128);
        const u32 q_tile = uniform(q_base + stage * kTileQ), do_tile = uniform(do_base + stage * kTileQ);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks)  // Sᵀ = K Qᵀ
            wgmma_ss<T, kQW>(st_flat, desc_k_major<kBN>(k_rows, 0, ks), desc_k_major<kBM>(q_tile, q_off, ks), ks > 0);
        // Without softcap (whose derivative needs S) P is formed while dPᵀ's product runs.
        constexpr bool kPDuringDp = !kSoftcap;
        if constexpr (kPDuringDp) wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks)  // dPᵀ = V dOᵀ
            wgmma_ss<T, kQW>(dpt_flat, desc_k_major<kBN>(v_rows, 0, ks), desc_k_major<kBM>(do_tile, q_off, ks), ks > 0);
        wgmma_commit();
        float bm[kNT][4];  // (kMods) the bias of Sᵀ, -inf where the mask hides the key: loads in flight during the products
        if constexpr (kMods)
            tile_bias_mask<false>(mods, bm, [&](int nt, int e, int& i, int& j) {
                j = n0 + r_lo + 8 * (e / 2), i = m0 + q_off + nt * 8 + (lane % 4) * 2 + e % 2;
            }, mask_state != 1);
        wgmma_wait<kPDuringDp ? 1 : 0>();
        wgmma_pin(st_flat);

        const float* lse2 = sLse2 + stage * kBM;
        const float* dsum = sDsum + stage * kBM;
        auto dsum_at = [&](int nt, int e) { return dsum[q_off + nt * 8 + (lane % 4) * 2 + e % 2]; };
        // P of element e of column tile nt (query m0 + c, key j), and the softcap derivative.
        with_tile_mask(!seq.tile_all_visible(m0, m0 + kBM, n0, n0 + kBN), [&](auto tile) {
            // kRangeMask: each key row's visible queries [lo, hi), relative to this thread's first
            // column, a compare and a select per element instead of visible()'s branches.
            int lo[2] = {0, 0}, hi[2] = {0, 0};
            if constexpr (kRangeMask && decltype(tile)::value) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    seq.visible_queries(n0 + r_lo + 8 * half, m0, m0 + kBM, lo[half], hi[half]);
                    lo[half] -= m0 + (lane % 4) * 2, hi[half] -= m0 + (lane % 4) * 2;
                }
            }
            auto prob_at = [&](int nt, int e, float& dcap) {
                const int j = n0 + r_lo + 8 * (e / 2), i = m0 + q_off + nt * 8 + (lane % 4) * 2 + e % 2;
                float pr;
                if constexpr (kMods) pr = prob_mods<kSoftcap, kAlibi>(st[nt][e], scale, softcap, slope, i, j, seq.offset, lse2[i - m0], bm[nt][e], dcap);
                else pr = prob<kSoftcap, kAlibi>(st[nt][e], scale, softcap, slope, i, j, seq.offset, lse2[i - m0], dcap);
                if constexpr (!decltype(tile)::value) {
                    return pr;
                } else if constexpr (kRangeMask) {
                    const int c = nt * 8 + e % 2;
                    return (c < lo[e / 2]) | (c >= hi[e / 2]) ? 0.f : pr;
                } else {
                    return seq.visible(i, j) ? pr : 0.f;
                }
            };
            if constexpr (kPDuringDp) {
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float one;
                        st[nt][e] = prob_at(nt, e, one);
                    }
                wgmma_wait<0>();
            }
            wgmma_pin(dpt_flat);
            // dropout: the draws of queries i (even), i + 1 of tiles nt, nt + 1 (nt even), a generator call each (shared with lane ^ 4)
            unsigned words[2][2] = {{0u, 0u}, {0u, 0u}};
            const ScoreMods::Draw draw = mods.dropout_draw<kDropout>();
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                if (kDropout && nt % 2 == 0) ScoreMods::keep_words_pair(draw, m0 + q_off + nt * 8 + (lane % 4) * 2, n0 + r_lo, lane, words);
                bool kept[2][2];  // [query i + e % 2][key j + 8 (e / 2)]
                ScoreMods::kept_in_pair_tile(words, nt % 2, draw, kept);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float dcap = 1.f;
                    if constexpr (!kPDuringDp) st[nt][e] = prob_at(nt, e, dcap);
                    if constexpr (kMods) {
                        const int j = n0 + r_lo + 8 * (e / 2), i = m0 + q_off + nt * 8 + (lane % 4) * 2 + e % 2;
                        const float z = kDropout ? mods.keep_scale(kept[e % 2][e / 2]) : 1.f;
                        const float ds = st[nt][e] * (dpt[nt][e] * z - dsum_at(nt, e));  // d(loss)/d(final score)
                        mods.add_dbias(i, j, ds);
                        dpt[nt][e] = ds * dcap;  // dSᵀ, without the softmax scale
                        st[nt][e] *= z;  // (dropout: the P the forward multiplied V by)
                    } else {
                        dpt[nt][e] = st[nt][e] * (dpt[nt][e] - dsum_at(nt, e)) * dcap;  // dSᵀ, without the softmax scale
                    }
                }
            }
        });
        u32 pa[kQW / 16][4], dsa[kQW / 16][4];
        c_to_a<T, kQW>(pa, st);
        c_to_a<T, kQW>(dsa, dpt);
        float (&dv_flat)[kDc / 2] = reinterpret_cast<float (&)[kDc / 2]>(dv);
        float (&dk_flat)[kDc / 2] = reinterpret_cast<float (&)[kDc / 2]>(dk);
        // this thread's rows r_lo, r_lo + 8 of dSᵀ (for dQ; with the column split for dK too) and of
        // Pᵀ (column split: for dV), as rounded for the products, at query chunks q_off / 8 + nt
        auto stage_rows = [&](unsigned char* tile, const u32 (&a)[kQW / 16][4]) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    *reinterpret_cast<u32*>(tile + swizzled_chunk<kBN>(r_lo + 8 * half, q_off / 8 + nt) + (lane % 4) * 4) = a[nt / 2][2 * (nt % 2) + half];
        };
        unsigned char* sdS_t = sdS + ds_buf * (kBN * kBM * 2);  // (kProducer: this step's buffer)
        if constexpr (kDqAtomic) stage_rows(sdS_t, dsa);
        if constexpr (kColSplit) {
            stage_rows(sP, pa);
            fence_async_smem();
            if (tid % 128 == 0) wait_dq_read();  // the previous step's dQ panels were read (the next copies' stage)
            __syncthreads();  // every warpgroup's queries of Pᵀ and dSᵀ are staged (and its Sᵀ, dPᵀ products read Q and dO)
            load_next();
        } else if constexpr (kDqAtomic) {
            fence_async_smem();
        }
        // this warpgroup's columns of dO and Q (the column split's panels: through uniform() again,
        // as wg is not known to be warp-uniform)
        const u32 do_cols = kColSplit ? uniform(do_tile + c_panel * kBM * 128) : do_tile;
        const u32 q_cols = kColSplit ? uniform(q_tile + c_panel * kBM * 128) : q_tile;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk) {  // dV += Pᵀ dO (this warpgroup's columns)
            if constexpr (kColSplit)
                wgmma_ss_n<T, kDc>(dv_flat, desc_k_major<kBN>(uniform(smem_addr(sP)), 0, kk), desc_n_major<kBM>(do_cols, kk), 1);
            else
                wgmma_rs<T, kDc>(dv_flat, pa[kk], desc_n_major<kBM>(do_cols, kk));
        }
        if constexpr (!kDkAfterDq) {
#pragma unroll
            for (int kk = 0; kk < kBM / 16; ++kk) {  // dK += dSᵀ Q
                if constexpr (kColSplit)
                    wgmma_ss_n<T, kDc>(dk_flat, desc_k_major<kBN>(uniform(smem_addr(sdS)), 0, kk), desc_n_major<kBM>(q_cols, kk), 1);
                else
                    wgmma_rs<T, kDc>(dk_flat, dsa[kk], desc_n_major<kBM>(q_cols, kk));
            }
        }
        wgmma_commit();
        if constexpr (kColSplit) {  // dV and dK done first: their register operands (P, dS) free for dQ's slices
            wgmma_wait<0>();
            wgmma_pin(dv_flat);
            wgmma_pin(dk_flat);
        }
        if constexpr (kDqAtomic) {
            // The copy engine has read the previous step's dQ tile (its reduction was
            // issued by thread 0 of each warpgroup a step ago) before the barrier lets sdQ be rewritten
            // (kProducer: the writer warp waits for that, and the consumer for the writer below)
            if (!kDqInStage && !kProducer && tid % 128 == 0) wait_dq_read();
            if constexpr (kDqByKeys) {  // this warpgroup's dSᵀ rows are staged
                if (wg == 0) named_barrier_sync<bwd_ws::kWarpgroupBarrier>(128);
                else named_barrier_sync<bwd_ws::kWarpgroupBarrier + 1>(128);
            } else if constexpr (!kColSplit) {
                consumer_sync();  // every warpgroup's dSᵀ rows are staged (column split: above)
            }
#pragma unroll 1
            for (int slice = 0; slice < kDqCols / kDqSlice; ++slice) {
                const int c0 = (kDqByKeys ? 0 : wg * kDqCols) + slice * kDqSlice;  // the slice's first column
                float dq[kDqSlice / 8][4];  // query rows wg_row, wg_row + 8 of the tile x the slice's columns
                float (&dq_flat)[kDqSlice / 2] = reinterpret_cast<float (&)[kDqSlice / 2]>(dq);
                // (kDqByKeys: from this warpgroup's first key, 64 rows of 128 bytes into dSᵀ and K)
                constexpr int kDqKeys = kDqByKeys ? 64 : kBN;
                const int key0 = kDqByKeys ? wg * 64 * 128 : 0;
                const u32 ds_tile = uniform(smem_addr(sdS_t) + key0), k_cols = uniform(k_base + (c0 / 64) * kBN * 128 + key0);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kDqKeys / 16; ++kk)  // dQ = dS K over this block's keys (kDqByKeys: this warpgroup's)
                    wgmma_ss_mn<T, kDqSlice>(dq_flat, desc_n_major<kBN>(ds_tile, kk), desc_n_major<kBN>(k_cols, kk), kk > 0);
                wgmma_commit();
                if constexpr (kDkAfterDq) {
#pragma unroll
                    for (int kk = 0; kk < kBM / 16; ++kk)  // dK += dSᵀ Q, in flight while dQ is stored
                        wgmma_rs<T, kDc>(dk_flat, dsa[kk], desc_n_major<kBM>(q_cols, kk));
                    wgmma_commit();
                    wgmma_wait<1>();
                } else {
                    wgmma_wait<0>();
                }
                wgmma_pin(dq_flat);
                if constexpr (kProducer) mbar_wait(&dq_empty[wg], dq_phase ^ 1);  // the writer has read the last panel
                // the slice's panel (dq_tile_offset's order), added in one piece
                float* panel = kDqInStage ? reinterpret_cast<float*>((slice == 0 ? sdO : sQ) + stage * kTileQ) + wg * kBM * kDqSlice
                                          : sdQ + (kDqByKeys ? wg : c0 / kDqSlice) * kBM * kDqSlice;
#pragma unroll
                for (int nt = 0; nt < kDqSlice / 8; ++nt)
                    *reinterpret_cast<float4*>(panel + (nt * 128 + tid % 128) * 4) = make_float4(dq[nt][0], dq[nt][1], dq[nt][2], dq[nt][3]);
                // where the panel goes in dq_accum (computed by the thread that passes it on)
                auto dst = [&] {
                    return dq_tile_offset(p, seq, b, h, m0, kD) + (c0 / kDqSlice) * kBM * kDqSlice
                           + (kDqCopies == 2 ? wg * dq_accum_rows(p) * kD : 0);  // (consumer w's copy)
                };
                fence_async_smem();
                if constexpr (kProducer) {  // handed to the writer warp
                    if (tid % 128 == 0) dq_dst[wg] = dst();
                    if constexpr (kDqOrdered) {
                        if (tid % 128 == 0) dq_order[wg] = make_int2(dq_order_counter(p, seq, b, h, m0, dq_slot), turn_at(m0));
                    }
                    if (wg == 0) named_barrier_arrive<bwd_ws::kDqFullBarrier>(bwd_ws::kDqFullThreads);
                    else named_barrier_arrive<bwd_ws::kDqFullBarrier + 1>(bwd_ws::kDqFullThreads);
                    dq_phase ^= 1;
                } else {
                    if (wg == 0) named_barrier_sync<1>(128);
                    else named_barrier_sync<2>(128);
                    if (tid % 128 == 0) {
                        if constexpr (kDqOrdered) {  // (the column split's second slice: the turn still held)
                            turn_held = dq_order_counter(p, seq, b, h, m0, dq_slot);
                            sem_wait_eq(p.split_counters + turn_held, turn_at(m0));
                        }
                        bulk_reduce_add(p.dq_accum + dst(), panel, kBM * kDqSlice * 4);
                        bulk_commit();
                    }
                    if constexpr (kDqOrdered) __syncwarp();  // (after thread 0's wait, before the next wgmma)
                }
            }
            if constexpr (kDkAfterDq) wgmma_wait<0>();
        } else {
            wgmma_wait<0>();
        }
        wgmma_pin(dv_flat);
        wgmma_pin(dk_flat);
        if constexpr (kProducer) {
            release_stage(stage);
            ds_buf ^= 1;
        }
    }
    if constexpr (kProducer) {  // the writer's last round: no panel (its reductions end before it leaves)
        mbar_wait(&dq_empty[wg], dq_phase ^ 1);
        if (tid % 128 == 0) dq_dst[wg] = -1;
        if (wg == 0) named_barrier_arrive<bwd_ws::kDqFullBarrier>(bwd_ws::kDqFullThreads);
        else named_barrier_arrive<bwd_ws::kDqFullBarrier + 1>(bwd_ws::kDqFullThreads);
    } else {
        cp_async_wait<0>();
        if (kDqAtomic && tid % 128 == 0) bulk_wait<0>();  // (the reductions done before the block exits)
        if constexpr (kDqOrdered) {
            if (tid % 128 == 0) pass_turn();
        }
    }
    consumer_sync();  // every warpgroup is done with sK, sV before they stage dK, dV
    const int rows_valid = min(kBN, write_rows - n0);
    store_tile<T, kD, kBN, kThreads, kDc>(dk, seq.poison(scale), sK, r_lo - wg_row(tid), gdK, p.dk_row_stride, rows_valid,
                                          qk_chunks, tid, c_panel * 8, consumer_sync);
    store_tile<T, kD, kBN, kThreads, kDc>(dv, seq.poison(1.f), sV, r_lo - wg_row(tid), gdV, p.dv_row_stride, rows_valid,
                                          v_chunks, tid, c_panel * 8, consumer_sync);
}

// One module per dQ scheme, so that a first call compiles only the kernels it launches (a module
// of all four took 2.6 s to build on the H200 host, perf-notes c2): CUFLASH_DETERMINISTIC=1 builds
// _dq + _dkdv (dQ summed in order, no atomics), 0 builds _dkdv_dq + _dq_convert (fp32 dQ added by
// the copy engine's bulk reductions, in no fixed order).
#if CUFLASH_DETERMINISTIC
extern "C" __global__ void __launch_bounds__(CUFLASH_WARPGROUPS * 128, CUFLASH_MIN_BLOCKS) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dq)(const __grid_constant__ FlashParams p) {
    flash_bwd_dq_sm90<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_INNER, CUFLASH_WARPGROUPS, CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0,
                      CUFLASH_MODS >= 1, CUFLASH_MODS == 2>(p);
}

extern "C" __global__ void __launch_bounds__(CUFLASH_WARPGROUPS * 128, CUFLASH_MIN_BLOCKS) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dkdv)(
    const __grid_constant__ FlashParams p, const __grid_constant__ BwdMaps maps) {
    flash_bwd_dkdv_sm90<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_INNER, CUFLASH_WARPGROUPS, CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0, false, CUFLASH_COL_SPLIT != 0,
                        CUFLASH_MODS >= 1, CUFLASH_MODS == 2, false, false>(p, maps);
}
#else
extern "C" __global__ void __launch_bounds__((CUFLASH_WARPGROUPS + CUFLASH_PRODUCER) * 128, CUFLASH_MIN_BLOCKS) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dkdv_dq)(
    const __grid_constant__ FlashParams p, const __grid_constant__ BwdMaps maps) {
    flash_bwd_dkdv_sm90<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_INNER, CUFLASH_WARPGROUPS, CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0, true, CUFLASH_COL_SPLIT != 0,
                        CUFLASH_MODS >= 1, CUFLASH_MODS == 2, CUFLASH_PRODUCER != 0, CUFLASH_DQ_ORDER != 0>(p, maps);
}

// dq = softmax_scale * dq_accum, rounded, for the rows of one (64 * warpgroups)-row block of a
// sequence (dq_convert_tiles).
extern "C" __global__ void __launch_bounds__(CUFLASH_WARPGROUPS * 128) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dq_convert)(const __grid_constant__ FlashParams p) {
    dq_convert_tiles<CUFLASH_DTYPE, CUFLASH_HEADDIM, dq_panel_cols(CUFLASH_HEADDIM, CUFLASH_WARPGROUPS, CUFLASH_COL_SPLIT != 0),
                     64 * CUFLASH_WARPGROUPS, 128 * CUFLASH_WARPGROUPS,
                     dq_accum_copies(CUFLASH_HEADDIM, CUFLASH_WARPGROUPS, CUFLASH_COL_SPLIT != 0, CUFLASH_DQ_ORDER != 0)>(p);
}
#endif  // CUFLASH_DETERMINISTIC
