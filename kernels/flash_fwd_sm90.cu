// Exact attention forward for Hopper (sm_90a): the FlashAttention-2 algorithm of flash_fwd.cu with
// its two matrix products on warpgroup MMA (wgmma), which reads K and V straight from shared memory.
//
// Shah et al., "FlashAttention-3", 2024, §3 (wgmma; P kept in registers as the A operand of P V).
// Grid and problem setup as flash_fwd.cu.  Block: kWG warpgroups of 4 warps; warpgroup w owns query
// rows [64 w, 64 w + 64) of the block.  Shared memory, in the swizzled layout of swizzled_tile.cuh:
// Q (kBM x kD) and two stages of K and V (kBN x kD each).
// Per key tile: one barrier, then the cp.async copies of the next K/V tile are issued and run
// under S = Q K^T (wgmma, fp32), the score pipeline and online softmax of softmax_tile.cuh, and
// O += P V (wgmma, P from registers, V read transposed).  Head dims 64, 128, 256 (others and every
// other GPU use flash_fwd.cu); the caller pads head dims that are not multiples of 8.
#include "params.cuh"
#include "softmax_tile.cuh"
#include "swizzled_tile.cuh"
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
#ifndef CUFLASH_WARPGROUPS
#define CUFLASH_WARPGROUPS 2
#endif
#ifndef CUFLASH_MIN_BLOCKS
#define CUFLASH_MIN_BLOCKS 1
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

template <class T, int kD, int kBN, int kWG, bool kSoftcap, bool kAlibi>
__device__ __forceinline__ void flash_fwd_sm90(const FlashParams& p) {
    constexpr int kBM = 64 * kWG, kThreads = 128 * kWG;
    constexpr int kNT = kBN / 8, kOT = kD / 8;
    constexpr int kTileQ = kBM * kD * 2, kTileKV = kBN * kD * 2;  // bytes
    static_assert(kD % 64 == 0 && (kBN == 64 || kBN == 128), "bad tile shape");

    // Swizzled tiles need 1024-byte alignment; the host asks for 1 KB of slack.
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char* sQ = smem;                  // (kBM, kD), reused to stage O
    unsigned char* sK = sQ + kTileQ;           // 2 stages of (kBN, kD)
    unsigned char* sV = sK + 2 * kTileKV;      // 2 stages of (kBN, kD)

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wg = warp / 4;                   // warpgroup: query rows [64 wg, 64 wg + 64)
    const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * p.nheads_q) return;
    const int b = static_cast<int>(bh / p.nheads_q), h = static_cast<int>(bh % p.nheads_q);
    const int hk = h / static_cast<int>(p.nheads_q / p.nheads_k);
    const SeqInfo seq(p, b);
    const int m0 = (static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x)) * kBM;  // longest rows (causal) first
    if (m0 >= seq.sq) return;

    const u16* gQ = static_cast<const u16*>(p.q) + b * p.q_batch_stride + (seq.q_start + m0) * p.q_row_stride + h * p.q_head_stride;
    // K/V of this sequence and head: element offsets formed once.  With one block per SM (d256)
    // they stay in registers; at two blocks per SM, held in registers they made d128 spill, so
    // they are kept per warp in shared memory (one LDS.64 per tile).  Rebuilt per tile from the
    // batch row instead, they cost 3-5 % (perf-notes r2).
    constexpr bool kOffsetsInRegs = kD > 128;
    const long long kv_b = seq.kv_row();
    const long long k_offset = kv_b * p.k_batch_stride + seq.k_start * p.k_row_stride + hk * p.k_head_stride;
    const long long v_offset = kv_b * p.v_batch_stride + seq.k_start * p.v_row_stride + hk * p.v_head_stride;
    __shared__ long long s_kv_offset[kOffsetsInRegs ? 1 : kThreads / 32][2];
    if (!kOffsetsInRegs && lane == 0) s_kv_offset[warp][0] = k_offset, s_kv_offset[warp][1] = v_offset;
    __syncwarp();
    auto gK = [&] { return static_cast<const u16*>(p.k) + (kOffsetsInRegs ? k_offset : s_kv_offset[threadIdx.x / 32][0]); };
    auto gV = [&] { return static_cast<const u16*>(p.v) + (kOffsetsInRegs ? v_offset : s_kv_offset[threadIdx.x / 32][1]); };
    u16* gO = static_cast<u16*>(p.out) + b * p.o_batch_stride + (seq.q_start + m0) * p.o_row_stride + h * p.o_head_stride;
    float* gLse = p.lse + seq.lse_row(p, b, h, m0);
    const int rows_valid = min(kBM, seq.sq - m0);
    const int qk_chunks = static_cast<int>(p.headdim_qk / 8), v_chunks = static_cast<int>(p.headdim_v / 8);

    int n_lo, n_hi;
    seq.key_range(m0, m0 + kBM, n_lo, n_hi);
    const int nb_lo = n_lo / kBN, nb_hi = (n_hi + kBN - 1) / kBN;
    auto load_kv = [&](int nb, int stage) {
        const int n0 = nb * kBN;
        load_tile_swizzled<kBN, kD, kThreads>(sK + stage * kTileKV, gK() + n0 * p.k_row_stride, p.k_row_stride, seq.sk - n0, qk_chunks, tid);
        load_tile_swizzled<kBN, kD, kThreads>(sV + stage * kTileKV, gV() + n0 * p.v_row_stride, p.v_row_stride, seq.sk - n0, v_chunks, tid);
        cp_async_commit();
    };

    const ScoreArgs score_args = {static_cast<float>(p.softmax_scale), static_cast<float>(p.softmax_scale * 1.4426950408889634),
                                  static_cast<float>(p.softcap), kAlibi ? p.alibi_slopes[b * p.nheads_q + h] : 0.f};
    const int r_lo = wg * 64 + (warp % 4) * 16 + lane / 4;  // block row of this thread's first row; the other is + 8
    const int qpos[2] = {m0 + r_lo, m0 + r_lo + 8};

    float o[kOT][4];  // O accumulator of rows r_lo, r_lo + 8 (wgmma = C-fragment layout), fp32
    zero(o);
    RowState row[2];

    if (nb_lo < nb_hi) {
        load_tile_swizzled<kBM, kD, kThreads>(sQ, gQ, p.q_row_stride, rows_valid, qk_chunks, tid);
        load_kv(nb_hi - 1, 0);  // start at the tail/diagonal tile
        const u32 q_base = smem_addr(sQ), k_base = smem_addr(sK), v_base = smem_addr(sV);

        for (int nb = nb_hi - 1, stage = 0; nb >= nb_lo; --nb, stage ^= 1) {
            const int n0 = nb * kBN;
            cp_async_wait<0>();
            fence_async_smem();
            __syncthreads();  // K/V of this tile (and Q) landed; every warp is done with the other stage
            if (nb > nb_lo) load_kv(nb - 1, stage ^ 1);

            // S = Q K^T, in 16-wide steps over the head dim.
            float s[kNT][4];
            float (&s_flat)[kBN / 2] = reinterpret_cast<float (&)[kBN / 2]>(s);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kD / 16; ++ks)
                wgmma_ss<T, kBN>(s_flat, desc_k_major<kBM>(q_base, wg * 64, ks), desc_k_major<kBN>(k_base + stage * kTileKV, 0, ks), ks > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(s_flat);

            u32 pk[kBN / 16][4];
            float alpha[2];
            const bool masked = !seq.tile_all_visible(m0, m0 + kBM, n0, n0 + kBN);
            softmax_tile<T, kNT, kSoftcap, kAlibi>(s, row, pk, alpha, qpos, n0, masked, seq, score_args, lane);
            if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // see flash_fwd.cu
#pragma unroll
                for (int ot = 0; ot < kOT; ++ot)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[ot][e] *= alpha[e / 2];
            }

            // O += P V, 16 keys per step.
            float (&o_flat)[kD / 2] = reinterpret_cast<float (&)[kD / 2]>(o);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBN / 16; ++kk)
                wgmma_rs<T, kD>(o_flat, pk[kk], desc_n_major<kBN>(v_base + stage * kTileKV, kk));
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(o_flat);
        }
    }

    // Epilogue: O /= l and LSE; stage this warpgroup's rows of O in its own rows of sQ (swizzled,
    // conflict-free), then store 16-byte chunks.
    __syncthreads();  // all warps are done with shared memory (also covers the empty-range path)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float lse;
        const float inv_l = row[half].finalize(seq.poison(quad_sum(row[half].l)), lse);
        const int r = r_lo + half * 8;
        if (lane % 4 == 0 && r < rows_valid) gLse[r] = lse;
#pragma unroll
        for (int ot = 0; ot < kOT; ++ot)
            *reinterpret_cast<u32*>(sQ + swizzled_chunk<kBM>(r, ot) + (lane % 4) * 4) =
                pack2<T>(RowState::normalize(o[ot][half * 2], inv_l), RowState::normalize(o[ot][half * 2 + 1], inv_l));
    }
    __syncthreads();
    constexpr int kChunks = kD / 8;
#pragma unroll
    for (int c = tid; c < kBM * kChunks; c += kThreads) {
        const int r = c / kChunks, col = c % kChunks;
        if (r < rows_valid && col < v_chunks)
            *reinterpret_cast<uint4*>(gO + r * p.o_row_stride + col * 8) = *reinterpret_cast<const uint4*>(sQ + swizzled_chunk<kBM>(r, col));
    }
}

// CUFLASH_MIN_BLOCKS = 1 leaves each thread up to 255 registers; 2 halves that for two blocks per SM.
extern "C" __global__ void __launch_bounds__(CUFLASH_WARPGROUPS * 128, CUFLASH_MIN_BLOCKS)
CUFLASH_KERNEL_NAME(const __grid_constant__ FlashParams p) {
    flash_fwd_sm90<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_BLOCK_N, CUFLASH_WARPGROUPS, CUFLASH_SOFTCAP != 0,
                   CUFLASH_ALIBI != 0>(p);
}

#ifdef CUFLASH_BLOCK_M  // the loader's grid uses it
static_assert(CUFLASH_BLOCK_M == 64 * CUFLASH_WARPGROUPS, "block rows = 64 per warpgroup");
#endif
