// The epilogue of the Hopper forward (flash_fwd_sm90.cu): one consumer warpgroup's 64 rows of a
// query tile, O / l and the LSE (natural log; NaN for a sequence with bad metadata, SeqInfo's
// poison).  The warpgroup stages its rows of O in its own rows of sO (a buffer of its own, or sQ,
// no longer read once the warpgroup's last S = Q K^T is done; the 128-byte swizzle of the copy
// engine's tiles), then stores them in 16-byte chunks, only the rows of the sequence and the
// columns of headdim_v.  On return the warpgroup is done with sO (staged in sQ, the caller then
// frees sQ for the next tile's Q).
#pragma once
#include "online_softmax.cuh"
#include "seqinfo.cuh"
#include "swizzled_tile.cuh"

template <class T, int kBM, bool kNatural, int kOT, class Barrier>  // kNatural: RowState's natural units
__device__ __forceinline__ void store_o(const FlashParams& p, const SeqInfo& seq, int b, int h, int m0, const float (&o)[kOT][4],
                                       const RowState (&row)[2], unsigned char* sO, int wg, int r_lo, int wtid, int lane,
                                       Barrier consumer_barrier, float out_scale = 1.f) {  // out_scale: dropout's 1 / (1 - p)
    u16* gO = static_cast<u16*>(p.out) + b * p.o_batch_stride + (seq.q_start + m0) * p.o_row_stride + h * p.o_head_stride;
    float* gLse = p.lse + seq.lse_row(p, b, h, m0);
    const int rows_valid = min(kBM, seq.sq - m0), v_chunks = static_cast<int>(p.headdim_v / 8);
    // The thread's rows and chunks through an opaque move: the shared-memory offsets below are
    // the same for every tile, and computed once before the caller's tile loop they stayed live
    // through its main loop (spilling at d192 and d256).
    int e_row = r_lo, e_tid = wtid;
    asm volatile("" : "+r"(e_row), "+r"(e_tid));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float lse;
        const float inv_l = row[half].template finalize<kNatural>(seq.poison(quad_sum(row[half].l)), lse) * out_scale;
        const int r = e_row + half * 8;
        if (lane % 4 == 0 && r < rows_valid) gLse[r] = lse;
#pragma unroll
        for (int ot = 0; ot < kOT; ++ot)
            *reinterpret_cast<u32*>(sO + swizzled_chunk<kBM>(r, ot) + (lane % 4) * 4) =
                pack2<T>(RowState::normalize(o[ot][half * 2], inv_l), RowState::normalize(o[ot][half * 2 + 1], inv_l));
    }
    consumer_barrier();
#pragma unroll
    for (int c = e_tid; c < 64 * kOT; c += 128) {
        const int r = wg * 64 + c / kOT, col = c % kOT;
        if (r < rows_valid && col < v_chunks)
            *reinterpret_cast<uint4*>(gO + r * p.o_row_stride + col * 8) = *reinterpret_cast<const uint4*>(sO + swizzled_chunk<kBM>(r, col));
    }
    fence_async_smem();  // this warpgroup's use of sO (sQ) comes before the copy engine's next Q
    consumer_barrier();
}
