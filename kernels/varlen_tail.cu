// Rows of a packed (varlen) batch that belong to no sequence, [cu_seqlens_q[batch], total_q):
// out = 0 and lse = -inf, the values attention_varlen documents for them.  Launched before the
// forward kernel, which writes every row inside a sequence, so no call clears the whole output.
// out's rows are (nheads_q, headdim_v) 16-bit values at its strides (16-byte aligned chunks);
// the LSE of packed rows is (nheads_q, total_q), so total_q = lse_head_stride.
#include "params.cuh"

#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_varlen_tail
#endif

extern "C" __global__ void __launch_bounds__(256) CUFLASH_KERNEL_NAME(const FlashParams p) {
    const long long total = p.lse_head_stride;
    const long long first = min(max(static_cast<long long>(p.cu_seqlens_q[p.batch]), 0ll), total);
    const long long rows = total - first;
    if (rows == 0) return;
    const long long chunks = p.headdim_v / 8, per_row = p.nheads_q * chunks;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    unsigned short* out = static_cast<unsigned short*>(p.out);
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < rows * per_row; i += step) {
        const long long r = first + i / per_row, h = i % per_row / chunks, c = i % chunks;
        *reinterpret_cast<uint4*>(out + r * p.o_row_stride + h * p.o_head_stride + c * 8) = make_uint4(0, 0, 0, 0);
    }
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < rows * p.nheads_q; i += step)
        p.lse[i / rows * total + first + i % rows] = -__int_as_float(0x7f800000);
}
