// Exact attention backward by recomputation, for sm_80+ (mma.sync, ldmatrix, cp.async).
//
// Dao, "FlashAttention-2", ICLR 2024, Algorithm 2, split into kernels so that no output is
// accumulated with atomics (the result is bitwise repeatable with or without `deterministic`):
//   (bwd_dsum.cu, shared with the Hopper backward: D_i = rowsum(dO_i ∘ O_i), fp32 (float64 for
//   float64), laid out like the LSE)
//   _dq   : one block per (query block, head, batch); warps own 16 query rows.  For each key
//           tile: S = Q Kᵀ, P = exp(S - LSE), dP = dO Vᵀ, dS = P ∘ (dP - D), dQ += dS K.
//   _dkdv : one block per (key block, key/value head, batch); warps own 16 key rows.  For each
//           query head of the GQA group and each query tile: Sᵀ = K Qᵀ, Pᵀ, dPᵀ = V dOᵀ,
//           dSᵀ = Pᵀ ∘ (dPᵀ - D), dV += Pᵀ dO, dK += dSᵀ Q.
// S and dP are recomputed in both _dq and _dkdv (7 matrix products instead of FA2's 5) in
// exchange for no atomics and no fp32 dQ buffer.  An LSE of -inf (a row that sees no key) is read
// as +inf, so P = 2^(s - inf) = 0 and the row contributes nothing.  The softcap derivative
// 1 - tanh² multiplies dS; the softmax scale is applied once, when dQ and dK are written.
// CUFLASH_MODS (score_mods.cuh): 1 an additive bias and a boolean mask in P (natural units, against
// the forward's LSE), and the bias gradient dS added into p.dbias by _dq (which visits every
// (query, key) pair once); 2 also dropout, its keep-mask regenerated from the forward's seed
// (FlashAttention, Dao et al. 2022, Algorithm 4): dV += (P ∘ Z)ᵀ dO, dS = P ∘ (dP ∘ Z - D), with
// Z = keep / (1 - p).  The gradient through the LSE needs no kernel: the host subtracts dlse from D.
// Tiles: kT = 16 kWarps / kColSplit query rows (dq) or key rows (dkdv), kT-wide inner tiles, shared-memory
// rows padded by 16 bytes.  Not handled here: head dims that are not multiples of 8 (the caller pads).
// CUFLASH_DTYPE f32_t / f64_t (issue 24): the float32 (TF32 tensor cores, CUFLASH_TF32_TERMS) and
// float64 (FP64 tensor cores) forms, as flash_fwd.cu's: elements, accumulators, P, dS, the LSE and
// D in the dtype's Acc, every product through warp_gemm.cuh's _f32/_f64 forms with P and dS kept in
// the registers they were formed in; rows padded by 4 elements; ALiBi slopes in double for f64_t.
// Bias, mask and dropout in one form, CUFLASH_MODS 2, whose generator is skipped for calls without
// dropout (ScoreMods::dropout_on: the keep bits start as all kept); a float64 bias is read as double
// and its gradient accumulated in float64 by the float64 form.  With a column split only the slab's
// first warp adds dS into dbias (every warp of the slab holds the same dS).
// CUFLASH_DETERMINISTIC 0 (float32/float64 only, the default there): one pass, _dkdv_dq, that also
// forms dQ += dS K for each (query tile, key block) and adds it to a zeroed dq_accum (the dtype's
// Acc, rows laid out like the LSE, head-dim bucket wide) with atomics, then _dq_convert scales it
// into dq: 5 products and one S/dP recomputation instead of 7 and two (FlashAttention-2,
// Algorithm 2's dQ update), at the price of an order of the dQ sums that varies between calls.  There
// a block may take fewer query rows at a time than it has keys (CUFLASH_QUERY_TILE: 64 keys, 32
// queries; float64 d128/d192 32-64 keys of 8 warps, 16 queries), and a column split's warps form S
// and dP over their own columns, summed over the slab through shared memory (CUFLASH_SPLIT_S,
// sum_over_slab_warps) instead of each forming them whole, each then forming P and dS for its
// share of the tile's elements only and handing them to the others (share_over_slab).
// float64 products on sm_90 in k steps of 4 (m16n8k4; warp_gemm.cuh's CUFLASH_F64_MMA): steps of 8
// hold two more A values in registers, which made the atomic-dQ kernels spill (88-100 bytes at
// d64/d128) and run 5-8 % slower there (perf-notes f10).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(CUFLASH_F64_MMA)
#define CUFLASH_F64_MMA 4
#endif
#include "mma.cuh"
#include "params.cuh"
#include "score_grad.cuh"
#include "tile_io.cuh"
#include "warp_gemm.cuh"

#ifndef CUFLASH_DTYPE
#define CUFLASH_DTYPE half_t
#endif
#ifndef CUFLASH_HEADDIM
#define CUFLASH_HEADDIM 64
#endif
#ifndef CUFLASH_WARPS
#define CUFLASH_WARPS 4
#endif
#ifndef CUFLASH_SOFTCAP
#define CUFLASH_SOFTCAP 0
#endif
#ifndef CUFLASH_ALIBI
#define CUFLASH_ALIBI 0
#endif
#ifndef CUFLASH_MODS
#define CUFLASH_MODS 0  // 1: additive bias and boolean mask (score_mods.cuh); 2: and dropout
#endif
#ifndef CUFLASH_TF32_TERMS
#define CUFLASH_TF32_TERMS 3  // float32: 3 (3xTF32) or 1 (TF32 products)
#endif
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_bwd
#endif
#ifndef CUFLASH_SLAB_WARPS
#define CUFLASH_SLAB_WARPS 1
#endif
#ifndef CUFLASH_DETERMINISTIC
#define CUFLASH_DETERMINISTIC 1  // 0: _dkdv_dq + _dq_convert (atomic dQ; float32/float64)
#endif
#ifndef CUFLASH_SPLIT_S
#define CUFLASH_SPLIT_S 0  // (atomic dQ, column split) 1: each warp of a slab forms S and dP over its own columns, summed (sum_over_slab_warps)
#endif
#ifndef CUFLASH_SLAB_SHARE
#define CUFLASH_SLAB_SHARE 1  // (CUFLASH_SPLIT_S) 1: each warp of a slab forms P and dS for its share of the elements (share_over_slab)
#endif
#ifndef CUFLASH_QUERY_TILE
#define CUFLASH_QUERY_TILE 0  // (atomic dQ) query rows a dK/dV block takes at a time; 0: as many as its key rows
#endif
constexpr int kTf32Terms = CUFLASH_TF32_TERMS;
// kColSplit > 1 (float64 past d64, float32 past d128: dK and dV, or dQ, would not fit in registers;
// _kernels.bwd_variant picks 2, 4 or 8): kColSplit warps take the same 16 rows, each forms S, P, dP
// and dS for them, and each accumulates and stores its share of the output's columns (flash_fwd.cu's
// column split).  `warp` below is the 16-row slab; col0 the warp's first output column.
constexpr int kColSplit = CUFLASH_SLAB_WARPS;

// The tile geometry both kernels share: element and accumulator types (Elem), 16-byte chunk size,
// kT rows per block (16 a slab; a column split's warps share theirs), threads, the padded
// shared-memory row, and the output columns a warp accumulates.  kQT: the query rows the dK/dV
// kernel takes at a time (its inner tile): kT, or with atomic dQ CUFLASH_QUERY_TILE (fewer query
// rows than key rows: 64 keys of 4 warps sharing 32-query tiles of Q and dO, whose copies and dQ
// atomics a key then halve, in 110 KB at float32 d128: 2 blocks = 8 warps an SM against 3 x 2;
// float64 d128: 4 slabs of 2 warps sharing 16-query tiles, 8 warps an SM against one 4-warp block).
template <class T, int kD, int kWarps>
struct BwdShape {
    using E = typename Elem<T>::Storage;
    using A = typename Elem<T>::Acc;
    static_assert(kColSplit == 1 || (Elem<T>::kWide && kWarps % kColSplit == 0), "a column split: float32/float64, whole slabs");
    static constexpr int kPer = 16 / sizeof(E);  // elements per 16-byte chunk
    static constexpr int kT = 16 * kWarps / kColSplit, kThreads = 32 * kWarps, kStride = kD + (Elem<T>::kWide ? 4 : 8);
    static constexpr int kDW = kD / kColSplit;  // output columns a warp accumulates
    static_assert(kD % (8 * kColSplit) == 0, "a warp's output columns are whole 8-column tiles");
    static constexpr int kQT = CUFLASH_QUERY_TILE ? CUFLASH_QUERY_TILE : kT;
    static_assert(kQT % 16 == 0 && kT % kQT == 0 && (kQT == kT || (Elem<T>::kWide && !CUFLASH_DETERMINISTIC)),
                  "a query tile of whole 16-row slabs, dividing the key rows: the atomic-dQ kernel only");
    // Atomic dQ: dS of the (query tile, key block) pair in shared memory as (kQT queries, kLdS);
    // warp w forms dQ for query slab w / kDqParts, columns kDQW wide from (w % kDqParts) kDQW
    // (kQT = kT: its own slab and column share), kCW at a time (the widest multiple of 8 up to 32
    // dividing kDQW), over the block's keys 8 at a time (holding a whole 64-key dS spilled).
    static constexpr int kLdS = kT + 4;
    static constexpr int kDqParts = kWarps / (kQT / 16), kDQW = kD / kDqParts;
    static_assert(kWarps % (kQT / 16) == 0 && kD % (8 * kDqParts) == 0, "dQ: whole 8-column tiles a warp");
    static constexpr int kCW = kDQW % 32 == 0 ? 32 : kDQW % 24 == 0 ? 24 : kDQW % 16 == 0 ? 16 : 8;
    // float64 with atomic dQ: Q, dO, K and V tiles swizzled (tile_io.cuh's swizzle_f64).  Each is
    // read both as rows g / columns t (the S and dP products) and as rows 2t / columns g (B of dV, dK
    // and dQ), which no row padding serves at once: with 32 bytes the second form was 2-way bank
    // conflicted.  (Not in the ordered kernels of deterministic=True: there ptxas 13.0 spilled 1.7 KB
    // in _dq at d128 with it, 0.7 KB without.)
    static constexpr bool kSwz = Elem<T>::kF64 && !CUFLASH_DETERMINISTIC;
    static_assert(!kSwz || kStride % 16 == 4, "swizzle_f64's banks: rows of 4 mod 16 doubles");
};

// addr[0], addr[1] += x, y atomically (float32: one vector reduction on sm_90; addr 8-byte aligned).
template <class A>
__device__ __forceinline__ void red_add2(A* addr, A x, A y) {
#if __CUDA_ARCH__ >= 900 && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))  // (PTX ISA 8.1)
    if constexpr (sizeof(A) == 4) {
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(x), "f"(y) : "memory");
        return;
    }
#endif
    atomicAdd(addr, x);
    atomicAdd(addr + 1, y);
}

// A column split's S^T and dP^T formed once a slab instead of once a warp: each of the kSplit warps
// of a slab contracted only its own columns of K.Q and V.dO, and here the partial tiles (kN 8-query
// C fragments each) go to shared memory `part` (the block's warps x 2 tiles, fragment order) and,
// after one barrier, each warp adds its slab's kSplit partials in the same order, so that all hold
// the same S^T and dP^T (their P and dS then agree bitwise, as when each formed them whole); or
// (kOwnOnly, CUFLASH_SLAB_SHARE) for its own fragment slots only: slot (nt, e) belongs to the slab's
// warp (4 nt + e) % kSplit, which forms that slot's P and dS for the slab (share_over_slab then
// hands them to the others).
template <int kSplit>
__device__ __forceinline__ bool own_slot(int nt, int e, int warp_id) { return (nt * 4 + e) % kSplit == warp_id % kSplit; }

template <int kSplit, bool kOwnOnly, int kN, class A>
__device__ __forceinline__ void sum_over_slab_warps(A (&st)[kN][4], A (&dpt)[kN][4], A* part, int warp_id, int lane) {
    constexpr int kVals = kN * 4 * 32;  // one tile of a warp
    A* mine = part + warp_id * 2 * kVals + lane;
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            mine[(nt * 4 + e) * 32] = st[nt][e];
            mine[kVals + (nt * 4 + e) * 32] = dpt[nt][e];
        }
    __syncthreads();
    const A* slab = part + (warp_id / kSplit) * kSplit * 2 * kVals + lane;
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (kOwnOnly && !own_slot<kSplit>(nt, e, warp_id)) continue;
            A a = 0, b = 0;
#pragma unroll
            for (int c = 0; c < kSplit; ++c) {
                a += slab[c * 2 * kVals + (nt * 4 + e) * 32];
                b += slab[c * 2 * kVals + kVals + (nt * 4 + e) * 32];
            }
            st[nt][e] = a;
            dpt[nt][e] = b;
        }
}

// The other half of sum_over_slab_warps: each warp stores the P^T and dS^T of its own slots
// transposed, as (kQT queries, kLd) tiles keyed by the block's keys (sdS, which the dQ pass reads,
// and sP), and after one barrier loads the slab's other slots from them: every warp of the slab
// then holds the whole P^T and dS^T, each element formed once a slab.
template <int kSplit, int kN, int kLd, class A>
__device__ __forceinline__ void share_over_slab(A (&pt)[kN][4], A (&dst)[kN][4], A* sP, A* sdS, int warp_id, int lane) {
    const int key = warp_id / kSplit * 16 + lane / 4;  // the slab's keys, this lane's rows g and g + 8
    auto at = [&](int nt, int e) { return (nt * 8 + (lane % 4) * 2 + e % 2) * kLd + key + 8 * (e / 2); };
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (own_slot<kSplit>(nt, e, warp_id)) sP[at(nt, e)] = pt[nt][e], sdS[at(nt, e)] = dst[nt][e];
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!own_slot<kSplit>(nt, e, warp_id)) pt[nt][e] = sP[at(nt, e)], dst[nt][e] = sdS[at(nt, e)];
}

// The LSE and D arrays (float; float64 for the float64 kernels), read through the kernel
// parameters at each use.
template <class A>
__device__ __forceinline__ const A* stats(const float* x) { return reinterpret_cast<const A*>(x); }

#define CUFLASH_CAT2(a, b) a##b
#define CUFLASH_CAT(a, b) CUFLASH_CAT2(a, b)

template <class T, int kD, int kWarps, bool kSoftcap, bool kAlibi, bool kMods, bool kDropout>
__device__ __forceinline__ void flash_bwd_dq(const FlashParams& p) {
    using Shape = BwdShape<T, kD, kWarps>;
    using E = typename Shape::E;
    using A = typename Shape::A;
    constexpr int kPer = Shape::kPer, kT = Shape::kT, kThreads = Shape::kThreads, kStride = Shape::kStride, kDW = Shape::kDW;
    constexpr bool kSwz = Shape::kSwz;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    E* sQ = reinterpret_cast<E*>(smem_raw);  // (kT, kStride), reused to stage dQ
    E* sdO = sQ + kT * kStride;              // (kT, kStride)
    E* sK = sdO + kT * kStride;              // (kT, kStride)
    E* sV = sK + kT * kStride;               // (kT, kStride)

    const int tid = threadIdx.x, warp = tid / 32 / kColSplit, lane = tid % 32;
    const int col0 = (tid / 32 % kColSplit) * kDW;
    const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * p.nheads_q) return;
    const int b = static_cast<int>(bh / p.nheads_q), h = static_cast<int>(bh % p.nheads_q);
    const int hk = h / static_cast<int>(p.nheads_q / p.nheads_k);
    const SeqInfo seq(p, b);
    const int m0 = blockIdx.x * kT;
    if (m0 >= seq.sq) return;
    const int rows_valid = min(kT, seq.sq - m0);
    const int qk_chunks = static_cast<int>(p.headdim_qk / kPer), v_chunks = static_cast<int>(p.headdim_v / kPer);

    const E* gQ = static_cast<const E*>(p.q) + b * p.q_batch_stride + (seq.q_start + m0) * p.q_row_stride + h * p.q_head_stride;
    const E* gdO = static_cast<const E*>(p.dout) + b * p.do_batch_stride + (seq.q_start + m0) * p.do_row_stride + h * p.do_head_stride;
    const E* gK = static_cast<const E*>(p.k) + b * p.k_batch_stride + seq.k_start * p.k_row_stride + hk * p.k_head_stride;
    const E* gV = static_cast<const E*>(p.v) + b * p.v_batch_stride + seq.k_start * p.v_row_stride + hk * p.v_head_stride;
    E* gdQ = static_cast<E*>(p.dq) + b * p.dq_batch_stride + (seq.q_start + m0) * p.dq_row_stride + h * p.dq_head_stride;
    const long long stat = seq.lse_row(p, b, h, m0);

    const A scale = static_cast<A>(p.softmax_scale), softcap = static_cast<A>(p.softcap);
    const A slope = kAlibi ? alibi_slope<A>(p, b, h) : A(0);
    const ScoreMods mods{p, b, h, seq.sq, seq.sk};  // (read only by kMods kernels)
    A lse2[2], dsum[2];  // rows lane/4 and lane/4 + 8 of this warp (kMods: natural units)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + 8 * half;
        lse2[half] = r >= rows_valid ? static_cast<A>(__int_as_float(0x7f800000))
                     : lse_for_prob<kMods>(stats<A>(p.lse)[stat + r]);
        dsum[half] = r < rows_valid ? stats<A>(p.dsum)[stat + r] : static_cast<A>(0);
    }

    A dq[kDW / 8][4];
    zero(dq);
    int n_lo, n_hi;
    seq.key_range(m0, m0 + kT, n_lo, n_hi);
    if constexpr (kMods) {  // the key tiles whose mask is not all False (ScoreMods' tile map)
        int lo = n_lo / kT, hi = (n_hi + kT - 1) / kT;
        mods.narrow_key_tiles<kT, kT>(blockIdx.x, lo, hi);
        n_lo = max(n_lo, lo * kT), n_hi = min(n_hi, hi * kT);
    }
    load_tile<kT, kD, kThreads, kStride, false, kSwz>(sQ, gQ, p.q_row_stride, rows_valid, qk_chunks, tid);
    load_tile<kT, kD, kThreads, kStride, false, kSwz>(sdO, gdO, p.do_row_stride, rows_valid, v_chunks, tid);
    cp_async_commit();
    for (int n0 = n_lo / kT * kT; n0 < n_hi; n0 += kT) {
        const int mask_state = kMods ? mods.tile_state<kT, kT>(blockIdx.x, n0 / kT) : 2;
        if (mask_state == 0) continue;  // (kMods) the mask hides the whole tile: it adds nothing
        load_tile<kT, kD, kThreads, kStride, false, kSwz>(sK, gK + n0 * p.k_row_stride, p.k_row_stride, seq.sk - n0, qk_chunks, tid);
        load_tile<kT, kD, kThreads, kStride, false, kSwz>(sV, gV + n0 * p.v_row_stride, p.v_row_stride, seq.sk - n0, v_chunks, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();  // Q, dO (first time), K and V tiles are in shared memory

        A s[kT / 8][4], dp[kT / 8][4];      // this warp's 16 rows x kT keys
        A bm[kT / 8][4];                     // (kMods) their bias, -inf where the mask hides the key: loads in flight during the products
        if constexpr (kMods)
            tile_bias_mask<true>(mods, bm, [&](int nt, int e, int& i, int& j) {
                i = m0 + warp * 16 + lane / 4 + 8 * (e / 2), j = n0 + nt * 8 + (lane % 4) * 2 + e % 2;
            }, mask_state != 1);
        zero(s);
        zero(dp);
        gemm_abt<T, kTf32Terms, kD, kT, kStride, kSwz>(s, sQ + warp * 16 * kStride, sK, lane);    // S = Q Kᵀ
        gemm_abt<T, kTf32Terms, kD, kT, kStride, kSwz>(dp, sdO + warp * 16 * kStride, sV, lane);  // dP = dO Vᵀ
        const bool masked = !seq.tile_all_visible(m0, m0 + kT, n0, n0 + kT);
        PhiloxWords words{};  // dropout: the draws of tiles nt, nt + 1 (nt even) from one generator call; 0 (kept) where the call has none
        const ScoreMods::Draw draw = mods.dropout_draw<kDropout>();
        const bool drop = kDropout && (!Elem<T>::kWide || mods.dropout_on());  // (float32/float64: the call has dropout)
#pragma unroll
        for (int nt = 0; nt < kT / 8; ++nt) {
            if (drop && nt % 2 == 0) words = ScoreMods::draw_words(draw, m0 + warp * 16 + lane / 4, n0 + nt * 8 + (lane % 4) * 2);
            bool kept[4];
            DropoutKey::kept_in_tile(words, nt % 2, draw.limit, kept);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = m0 + warp * 16 + lane / 4 + 8 * (e / 2), j = n0 + nt * 8 + (lane % 4) * 2 + e % 2;
                A dcap, pr;
                if constexpr (kMods) pr = prob_mods<kSoftcap, kAlibi>(s[nt][e], scale, softcap, slope, i, j, seq.offset, lse2[e / 2], bm[nt][e], dcap);
                else pr = prob<kSoftcap, kAlibi>(s[nt][e], scale, softcap, slope, i, j, seq.offset, lse2[e / 2], dcap);
                if (masked && !seq.visible(i, j)) pr = 0;
                const A dpz = kDropout ? dp[nt][e] * mods.template keep_scale<A>(kept[e]) : dp[nt][e];
                const A ds = pr * (dpz - dsum[e / 2]);  // d(loss)/d(final score)
                if constexpr (kMods)
                    if (col0 == 0) mods.add_dbias(i, j, ds);  // (a column split: the slab's first warp)
                s[nt][e] = ds * dcap;  // dS, without the softmax scale
            }
        }
        gemm_cb<T, kTf32Terms, kT, kDW, kStride, kSwz>(dq, s, sK + col0, lane);  // dQ += dS K
        __syncthreads();  // every warp is done with sK, sV before the next tiles overwrite them
    }
    cp_async_wait<0>();  // the Q/dO copies are complete even when no key tile was visited
    __syncthreads();
    store_warp_tile<T, kDW, kStride>(dq, seq.poison(scale), sQ + warp * 16 * kStride + col0, gdQ + warp * 16 * p.dq_row_stride + col0,
                                     p.dq_row_stride, rows_valid - warp * 16, qk_chunks - col0 / kPer, lane);  // (seq.poison: NaN for bad sequences)
}

template <class T, int kD, int kWarps, bool kSoftcap, bool kAlibi, bool kMods, bool kDropout, bool kAtomicDq>
__device__ __forceinline__ void flash_bwd_dkdv(const FlashParams& p) {
    using Shape = BwdShape<T, kD, kWarps>;
    using E = typename Shape::E;
    using A = typename Shape::A;
    constexpr int kPer = Shape::kPer, kT = Shape::kT, kThreads = Shape::kThreads, kStride = Shape::kStride, kDW = Shape::kDW;
    constexpr bool kSwz = Shape::kSwz;
    constexpr int kQT = Shape::kQT, kLdS = Shape::kLdS, kCW = Shape::kCW, kDqParts = Shape::kDqParts, kDQW = Shape::kDQW;
    static_assert(!kAtomicDq || Elem<T>::kWide, "atomic dQ: the float32/float64 kernels (16-bit: flash_bwd_sm90.cu)");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    E* sK = reinterpret_cast<E*>(smem_raw);  // (kT, kStride), reused to stage dK
    E* sV = sK + kT * kStride;               // (kT, kStride), reused to stage dV
    E* sQ = sV + kT * kStride;               // (kQT, kStride)
    E* sdO = sQ + kQT * kStride;             // (kQT, kStride)
    A* sLse2 = reinterpret_cast<A*>(sdO + kQT * kStride);  // (kQT) LSE of the query tile, log2 units (kMods: natural)
    A* sDsum = sLse2 + kQT;                                // (kQT) D of the query tile
    A* sdS = sDsum + kQT;                                  // (kAtomicDq) (kQT queries, kLdS) dS, keys of this block
    // (kSplitS) the warps' partial S^T and dP^T, kWarps x 2 x (16 x kQT): sum_over_slab_warps; and
    // P^T transposed as sdS, (kQT, kLdS): share_over_slab
    constexpr bool kSplitS = kAtomicDq && kColSplit > 1 && CUFLASH_SPLIT_S;
    constexpr bool kShare = kSplitS && CUFLASH_SLAB_SHARE;
    A* sPart = sdS + kQT * kLdS;
    A* sP = sPart + kWarps * 2 * 16 * kQT;

    const int tid = threadIdx.x, warp = tid / 32 / kColSplit, lane = tid % 32;
    const int col0 = (tid / 32 % kColSplit) * kDW;
    const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * p.nheads_k) return;
    const int b = static_cast<int>(bh / p.nheads_k), hk = static_cast<int>(bh % p.nheads_k);
    const int group = static_cast<int>(p.nheads_q / p.nheads_k);
    const SeqInfo seq(p, b);
    const int n0 = blockIdx.x * kT;
    // Padded batches own every row up to seqlen_k (rows past seqlens_k get zero gradients);
    // packed sequences own only their own rows.
    const int write_rows = p.cu_seqlens_k ? seq.sk : static_cast<int>(p.seqlen_k);
    if (n0 >= write_rows) return;
    const int qk_chunks = static_cast<int>(p.headdim_qk / kPer), v_chunks = static_cast<int>(p.headdim_v / kPer);

    const long long k_row = seq.k_start + n0;
    const E* gK = static_cast<const E*>(p.k) + b * p.k_batch_stride + k_row * p.k_row_stride + hk * p.k_head_stride;
    const E* gV = static_cast<const E*>(p.v) + b * p.v_batch_stride + k_row * p.v_row_stride + hk * p.v_head_stride;
    E* gdK = static_cast<E*>(p.dk) + b * p.dk_batch_stride + k_row * p.dk_row_stride + hk * p.dk_head_stride;
    E* gdV = static_cast<E*>(p.dv) + b * p.dv_batch_stride + k_row * p.dv_row_stride + hk * p.dv_head_stride;
    const A scale = static_cast<A>(p.softmax_scale), softcap = static_cast<A>(p.softcap);

    A dk[kDW / 8][4], dv[kDW / 8][4];
    zero(dk);
    zero(dv);
    if (n0 < seq.sk) {
        load_tile<kT, kD, kThreads, kStride, false, kSwz>(sK, gK, p.k_row_stride, seq.sk - n0, qk_chunks, tid);
        load_tile<kT, kD, kThreads, kStride, false, kSwz>(sV, gV, p.v_row_stride, seq.sk - n0, v_chunks, tid);
        cp_async_commit();
        int i_lo, i_hi;
        seq.query_range(n0, n0 + kT, i_lo, i_hi);
        for (int g = 0; g < group; ++g) {  // dK, dV sum over the query heads sharing this K/V head
            const int h = hk * group + g;
            const A slope = kAlibi ? alibi_slope<A>(p, b, h) : A(0);
            const ScoreMods mods{p, b, h, seq.sq, seq.sk};  // (read only by kMods kernels)
            const E* gQ = static_cast<const E*>(p.q) + b * p.q_batch_stride + seq.q_start * p.q_row_stride + h * p.q_head_stride;
            const E* gdO = static_cast<const E*>(p.dout) + b * p.do_batch_stride + seq.q_start * p.do_row_stride + h * p.do_head_stride;
            const long long stat = seq.lse_row(p, b, h, 0);
            int mb_lo = i_lo / kQT, mb_hi = (i_hi + kQT - 1) / kQT;
            if constexpr (kMods) mods.narrow_query_tiles<kQT, kT>(blockIdx.x, mb_lo, mb_hi);  // (the tile map)
            for (int m0 = mb_lo * kQT; m0 < min(i_hi, mb_hi * kQT); m0 += kQT) {
                const int mask_state = kMods ? mods.tile_state<kQT, kT>(m0 / kQT, blockIdx.x) : 2;
                if (mask_state == 0) continue;  // (kMods) the mask hides the whole tile
                const int rows_valid = min(kQT, seq.sq - m0);
                __syncthreads();  // every warp is done with the previous query tile
                load_tile<kQT, kD, kThreads, kStride, false, kSwz>(sQ, gQ + m0 * p.q_row_stride, p.q_row_stride, rows_valid, qk_chunks, tid);
                load_tile<kQT, kD, kThreads, kStride, false, kSwz>(sdO, gdO + m0 * p.do_row_stride, p.do_row_stride, rows_valid, v_chunks, tid);
                cp_async_commit();
                for (int r = tid; r < kQT; r += kThreads) {
                    sLse2[r] = r >= rows_valid ? static_cast<A>(__int_as_float(0x7f800000))
                               : lse_for_prob<kMods>(stats<A>(p.lse)[stat + m0 + r]);
                    sDsum[r] = r < rows_valid ? stats<A>(p.dsum)[stat + m0 + r] : static_cast<A>(0);
                }
                cp_async_wait<0>();
                __syncthreads();  // K, V (first time), Q, dO, LSE and D of this tile are in shared memory

                A st[kQT / 8][4], dpt[kQT / 8][4];    // this warp's 16 keys x kQT queries
                A bm[kQT / 8][4];                      // (kMods) their bias or -inf, loaded during the products
                if constexpr (kMods)
                    tile_bias_mask<false>(mods, bm, [&](int nt, int e, int& i, int& j) {
                        j = n0 + warp * 16 + lane / 4 + 8 * (e / 2), i = m0 + nt * 8 + (lane % 4) * 2 + e % 2;
                    }, mask_state != 1);
                zero(st);
                zero(dpt);
                if constexpr (kSplitS) {  // this warp's columns of the contractions, summed over the slab
                    gemm_abt<T, kTf32Terms, kDW, kQT, kStride, kSwz>(st, sK + warp * 16 * kStride + col0, sQ + col0, lane);
                    gemm_abt<T, kTf32Terms, kDW, kQT, kStride, kSwz>(dpt, sV + warp * 16 * kStride + col0, sdO + col0, lane);
                    sum_over_slab_warps<kColSplit, kShare>(st, dpt, sPart, tid / 32, lane);
                } else {
                    gemm_abt<T, kTf32Terms, kD, kQT, kStride, kSwz>(st, sK + warp * 16 * kStride, sQ, lane);    // Sᵀ = K Qᵀ
                    gemm_abt<T, kTf32Terms, kD, kQT, kStride, kSwz>(dpt, sV + warp * 16 * kStride, sdO, lane);  // dPᵀ = V dOᵀ
                }
                const bool masked = !seq.tile_all_visible(m0, m0 + kQT, n0, n0 + kT);
                // dropout: the draws of queries i (even), i + 1 of tiles nt, nt + 1 (nt even), a generator
                // call each (shared with lane ^ 4); 0 (kept) where the call has none
                unsigned words[2][2] = {{0u, 0u}, {0u, 0u}};
                const ScoreMods::Draw draw = mods.dropout_draw<kDropout>();
                        const bool drop = kDropout && (!Elem<T>::kWide || mods.dropout_on());  // (float32/float64: the call has dropout)
#pragma unroll
                for (int nt = 0; nt < kQT / 8; ++nt) {
                    if (drop && nt % 2 == 0) ScoreMods::keep_words_pair(draw, m0 + nt * 8 + (lane % 4) * 2, n0 + warp * 16 + lane / 4, lane, words);
                    bool kept[2][2];  // [query i + e % 2][key j + 8 (e / 2)]
                    ScoreMods::kept_in_pair_tile(words, nt % 2, draw, kept);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (kShare && !own_slot<kColSplit>(nt, e, tid / 32)) continue;  // (another warp of the slab forms it)
                        const int j = n0 + warp * 16 + lane / 4 + 8 * (e / 2), c = nt * 8 + (lane % 4) * 2 + e % 2;
                        const int i = m0 + c;
                        A dcap, pr;
                        if constexpr (kMods) pr = prob_mods<kSoftcap, kAlibi>(st[nt][e], scale, softcap, slope, i, j, seq.offset, sLse2[c], bm[nt][e], dcap);
                        else pr = prob<kSoftcap, kAlibi>(st[nt][e], scale, softcap, slope, i, j, seq.offset, sLse2[c], dcap);
                        if (masked && !seq.visible(i, j)) pr = 0;
                        const A z = kDropout ? mods.template keep_scale<A>(kept[e % 2][e / 2]) : A(1);
                        st[nt][e] = pr * z;  // (dropout: the P the forward multiplied V by)
                        const A ds = pr * (dpt[nt][e] * z - sDsum[c]);  // d(loss)/d(final score)
                        if constexpr (kMods && kAtomicDq)  // (the ordered kernels: _dq adds it)
                            if (kShare || col0 == 0) mods.add_dbias(i, j, ds);  // (a column split: once a slab)
                        dpt[nt][e] = ds * dcap;  // dSᵀ, without the softmax scale
                    }
                }
                if constexpr (kShare) {  // each warp's slots to the slab's others, dS^T through sdS (dQ's)
                    share_over_slab<kColSplit, kQT / 8, kLdS>(st, dpt, sP, sdS, tid / 32, lane);
                } else if constexpr (kAtomicDq) {  // dS for the block's dQ, transposed: one warp of each slab writes its keys
                    if (tid / 32 % kColSplit == 0) {
#pragma unroll
                        for (int nt = 0; nt < kQT / 8; ++nt)
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                sdS[(nt * 8 + (lane % 4) * 2 + e % 2) * kLdS + warp * 16 + lane / 4 + 8 * (e / 2)] = dpt[nt][e];
                    }
                }
                if constexpr (Elem<T>::kWide) {
                    gemm_cb<T, kTf32Terms, kQT, kDW, kStride, kSwz>(dv, st, sdO + col0, lane);  // dV += Pᵀ dO
                    gemm_cb<T, kTf32Terms, kQT, kDW, kStride, kSwz>(dk, dpt, sQ + col0, lane);  // dK += dSᵀ Q
                } else {  // (both conversions first: the order the 16-bit kernels were tuned with)
                    u32 pa[kQT / 16][4], dsa[kQT / 16][4];
                    c_to_a<T, kQT>(pa, st);
                    c_to_a<T, kQT>(dsa, dpt);
                    warp_gemm_rb<T, kQT, kD, kStride>(dv, pa, sdO, lane);  // dV += Pᵀ dO
                    warp_gemm_rb<T, kQT, kD, kStride>(dk, dsa, sQ, lane);  // dK += dSᵀ Q
                }
                if constexpr (kAtomicDq) {  // dQ += dS K for query slab dq_slab, columns dq_col0.. (Shape::kDQW), kCW at a time
                    if constexpr (!kShare) __syncthreads();  // every slab's dS is in sdS (kShare: since share_over_slab's barrier)
                    const int dq_slab = tid / 32 / kDqParts, dq_col0 = (tid / 32 % kDqParts) * kDQW;
                    // dS of keys k0.. (C-fragment layout: rows = the slab's queries, columns = keys): all
                    // kT keys at once when the query tile is the key block's, else 8 at a time
                    constexpr int kKC = kQT == kT ? kT : 8;
                    auto load_ds = [&](A (&ds)[kKC / 8][4], int k0) {
#pragma unroll
                        for (int nt = 0; nt < kKC / 8; ++nt)
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                ds[nt][e] = sdS[(dq_slab * 16 + lane / 4 + 8 * (e / 2)) * kLdS + k0 + nt * 8 + (lane % 4) * 2 + e % 2];
                    };
                    A ds[kKC / 8][4];
                    if constexpr (kKC == kT) load_ds(ds, 0);
                    A* acc_row = reinterpret_cast<A*>(p.dq_accum) + (stat + m0 + dq_slab * 16 + lane / 4) * kD + dq_col0 + (lane % 4) * 2;
#pragma unroll 1
                    for (int c0 = 0; c0 < kDQW; c0 += kCW) {
                        A dq[kCW / 8][4];
                        zero(dq);
                        if constexpr (kKC == kT) {
                            gemm_cb<T, kTf32Terms, kT, kCW, kStride, kSwz>(dq, ds, sK + dq_col0 + c0, lane);
                        } else {
#pragma unroll 1
                            for (int k0 = 0; k0 < kT; k0 += kKC) {
                                load_ds(ds, k0);
                                gemm_cb<T, kTf32Terms, kKC, kCW, kStride, kSwz>(dq, ds, sK + k0 * kStride + dq_col0 + c0, lane);
                            }
                        }
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            if (dq_slab * 16 + lane / 4 + 8 * half >= rows_valid) continue;  // (queries past the sequence)
#pragma unroll
                            for (int ot = 0; ot < kCW / 8; ++ot)
                                red_add2(acc_row + 8 * half * kD + c0 + ot * 8, dq[ot][2 * half], dq[ot][2 * half + 1]);
                        }
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // all copies landed and every warp is done with sK, sV before they stage dK, dV
    const int rows_valid = min(kT, write_rows - n0) - warp * 16;
    store_warp_tile<T, kDW, kStride>(dk, seq.poison(scale), sK + warp * 16 * kStride + col0, gdK + warp * 16 * p.dk_row_stride + col0,
                                     p.dk_row_stride, rows_valid, qk_chunks - col0 / kPer, lane);
    store_warp_tile<T, kDW, kStride>(dv, seq.poison(static_cast<A>(1)), sV + warp * 16 * kStride + col0,
                                     gdV + warp * 16 * p.dv_row_stride + col0, p.dv_row_stride, rows_valid, v_chunks - col0 / kPer, lane);
}

#if CUFLASH_DETERMINISTIC
extern "C" __global__ void __launch_bounds__(CUFLASH_WARPS * 32) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dq)(const __grid_constant__ FlashParams p) {
    flash_bwd_dq<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_WARPS, CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0, CUFLASH_MODS >= 1,
                 CUFLASH_MODS == 2>(p);
}

extern "C" __global__ void __launch_bounds__(CUFLASH_WARPS * 32) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dkdv)(const __grid_constant__ FlashParams p) {
    flash_bwd_dkdv<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_WARPS, CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0, CUFLASH_MODS >= 1,
                   CUFLASH_MODS == 2, false>(p);
}
#else
extern "C" __global__ void __launch_bounds__(CUFLASH_WARPS * 32) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dkdv_dq)(const __grid_constant__ FlashParams p) {
    flash_bwd_dkdv<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_WARPS, CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0, CUFLASH_MODS >= 1,
                   CUFLASH_MODS == 2, true>(p);
}

// (score_grad.cuh's dq_convert, for the rows of one kQT-row block: the host's dQ grid)
extern "C" __global__ void __launch_bounds__(CUFLASH_WARPS * 32) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _dq_convert)(const __grid_constant__ FlashParams p) {
    using Shape = BwdShape<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_WARPS>;
    dq_convert<CUFLASH_DTYPE, CUFLASH_HEADDIM, Shape::kQT, Shape::kThreads>(p);
}
#endif  // CUFLASH_DETERMINISTIC
