// The rows of packed (varlen) arrays that no well-formed sequence owns, and the check of the
// offsets (varlen_tail.cuh): entry points <name> (forward: out and lse, q side; before the sm_80
// forward) and <name>_grads (dq, q side; dk and dv, k side; before the backward kernels).
#include "varlen_tail.cuh"

#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_varlen_tail
#endif
#define CUFLASH_CAT2(a, b) a##b
#define CUFLASH_CAT(a, b) CUFLASH_CAT2(a, b)

extern "C" __global__ void __launch_bounds__(256) CUFLASH_KERNEL_NAME(const __grid_constant__ FlashParams p) {
    forward_tail(p, blockIdx.x == 0 ? p.offsets_first_bad : nullptr);
}

// The backward's: dq rows (q side) and dk, dv rows (k side), in one launch.
extern "C" __global__ void __launch_bounds__(256) CUFLASH_CAT(CUFLASH_KERNEL_NAME, _grads)(const __grid_constant__ FlashParams p) {
    long long q_end;
    long long* const first_bad = blockIdx.x == 0 ? p.offsets_first_bad : nullptr;  // (block 0 publishes)
    if (offsets_all_good(p, first_bad, q_end)) return;  // the gradients of rows past the last sequence start at 0
    long long e_q, e_k;
    find_bad_offsets(p, first_bad, e_q, e_k);
    const PackedRows dq[1] = {packed_rows(p, p.dq, p.dq_row_stride, p.dq_head_stride, p.nheads_q, p.headdim_qk)};
    varlen_tail(p, p.cu_seqlens_q, kIndexCuQ, e_q, p.total_q, p.seqlen_q, dq, nullptr, false, kArgMaxSeqlenQ);
    const PackedRows dkdv[2] = {packed_rows(p, p.dk, p.dk_row_stride, p.dk_head_stride, p.nheads_k, p.headdim_qk),
                                packed_rows(p, p.dv, p.dv_row_stride, p.dv_head_stride, p.nheads_k, p.headdim_v)};
    varlen_tail(p, p.cu_seqlens_k, kIndexCuK, e_k, p.total_k, p.seqlen_k, dkdv, nullptr, false, kArgMaxSeqlenK);
    // Each side's gradients of the sequences whose other side is bad (reported just above).
    partner_rows<false>(p, p.cu_seqlens_k, kIndexCuK, e_k, p.seqlen_k, kArgMaxSeqlenK, p.cu_seqlens_q, kIndexCuQ, e_q,
                 p.total_q, dq, nullptr);
    partner_rows<false>(p, p.cu_seqlens_q, kIndexCuQ, e_q, p.seqlen_q, kArgMaxSeqlenQ, p.cu_seqlens_k, kIndexCuK, e_k,
                 p.total_k, dkdv, nullptr);
}
