// The epilogue of the Hopper forward (flash_fwd_sm90.cu): one consumer warpgroup's 64 rows of a
// query tile, O / l and the LSE (natural log; NaN for a sequence with bad metadata, SeqInfo's
// poison).  The warpgroup stages its rows of O in its own rows of sO (a buffer of its own, or sQ,
// no longer read once the warpgroup's last S = Q K^T is done; the 128-byte swizzle of the copy
// engine's tiles); then one thread hands them to the copy engine (a TMA store of one 64 x 64 box
// per 64-column panel, through the map of O: rows past the sequence and columns past headdim_v
// are not written) and the warpgroup goes on with its next tile, as FlashAttention-3's epilogue
// does (Shah et al., 2024, §3.1).  Packed (varlen) rows go out through the threads' own 16-byte
// stores instead: in the array the next sequence's rows follow, which a box would overwrite.
// Who waits for the copy engine: the issuing thread (wtid 0) before the warpgroup stages its next
// tile (bulk_wait_read, then the first barrier here), before it frees sQ where O was staged
// there (flash_fwd_sm90.cu's release_q), and before the block exits.
#pragma once
#include "online_softmax.cuh"
#include "seqinfo.cuh"
#include "sm90_pipeline.cuh"
#include "swizzled_tile.cuh"

template <class T, int kBM, bool kNatural, int kOT, class Barrier>  // kNatural: RowState's natural units
__device__ __forceinline__ void store_o(const FlashParams& p, const TensorMap& o_map, const SeqInfo& seq, int b, int h, int m0,
                                       const float (&o)[kOT][4], const RowState (&row)[2], unsigned char* sO, int wg, int r_lo,
                                       int wtid, int lane, Barrier consumer_barrier,
                                       float out_scale = 1.f) {  // out_scale: dropout's 1 / (1 - p)
    const bool by_copy_engine = p.cu_seqlens_q == nullptr;  // (uniform over the block)
    float* gLse = p.lse + seq.lse_row(p, b, h, m0);
    // The thread's rows and chunks through an opaque move: the shared-memory offsets below are
    // the same for every tile, and computed once before the caller's tile loop they stayed live
    // through its main loop (spilling at d192 and d256).
    int e_row = r_lo, e_tid = wtid;
    asm volatile("" : "+r"(e_row), "+r"(e_tid));
    if (by_copy_engine) {  // the previous tile's box has been read out of sO before it is written again
        if (e_tid == 0) bulk_wait_read<0>();
        consumer_barrier();
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float lse;
        const float inv_l = row[half].template finalize<kNatural>(seq.poison(quad_sum(row[half].l)), lse) * out_scale;
        const int r = e_row + half * 8;
        if (lane % 4 == 0 && r < min(kBM, seq.sq - m0)) gLse[r] = lse;
#pragma unroll
        for (int ot = 0; ot < kOT; ++ot)
            *reinterpret_cast<u32*>(sO + swizzled_chunk<kBM>(r, ot) + (lane % 4) * 4) =
                pack2<T>(RowState::normalize(o[ot][half * 2], inv_l), RowState::normalize(o[ot][half * 2 + 1], inv_l));
    }
    fence_async_smem();  // the staged rows, visible to the copy engine
    consumer_barrier();
    if (by_copy_engine) {
        if (e_tid == 0) {
#pragma unroll
            for (int panel = 0; panel < kOT / 8; ++panel)
                tma_store_4d(o_map, sO + panel * kBM * 128 + wg * 64 * 128, panel * 64, m0 + wg * 64, h, b);
            bulk_commit();
        }
        return;
    }
    u16* gO = static_cast<u16*>(p.out) + b * p.o_batch_stride + (seq.q_start + m0) * p.o_row_stride + h * p.o_head_stride;
    const int rows_valid = min(kBM, seq.sq - m0), v_chunks = static_cast<int>(p.headdim_v / 8);
#pragma unroll
    for (int c = e_tid; c < 64 * kOT; c += 128) {
        const int r = wg * 64 + c / kOT, col = c % kOT;
        if (r < rows_valid && col < v_chunks)
            *reinterpret_cast<uint4*>(gO + r * p.o_row_stride + col * 8) = *reinterpret_cast<const uint4*>(sO + swizzled_chunk<kBM>(r, col));
    }
    fence_async_smem();  // this warpgroup's use of sO (sQ) comes before the copy engine's next Q
    consumer_barrier();
}
