// Exact attention forward, FlashAttention-2 style, for sm_80+ (mma.sync, ldmatrix, cp.async).
//
// Dao, "FlashAttention-2", ICLR 2024, Algorithm 1 and §3.2 (work partitioning).
// Grid: x = query blocks of kBM rows (heaviest first, for causal balance), y/z = batch * heads
// folded to stay under the 65535 limit.  Block: kWarps warps; warp w owns query rows
// [16 kMT w, 16 kMT (w+1)) of the block, so the softmax of a row never leaves its warp (the
// split-KV variant below splits keys over its warps instead).
// Per key tile of kBN keys: S = Q K^T (tensor cores, fp32), score pipeline and mask (only on tiles
// that touch the band edges or the key tail), online softmax, O += P V with P kept in registers.
// Shared memory: Q (kBM x kD), K (kBN x kD), V (kBN x kD), rows padded by kRowPad elements: 8 (16
// bytes) makes ldmatrix reads free of bank conflicts; 16 (32 bytes, split-KV) keeps every global
// 32-byte sector in one 32-byte unit of shared memory, so cp.async asks L2 for each sector once
// (at 16 bytes odd rows take two requests per sector), at the price of 2-way ldmatrix conflicts
// that the many warps of a decode SM hide (docs/perf-notes.md, d7).  V_j is loaded while S_j is
// computed and K_{j+1} while the softmax of S_j runs.  Head dims below kD are zero-filled on load
// and never stored.
// Not handled here: head dims that are not multiples of 8 (the caller pads).
//
// CUFLASH_DTYPE f64_t builds the float64 form (issue 24): elements and accumulators in double,
// both products on the FP64 tensor cores (mma.m16n8k8 on sm_90, m8n8k4 on sm_80, warp_gemm.cuh: the same 16-row C fragments,
// so the score pipeline and the online softmax are the same code in double), P kept in the
// registers of S, the LSE in double.  f32_t the float32 form: float32 elements, products on the
// TF32 tensor cores (mma.m16n8k8), CUFLASH_TF32_TERMS 3 (3xTF32) or 1 (TF32), P kept in S's
// registers; ALiBi slopes in double for f64_t (seqinfo.cuh's alibi_slope).  KV caches (contiguous,
// cache_batch_idx, or paged through p.block_table, every page checked by each block) run this
// one-pass kernel: no split-KV form yet.  Bias, mask and dropout in one form, CUFLASH_MODS 2, whose
// generator is skipped for calls without dropout (softmax_tile.cuh); a float64 bias is read as double
// by the float64 form.  float64 past d128 and float32 at d256 split O's columns over two warps
// (CUFLASH_SLAB_WARPS 2), which split S's keys and swap their halves (CUFLASH_SHARE_S).
//
// CUFLASH_SPLITKV=1 builds the decode variant (Flash-Decoding, Dao et al. 2023): the key range of
// each query block is cut into p.num_splits parts run by separate blocks (grid x = query blocks x
// splits), each writing an fp32 partial output and its LSE, which the last of them to finish
// merges (one launch: no second kernel, whose start and L2 round trips cost 4-5 us a call, d8); K/V
// may be paged through p.block_table; and the p.pack_gqa query heads sharing one K/V head may be
// folded into the row axis (row r = token r / g, head r % g) so each K/V tile is read once for
// all of them.  Used with 16-row blocks, for the few query rows of decoding, whose warps split the
// keys of each tile instead of the rows (warp w takes keys [w kBN / kWarps, (w + 1) kBN / kWarps)),
// their softmax states merged at the end; its K/V copies ask L2 for whole 128-byte lines.
#include "mma.cuh"
#include "params.cuh"
#include "softmax_tile.cuh"
#include "tile_io.cuh"
#include "warp_gemm.cuh"

// Compile-time configuration; the loader overrides these with -D options per variant.
#ifndef CUFLASH_DTYPE
#define CUFLASH_DTYPE half_t
#endif
#ifndef CUFLASH_HEADDIM
#define CUFLASH_HEADDIM 64
#endif
#ifndef CUFLASH_BLOCK_M
#define CUFLASH_BLOCK_M 64
#endif
#ifndef CUFLASH_BLOCK_N
#define CUFLASH_BLOCK_N 64
#endif
#ifndef CUFLASH_WARPS
#define CUFLASH_WARPS 4
#endif
#ifndef CUFLASH_MIN_BLOCKS
#define CUFLASH_MIN_BLOCKS 1
#endif
#ifndef CUFLASH_Q_IN_REGS
#define CUFLASH_Q_IN_REGS 1
#endif
#ifndef CUFLASH_MODS
#define CUFLASH_MODS 0  // 1: additive bias and boolean mask (softmax_tile.cuh, ScoreMods); 2: and dropout
#endif
#ifndef CUFLASH_SOFTCAP
#define CUFLASH_SOFTCAP 0
#endif
#ifndef CUFLASH_ALIBI
#define CUFLASH_ALIBI 0
#endif
#ifndef CUFLASH_SPLITKV
#define CUFLASH_SPLITKV 0
#endif
#ifndef CUFLASH_ROW_PAD
#define CUFLASH_ROW_PAD 8
#endif
#ifndef CUFLASH_TF32_TERMS
#define CUFLASH_TF32_TERMS 3  // float32: 3 (3xTF32, float32's accuracy) or 1 (TF32 products)
#endif
#ifndef CUFLASH_SLAB_WARPS
#define CUFLASH_SLAB_WARPS 1  // float32/float64: warps per 16-row slab, each owning that share of O's columns
#endif
#ifndef CUFLASH_SHARE_S
#define CUFLASH_SHARE_S 0  // with CUFLASH_SLAB_WARPS 2: the slab's warps form halves of S and swap them
#endif
#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_fwd
#endif
constexpr int kTf32Terms = CUFLASH_TF32_TERMS;
// kColSplit 2 (float64 past d128: its O accumulator would be D/2 doubles a thread): two warps take
// the same 16 query rows, both hold S and P for them, and each accumulates half of O's columns.
// kShareS: each of them forms S for its half of the tile's keys only and stores it in shared memory
// (kBM x kBN elements after V, in C-fragment order: [16-row tile][8-key tile][element][lane], so that
// a warp's stores and loads are whole rows of banks), and after the barrier that follows S each
// loads the whole of S back; without it (float64 d256 on 99 KB GPUs) both form all of S (perf-notes f13).
constexpr int kColSplit = CUFLASH_SLAB_WARPS;
constexpr bool kShareS = CUFLASH_SHARE_S != 0;
template <int kValue> struct IntConst { static constexpr int value = kValue; };

// Merge the softmax states of warps that saw different keys of the same rows into warp 0:
// with M the largest running max of a row and f_w = 2^(m_w - M), warp 0 ends with m = M,
// l = sum_w f_w l_w and O = sum_w f_w O_w (each thread its own columns, quad-summed later as
// usual).  buf: kBufBytes of shared memory no warp reads any more.
template <int kMT, int kOT, int kWarps, int kBufBytes, bool kNatural>
__device__ __forceinline__ void merge_key_warps(float (&o)[kMT][kOT][4], RowState (&row)[kMT][2], void* buf,
                                                int warp, int lane) {
    constexpr int kVals = kMT * kOT * 4 + 2 * kMT;  // O and l per thread
    static_assert((kWarps - 1) * 32 * kVals * 4 <= kBufBytes, "the merge buffer does not fit");
    __shared__ float s_max[kWarps][kMT * 16];
    if (lane % 4 == 0)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) s_max[warp][mt * 16 + half * 8 + lane / 4] = row[mt][half].m;
    __syncthreads();  // also: every warp is done with the K/V tiles that buf overlays
    float f[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float m = s_max[0][mt * 16 + half * 8 + lane / 4];
#pragma unroll
            for (int w = 1; w < kWarps; ++w) m = fmaxf(m, s_max[w][mt * 16 + half * 8 + lane / 4]);
            const float diff = row[mt][half].m - RowState::safe_max(m);  // (natural units: times log2 e, RowState)
            f[mt][half] = exp2f(kNatural ? diff * kLog2eF : diff);  // 0 for a warp that saw no key
            row[mt][half].m = m;
        }
    float* mine = static_cast<float*>(buf) + (warp - 1) * kVals * 32 + lane;  // value v at mine[32 v]
    if (warp > 0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int ot = 0; ot < kOT; ++ot)
#pragma unroll
                for (int e = 0; e < 4; ++e) mine[32 * ((mt * kOT + ot) * 4 + e)] = f[mt][e / 2] * o[mt][ot][e];
#pragma unroll
            for (int half = 0; half < 2; ++half) mine[32 * (kMT * kOT * 4 + mt * 2 + half)] = f[mt][half] * row[mt][half].l;
        }
    }
    __syncthreads();
    if (warp == 0) {
        const float* other = static_cast<const float*>(buf) + lane;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int ot = 0; ot < kOT; ++ot)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float acc = f[mt][e / 2] * o[mt][ot][e];
#pragma unroll
                    for (int w = 1; w < kWarps; ++w) acc += other[((w - 1) * kVals + (mt * kOT + ot) * 4 + e) * 32];
                    o[mt][ot][e] = acc;
                }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float l = f[mt][half] * row[mt][half].l;
#pragma unroll
                for (int w = 1; w < kWarps; ++w) l += other[((w - 1) * kVals + kMT * kOT * 4 + mt * 2 + half) * 32];
                row[mt][half].l = l;
            }
        }
    }
}

constexpr int kMaxSplits = 128;  // the host never asks for more

// True in every thread of the block that is the last of `splits` blocks to arrive at *counter,
// which that block resets to 0 for the next launch (the host zeroes counters once, at
// allocation).  Each block fences its partial results before arriving, and the last one after,
// so it sees every block's writes (the CUDA programming guide's last-block reduction).
__device__ __forceinline__ bool arrive_last(int* counter, int splits) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == splits - 1;
        if (last) *counter = 0;  // every block of the group has arrived
        __threadfence();
    }
    __syncthreads();
    return last;
}

// Merge the p.num_splits partial results of one row in one warp (Flash-Decoding's reduction):
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.  A row no split saw gives 0
// and -inf; a NaN partial LSE gives NaN.  Lane l reads the LSEs of splits l, l + 32, ...; the
// first kBatch partial outputs are loaded before those LSEs are reduced, so that the two round
// trips to L2 overlap.  __ldcg: other blocks of this launch wrote the partials (not read-only
// data).  row: the row in out_accum / lse_accum order, of rows_all per split; weights: kMaxSplits
// floats of shared memory for this warp.
template <class T, int kD>
__device__ __forceinline__ void combine_row(const FlashParams& p, long long row, long long rows_all, u16* out, float* lse_out,
                                            float* weights, int lane) {
    constexpr int kD4 = kD / 4, kCols = (kD4 + 31) / 32;  // float4 columns per lane
    constexpr int kBatch = kCols > 1 ? 8 : 16;             // partial outputs in flight per lane and column
    const float kInf = __int_as_float(0x7f800000);
    const int splits = static_cast<int>(p.num_splits), dv4 = static_cast<int>(p.headdim_v / 4);  // headdim_v: multiple of 8
    const float4* acc = reinterpret_cast<const float4*>(p.out_accum) + row * dv4;
    auto load_part = [&](int s, int c) {
        return s < splits && c < dv4 ? __ldcg(acc + s * rows_all * dv4 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    };
    auto add = [](float4& a, float w, const float4& v) {
        a.x += w * v.x;
        a.y += w * v.y;
        a.z += w * v.z;
        a.w += w * v.w;
    };

    float4 first[kCols][kBatch];  // splits 0 .. kBatch - 1, loaded before their weights are known
#pragma unroll
    for (int j = 0; j < kCols; ++j)
#pragma unroll
        for (int k = 0; k < kBatch; ++k) first[j][k] = load_part(k, lane + 32 * j);

    float lse_s[kMaxSplits / 32], m = -kInf;
#pragma unroll
    for (int k = 0; k < kMaxSplits / 32; ++k) {
        const int s = lane + 32 * k;
        lse_s[k] = s < splits ? __ldcg(p.lse_accum + s * rows_all + row) : -kInf;
        m = fmaxf(m, lse_s[k]);  // fmaxf drops NaN; the sum below keeps it
    }
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    m = RowState::safe_max(m);  // no split saw a key: every exp below is exactly 0
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxSplits / 32; ++k) sum += __expf(lse_s[k] - m);
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const bool empty = sum == 0.f;
    const float lse = empty ? -kInf : m + __logf(sum);
#pragma unroll
    for (int k = 0; k < kMaxSplits / 32; ++k)
        if (lane + 32 * k < splits) weights[lane + 32 * k] = empty ? 0.f : __expf(lse_s[k] - lse);
    __syncwarp();

#pragma unroll
    for (int j = 0; j < kCols; ++j) {
        const int c = lane + 32 * j;
        if (c >= kD4) break;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int k = 0; k < kBatch; ++k) add(a, k < splits ? weights[k] : 0.f, first[j][k]);
        for (int s0 = kBatch; s0 < splits; s0 += kBatch) {  // past kBatch splits
            float4 v[kBatch];
#pragma unroll
            for (int k = 0; k < kBatch; ++k) v[k] = load_part(s0 + k, c);  // all loads first, then the sums
#pragma unroll
            for (int k = 0; k < kBatch; ++k) add(a, s0 + k < splits ? weights[s0 + k] : 0.f, v[k]);
        }
        if (c < dv4) *reinterpret_cast<uint2*>(out + 4 * c) = make_uint2(pack2<T>(a.x, a.y), pack2<T>(a.z, a.w));
    }
    if (lane == 0) *lse_out = lse;
    __syncwarp();  // the next row's weights overwrite these
}

template <class T, int kD, int kBM, int kBN, int kWarps, bool kQInRegs, bool kSoftcap, bool kAlibi, bool kSplitKV, int kRowPad,
          bool kMods, bool kDropout>
__device__ __forceinline__ void flash_fwd(const FlashParams& p) {
    using E = typename Elem<T>::Storage;  // element in memory: 16-bit raw bits, or double
    using A = typename Elem<T>::Acc;      // accumulators and softmax state: float, or double
    constexpr bool kF64 = Elem<T>::kF64, kF32 = Elem<T>::kF32, kWide = Elem<T>::kWide;
    constexpr int kPer = 16 / sizeof(E);  // elements per 16-byte chunk
    static_assert(!kWide || (!kSplitKV && !kQInRegs), "float32/float64: not with these yet");
    static_assert(kColSplit == 1 || (kWide && !kSplitKV && kWarps % kColSplit == 0),
                  "a column split: float32/float64 one-pass kernels, whole pairs of warps");
    static_assert(!kF64 || kD / kColSplit <= 128, "float64: O of a 256-wide head takes 256 registers a thread");
    static_assert(!kShareS || (kColSplit == 2 && kBN % 16 == 0), "S shared: a column split's pairs, whole 8-key tiles each");
    constexpr int kThreads = kWarps * 32;
    // Warps split the rows of the block, or (split-KV) the keys of each tile.
    constexpr int kRowWarps = kSplitKV ? 1 : kWarps / kColSplit, kKeyWarps = kSplitKV ? kWarps : 1;
    constexpr int kMT = kBM / (16 * kRowWarps);  // 16-row MMA tiles per warp
    constexpr int kBNW = kBN / kKeyWarps;        // keys of a tile per warp
    constexpr int kNT = kBNW / 8;                // 8-key column tiles of S
    constexpr int kKS = kD / 16;                 // 16-wide steps over the head dim
    constexpr int kOT = kD / 8;                  // 8-wide column tiles of O
    constexpr int kOW = kOT / kColSplit;         // of them, this warp's (its share of the columns)
    constexpr int kStride = kD + kRowPad;        // padded shared-memory row, in elements
    static_assert(kBM % (16 * kRowWarps) == 0 && kBNW % 16 == 0 && kD % 32 == 0, "bad tile shape");
    static_assert(kRowPad * sizeof(E) == 16 || kRowPad * sizeof(E) == 32, "rows padded by 16 or 32 bytes");
    // float64: V's rows padded by 16 bytes, not Q's and K's 32.  P V reads V at rows 2t, columns g
    // (lane = 4g + t): with 32 bytes rows 2t and 2t + 4 met in the same banks (2-way conflicts on a
    // third of the loads, perf-notes f11); S's loads (rows g, columns t) keep 32 bytes for theirs.
    constexpr int kStrideV = kF64 ? kD + 16 / static_cast<int>(sizeof(E)) : kStride;

    // 128-byte aligned: dynamic shared memory follows the static variables, and a base off a
    // 32-byte unit would undo the whole-sector rows of split-KV (16 bytes of static data cost 15 %, d8).
    extern __shared__ __align__(128) unsigned char smem_raw[];
    E* sQ = reinterpret_cast<E*>(smem_raw);  // (kBM, kStride), reused to stage O
    E* sK = sQ + kBM * kStride;              // (kBN, kStride)
    E* sV = sK + kBN * kStride;              // (kBN, kStrideV)
    E* sS = sV + kBN * kStrideV;             // (kShareS: kBM x kBN, C-fragment order)

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row_warp = kSplitKV ? 0 : warp / kColSplit, key_warp = kSplitKV ? warp : 0;
    const int col0 = (warp % kColSplit) * kOW * 8;  // this warp's first column of O (kColSplit > 1)
    const int g = kSplitKV ? static_cast<int>(p.pack_gqa) : 1;  // query heads per row group
    const long long heads = p.nheads_q / g;                     // heads as the grid sees them
    const long long bh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= p.batch * heads) return;
    const int b = static_cast<int>(bh / heads), h = static_cast<int>(bh % heads) * g;  // h: first query head
    const int hk = h / static_cast<int>(p.nheads_q / p.nheads_k);  // GQA: query heads share K/V head hk
    const int num_splits = kSplitKV ? static_cast<int>(p.num_splits) : 1;
    const int split = blockIdx.x % num_splits, m_blocks = gridDim.x / num_splits;
    SeqInfo seq(p, b);
    if constexpr (kSplitKV) {
        seq.check_pages(p, b, split, num_splits);
        seq.make_warp_uniform();
    } else if constexpr (kWide) {  // float32/float64 paged caches: the one-pass kernel checks all of the sequence's pages
        seq.check_pages(p, b, 0, 1);
    }
    const int m0 = (m_blocks - 1 - static_cast<int>(blockIdx.x) / num_splits) * kBM;  // longest rows (causal) first
    const int rows = seq.sq * g;
    if (m0 >= rows) return;  // varlen: this sequence is shorter
    // Row r of the block is query token token(r) (of head h + (m0 + r) % g when packed).
    auto token = [&](int r) { return kSplitKV ? (m0 + r) / g : m0 + r; };

    const E* gQ = static_cast<const E*>(p.q) + b * p.q_batch_stride + (seq.q_start + m0) * p.q_row_stride + h * p.q_head_stride;
    // K/V of this sequence and head, rebuilt per tile from seqinfo.cuh's shared batch row, or
    // (split-KV) from uniform registers (SeqInfo::make_warp_uniform).
    const int kv_b = kSplitKV ? warp_uniform(static_cast<int>(seq.kv_row())) : 0;
    auto kv_row = [&]() -> long long { return kSplitKV ? kv_b : seq.kv_row(); };
    auto gK = [&] { return static_cast<const E*>(p.k) + kv_row() * p.k_batch_stride + seq.k_start * p.k_row_stride + hk * p.k_head_stride; };
    auto gV = [&] { return static_cast<const E*>(p.v) + kv_row() * p.v_batch_stride + seq.k_start * p.v_row_stride + hk * p.v_head_stride; };
    E* gO = static_cast<E*>(p.out) + b * p.o_batch_stride + (seq.q_start + m0) * p.o_row_stride + h * p.o_head_stride;
    A* gLse = reinterpret_cast<A*>(p.lse) + seq.lse_row(p, b, h, m0);  // (float64: a float64 LSE)
    const int rows_valid = min(kBM, rows - m0);
    const int qk_chunks = static_cast<int>(p.headdim_qk / kPer), v_chunks = static_cast<int>(p.headdim_v / kPer);
    // Offsets of block row r from gQ/gO (elements) and gLse when rows interleave tokens and heads.
    auto q_offset = [&](int r, long long row_stride, long long head_stride) {
        return kSplitKV ? (token(r) - m0) * row_stride + ((m0 + r) % g) * head_stride : r * row_stride;
    };

    const ScoreMods mods{p, b, h, seq.sq, seq.sk};  // (read only by kMods kernels; no GQA packing with them)
    int n_lo, n_hi;
    seq.key_range(token(0), token(kBM - 1) + 1, n_lo, n_hi);
    int nb_lo = n_lo / kBN, nb_hi = (n_hi + kBN - 1) / kBN;
    if constexpr (kMods) mods.narrow_key_tiles<kBM, kBN>(m0 / kBM, nb_lo, nb_hi);  // (the mask's tile map: not all False)
    if (kSplitKV && nb_lo < nb_hi) {  // this block's share of the key blocks (possibly none)
        const int per_split = (nb_hi - nb_lo + num_splits - 1) / num_splits;
        nb_lo += split * per_split;
        nb_hi = min(nb_hi, nb_lo + per_split);
    }
    // The key tile after nb, walking down from nb_hi - 1 (kMods: past tiles whose mask is all False;
    // not with a paged cache, whose page slots are double-buffered by the parity of consecutive
    // tiles: no call gives both today, kvcache takes no mask).
    constexpr bool kPagedForm = kSplitKV || kWide;  // (float32/float64 read paged caches without splitting the keys)
    const bool skip_tiles = kMods && !(kPagedForm && p.block_table);
    auto next_tile = [&](int nb) { return skip_tiles ? mods.step_key_tile<kBM, kBN, -1>(m0 / kBM, nb, nb_lo) : nb - 1; };
    if (skip_tiles) nb_hi = next_tile(nb_hi) + 1;

    // K/V tile of keys [n0, n0 + kBN): evenly strided rows, or (paged) rows whose (page, slot)
    // page_rows() looked up once per tile into shared memory, for the K and the V copies alike.
    // An entry outside the cache reads page 0 instead: some block of each row group found it bad
    // (SeqInfo::check_pages, on the whole 64-bit value), and its NaN reaches every row in the
    // merge.  Here only the low 32 bits of an int64 entry are read (the clamp keeps any value in
    // bounds; a full 64-bit load made ptxas spill at d96 and d128).
    const bool paged = kPagedForm && p.block_table != nullptr;
    __shared__ int2 s_page_slot[kPagedForm ? 2 : 1][kPagedForm ? kBN : 1];  // double-buffered by tile parity
    auto page_rows = [&](int nb) {
        const int* table = static_cast<const int*>(p.block_table);
        const long long row = b * p.block_table_batch_stride;
        const int words = p.index_64bit & kIndexTable ? 2 : 1, page_size = static_cast<int>(p.page_size);
        for (int r = tid; r < kBN; r += kThreads) {
            const int j = nb * kBN + r;
            if (j < seq.sk) {
                const unsigned page = table[(row + j / page_size) * words];  // little-endian: the low word
                s_page_slot[nb & 1][r] = make_int2(page < p.kv_rows ? static_cast<int>(page) : 0, j % page_size);
            }
        }
    };
    auto load_kv = [&](auto stride, E* smem, const void* base, const E* g_seq, long long batch_stride, long long row_stride,
                       long long head_stride, int nb, int chunks) {
        constexpr int kStrideKV = decltype(stride)::value;  // (the tile's rows in shared memory)
        const int n0 = nb * kBN;
        if (paged) {
            const E* g_head = static_cast<const E*>(base) + hk * head_stride;
            const int2* rows = s_page_slot[nb & 1];
            load_tile_rows<kBN, kD, kThreads, kStrideKV, kSplitKV>(
                smem, [&](int r) { return g_head + rows[r].x * batch_stride + rows[r].y * row_stride; },
                g_head, seq.sk - n0, chunks, tid);
        } else {
            load_tile<kBN, kD, kThreads, kStrideKV, kSplitKV>(smem, g_seq + n0 * row_stride, row_stride, seq.sk - n0, chunks, tid);
        }
    };
    auto load_k = [&](int nb) {
        load_kv(IntConst<kStride>{}, sK, p.k, gK(), p.k_batch_stride, p.k_row_stride, p.k_head_stride, nb, qk_chunks);
    };
    auto load_v = [&](int nb) {
        load_kv(IntConst<kStrideV>{}, sV, p.v, gV(), p.v_batch_stride, p.v_row_stride, p.v_head_stride, nb, v_chunks);
    };

    const ScoreArgsT<A> score_args = {static_cast<A>(p.softmax_scale), static_cast<A>(p.softmax_scale * 1.4426950408889634),
                                      static_cast<A>(p.softcap), kAlibi ? alibi_slope<A>(p, b, h) : A(0)};

    A o[kMT][kOW][4];  // O accumulator (this warp's columns), C-fragment layout, fp32 (float64: double)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int ot = 0; ot < kOW; ++ot)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][ot][e] = 0.f;
    RowStateT<A> row[kMT][2];  // rows lane/4 and lane/4 + 8 of each MMA tile

    if (nb_lo < nb_hi) {
        if constexpr (kSplitKV)
            load_tile_rows<kBM, kD, kThreads, kStride>(sQ, [&](int r) { return gQ + q_offset(r, p.q_row_stride, p.q_head_stride); },
                                              static_cast<const E*>(p.q), rows_valid, qk_chunks, tid);
        else
            load_tile<kBM, kD, kThreads, kStride>(sQ, gQ, p.q_row_stride, rows_valid, qk_chunks, tid);
        if (paged) {
            page_rows(nb_hi - 1);
            __syncthreads();
        }
        load_k(nb_hi - 1);  // start at the tail/diagonal tile
        cp_async_commit();

        u32 qf[kQInRegs ? kMT : 1][kQInRegs ? kKS : 1][4];
        const E* sQw = sQ + row_warp * kMT * 16 * kStride;  // this warp's rows
        const E* sKw = sK + key_warp * kBNW * kStride;      // this warp's keys, of K and V
        const E* sVw = sV + key_warp * kBNW * kStrideV;
        constexpr int kHalfNT = kNT / 2;  // (kShareS) the key tiles of S each warp of a slab forms
        A* sSw = reinterpret_cast<A*>(sS) + row_warp * kMT * kNT * 4 * 32 + lane;  // (kShareS) this slab's S, this lane's (E is A in the wide forms)

        // (The loop steps by --nb, with kMods' skip added at the end of the body, and next_tile(nb)
        // is recomputed where it is used: `nb = next_tile(nb)` as the step, even where it is
        // nb - 1, made the plain split-KV d128 kernel, at its register cap, spill 28 bytes.)
        for (int nb = nb_hi - 1; nb >= nb_lo; --nb) {
            const int n0 = nb * kBN;
            cp_async_wait<0>();
            __syncthreads();  // K_nb (and Q) have landed; every warp finished reading V of the last tile
            load_v(nb);
            cp_async_commit();
            if (paged && next_tile(nb) >= nb_lo) page_rows(next_tile(nb));  // published by the barrier before load_k(next_tile(nb))
            if constexpr (kQInRegs) {
                if (nb == nb_hi - 1) {
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                        for (int ks = 0; ks < kKS; ++ks)
                            ldmatrix_x4(qf[mt][ks], sQw + (mt * 16 + lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
                }
            }

            // S = Q K^T for this warp's rows and keys: (16 kMT, kBNW), fp32 (float64: double).
            A s[kMT][kNT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
            if constexpr (kWide && kShareS) {  // (this warp's half of the key tiles, nt = half kHalfNT + j)
                const int half = warp % 2;
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    A mine[kHalfNT][4];
                    zero<kHalfNT>(mine);
                    gemm_abt<T, kTf32Terms, kD, kBNW / 2, kStride>(mine, sQw + mt * 16 * kStride, sKw + half * (kBNW / 2) * kStride, lane);
#pragma unroll
                    for (int j = 0; j < kHalfNT; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) sSw[((mt * kNT + half * kHalfNT + j) * 4 + e) * 32] = mine[j][e];
                }
            } else if constexpr (kWide) {  // (plain shared-memory operands: warp_gemm.cuh)
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) gemm_abt<T, kTf32Terms, kD, kBNW, kStride>(s[mt], sQw + mt * 16 * kStride, sKw, lane);
            } else {
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks) {
                u32 a[kMT][4];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    if constexpr (kQInRegs) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][ks][e];
                    } else {
                        ldmatrix_x4(a[mt], sQw + (mt * 16 + lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
                    }
                }
#pragma unroll
                for (int np = 0; np < kNT / 2; ++np) {
                    u32 kb[4];  // B fragments of key columns 16np..16np+7 (kb[0..1]) and +8..15 (kb[2..3])
                    ldmatrix_x4(kb, sKw + (np * 16 + (lane / 16) * 8 + lane % 8) * kStride + ks * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        mma_16x8x16<T>(s[mt][2 * np], a[mt], kb[0], kb[1]);
                        mma_16x8x16<T>(s[mt][2 * np + 1], a[mt], kb[2], kb[3]);
                    }
                }
            }
            }
            __syncthreads();  // every warp is done with sK: the next K tile may overwrite it (kShareS: S's halves are in sS)
            if constexpr (kShareS) {  // (sS is written again after the next tile's first barrier)
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][nt][e] = sSw[((mt * kNT + nt) * 4 + e) * 32];
            }
            if (next_tile(nb) >= nb_lo) {
                load_k(next_tile(nb));
                cp_async_commit();
            }

            // Score pipeline, mask, online softmax; P is packed to 16 bits at once (half the registers of S;
            // float64: P stays in s).
            u32 pk[kMT][kBNW / 16][4];  // (float64: unused)
            A alpha[kMT][2];  // O rescale factor per row; 1 where the row max did not move
            const bool masked = !seq.tile_all_visible(token(0), token(kBM - 1) + 1, n0, n0 + kBN);
            const bool read_mask = !kMods || mods.tile_state<kBM, kBN>(m0 / kBM, nb) != 1;  // (all True: no mask reads)
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                const int r = (row_warp * kMT + mt) * 16 + lane / 4;  // block row of the tile's row lane/4
                const int qpos[2] = {token(r), token(r + 8)};
                softmax_tile<T, kNT, kSoftcap, kAlibi, kWide, false, kMods, kDropout>(s[mt], row[mt], pk[mt], alpha[mt], qpos, n0 + key_warp * kBNW, masked,
                                                                     seq, score_args, lane, &mods, read_mask);
            }
            // Rescale O only when some row of the warp has a new max: after the first few tiles
            // the max rarely moves, and multiplying by exactly 1 changes nothing (FlashAttention-4).
            bool moved = false;
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) moved |= alpha[mt][0] != static_cast<A>(1) || alpha[mt][1] != static_cast<A>(1);
            if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int ot = 0; ot < kOW; ++ot)
#pragma unroll
                        for (int e = 0; e < 4; ++e) o[mt][ot][e] *= alpha[mt][e / 2];
            }

            if (next_tile(nb) >= nb_lo) cp_async_wait<1>(); else cp_async_wait<0>();
            __syncthreads();  // V_nb has landed for every thread's copies

            // O += P V, with P's registers as the A operand.
            if constexpr (kWide) {  // (P as S left it: warp_gemm.cuh)
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) gemm_cb<T, kTf32Terms, kBNW, kOW * 8, kStrideV>(o[mt], s[mt], sVw + col0, lane);
            } else {
#pragma unroll
            for (int kk = 0; kk < kBNW / 16; ++kk) {
#pragma unroll
                for (int dp = 0; dp < kOT / 2; ++dp) {
                    u32 vb[4];  // B fragments of O columns 16dp..+7 (vb[0..1]) and +8..15 (vb[2..3])
                    ldmatrix_x4_trans(vb, sVw + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStrideV + dp * 16 + (lane / 16) * 8);
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        mma_16x8x16<T>(o[mt][2 * dp], pk[mt][kk], vb[0], vb[1]);
                        mma_16x8x16<T>(o[mt][2 * dp + 1], pk[mt][kk], vb[2], vb[3]);
                    }
                }
            }
            }
            if (skip_tiles) nb = next_tile(nb) + 1;  // (the step's --nb then lands on it)
        }
    }

    if constexpr (kKeyWarps > 1) merge_key_warps<kMT, kOT, kKeyWarps, 2 * kBN * kStride * 2, kMods>(o, row, sK, warp, lane);  // over sK + sV
    const bool writer = kKeyWarps == 1 || warp == 0;  // warp 0 holds the merged state

    if constexpr (kSplitKV) {
        if (num_splits > 1) {  // partial result of this split, fp32; the group's last block merges them
            const long long rows_all = p.batch * p.nheads_q * p.seqlen_q;  // rows of one split's partials
            auto acc_row = [&](int r) { return (b * p.nheads_q + h + (m0 + r) % g) * p.seqlen_q + token(r); };
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float lse;
                    const float inv_l = row[mt][half].template finalize<kMods>(seq.poison(quad_sum(row[mt][half].l)), lse)
                                        * (kDropout ? mods.out_scale() : 1.f);  // (dropout's 1 / (1 - p))
                    const int r = (row_warp * kMT + mt) * 16 + lane / 4 + half * 8;  // row within the block
                    if (!writer || r >= rows_valid) continue;
                    const long long at = split * rows_all + acc_row(r);
                    if (lane % 4 == 0) p.lse_accum[at] = lse;
                    float* acc = p.out_accum + at * p.headdim_v + (lane % 4) * 2;
#pragma unroll
                    for (int ot = 0; ot < kOT; ++ot)
                        if (ot * 8 < p.headdim_v)
                            *reinterpret_cast<float2*>(acc + ot * 8) =
                                make_float2(RowState::normalize(o[mt][ot][half * 2], inv_l), RowState::normalize(o[mt][ot][half * 2 + 1], inv_l));
                }
            }
            // The blocks sharing these rows.  b * heads + h / g is bh, rebuilt from values live here:
            // keeping bh itself live across the key loop made ptxas spill 40 bytes at d128 (d8).
            const long long group = (b * heads + h / g) * m_blocks + static_cast<int>(blockIdx.x) / num_splits;
            if (!arrive_last(p.split_counters + group, num_splits)) return;
            float* weights = reinterpret_cast<float*>(sK) + warp * kMaxSplits;  // sK is free now: a warp's scratch
            for (int r = warp; r < rows_valid; r += kWarps)
                combine_row<T, kD>(p, acc_row(r), rows_all, gO + q_offset(r, p.o_row_stride, p.o_head_stride),
                                   gLse + q_offset(r, 1, p.lse_head_stride), weights, lane);
            return;
        }
    }

    // Epilogue: O /= l, LSE; stage this warp's rows of O in its own rows of sQ, then store 16-byte chunks.
    __syncthreads();  // all warps are done with sQ/sK/sV (also covers the empty-range path)
    if (!writer) return;
    E* sO = sQ + row_warp * kMT * 16 * kStride;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            A lse;
            const A inv_l = row[mt][half].template finalize<kMods>(seq.poison(quad_sum(row[mt][half].l)), lse)
                            * (kDropout ? mods.template out_scale<A>() : A(1));  // (dropout's 1 / (1 - p))
            const int r = mt * 16 + lane / 4 + half * 8;  // row within the warp
            const int i = (row_warp * kMT) * 16 + r;      // row within the block
            if (lane % 4 == 0 && i < rows_valid && col0 == 0) gLse[kSplitKV ? q_offset(i, 1, p.lse_head_stride) : i] = lse;
#pragma unroll
            for (int ot = 0; ot < kOW; ++ot) {
                const A lo = RowStateT<A>::normalize(o[mt][ot][half * 2], inv_l), hi = RowStateT<A>::normalize(o[mt][ot][half * 2 + 1], inv_l);
                E* at = sO + r * kStride + col0 + ot * 8 + (lane % 4) * 2;
                if constexpr (kF64)
                    *reinterpret_cast<double2*>(at) = make_double2(lo, hi);
                else if constexpr (kF32)
                    *reinterpret_cast<float2*>(at) = make_float2(lo, hi);
                else
                    *reinterpret_cast<u32*>(at) = pack2<T>(lo, hi);
            }
        }
    }
    __syncwarp();  // (a column split's other warp writes and stores only its own columns of these rows)
    constexpr int kChunks = kOW * 8 / kPer;
#pragma unroll
    for (int c = lane; c < kMT * 16 * kChunks; c += 32) {
        const int r = c / kChunks, col = col0 / kPer + c % kChunks;
        const int i = row_warp * kMT * 16 + r;
        if (i < rows_valid && col < v_chunks)
            *reinterpret_cast<uint4*>(gO + q_offset(i, p.o_row_stride, p.o_head_stride) + col * kPer) =
                *reinterpret_cast<const uint4*>(sO + r * kStride + col * kPer);
    }
}

// CUFLASH_MIN_BLOCKS caps registers so that many blocks share an SM (latency hiding);
// CUFLASH_Q_IN_REGS keeps Q's MMA fragments in registers instead of re-reading shared memory.
extern "C" __global__ void __launch_bounds__(CUFLASH_WARPS * 32, CUFLASH_MIN_BLOCKS)
CUFLASH_KERNEL_NAME(const __grid_constant__ FlashParams p) {
    flash_fwd<CUFLASH_DTYPE, CUFLASH_HEADDIM, CUFLASH_BLOCK_M, CUFLASH_BLOCK_N, CUFLASH_WARPS,
              CUFLASH_Q_IN_REGS != 0, CUFLASH_SOFTCAP != 0, CUFLASH_ALIBI != 0, CUFLASH_SPLITKV != 0,
              CUFLASH_ROW_PAD, CUFLASH_MODS != 0, CUFLASH_MODS == 2>(p);
}
