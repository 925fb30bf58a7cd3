// KV-cache append: write the p.seqlen_new new keys and values of sequence b (k_new, v_new) at
// positions cache_seqlens[b] + t of its cache row (contiguous: row cache_batch_idx[b] or b) or of
// its pages (block_table), after checking that every slot it writes is one the metadata legally
// names (metadata.cuh).  One block per sequence.  A sequence is refused, with nothing written and
// seq_bad[b] = 1 (the attention kernel then gives its rows NaN), when
//   - cache_seqlens[b] < 0 or cache_seqlens[b] + seqlen_new > the capacity (never wrapped),
//   - cache_batch_idx[b] is not a row of the cache, or another sequence appends to the same row,
//   - a block_table entry among the pages it uses is not a page of the cache,
//   - a slot it writes is one that another position reads: another sequence's keys on a shared
//     page, or its own keys where its row lists a page twice (two sequences writing one slot
//     both read it, so both are refused).
// Every other sequence gets seq_bad[b] = 0 and its tokens.  The check of shared pages reads every
// sequence's used block_table entries once per appending sequence: O(batch x pages in use) loads,
// a few microseconds at batch 256 with 4k-token sequences of 16-token pages.
// Elements are copied as 16-bit units (any element size that is a multiple of 2 bytes); strides
// are in elements.
#include "metadata.cuh"
#include "params.cuh"

#ifndef CUFLASH_KERNEL_NAME
#define CUFLASH_KERNEL_NAME cuflash_kv_append
#endif

extern "C" __global__ void __launch_bounds__(256) CUFLASH_KERNEL_NAME(const __grid_constant__ FlashParams p) {
    const long long b = blockIdx.x, n_new = p.seqlen_new, cap = p.seqlen_k;
    const long long len = load_index(p, p.seqlens_k, kIndexSeqlensK, b), end = len + n_new;
    auto length_ok = [&](long long n) { return n >= 0 && n <= cap - n_new; };
    int arg = length_ok(len) ? -1 : kArgSeqlensK;  // uniform over the block, as every branch below
    long long at = b, kv_b = b;
    if (arg < 0 && p.cache_batch_idx) {
        kv_b = load_index(p, p.cache_batch_idx, kIndexBatchIdx, b);
        if (kv_b < 0 || kv_b >= p.kv_rows) {
            arg = kArgBatchIdx;
        } else if (block_first_bad(0, p.batch, [&](long long i) {
                       return i != b && load_index(p, p.cache_batch_idx, kIndexBatchIdx, i) == kv_b;
                   }) >= 0) {
            arg = kArgAppendSlot;
        }
    }
    const long long ps = p.page_size, row = b * p.block_table_batch_stride;
    auto page_of = [&](long long seq, long long entry) {
        return load_index(p, p.block_table, kIndexTable, seq * p.block_table_batch_stride + entry);
    };
    if (arg < 0 && p.block_table) {
        const long long j = block_first_bad(0, (end + ps - 1) / ps, [&](long long i) {
            const long long page = page_of(b, i);
            return page < 0 || page >= p.kv_rows;
        });
        if (j >= 0) {
            arg = kArgBlockTable;
            at = row + j;
        } else if (n_new > 0) {
            // Entries jw of this row that receive tokens, and which offsets of their page.
            const long long jw_lo = len / ps, jw_hi = (end - 1) / ps;
            bool clash = false;
            for (long long other = 0; other < p.batch && !clash; ++other) {
                const long long other_len = load_index(p, p.seqlens_k, kIndexSeqlensK, other);
                if (!length_ok(other_len)) continue;  // refused itself: it reads and writes nothing
                const long long other_end = other_len + n_new;
                for (long long j2 = threadIdx.x; j2 < (other_end + ps - 1) / ps && !clash; j2 += blockDim.x) {
                    const long long page = page_of(other, j2), read_hi = min(ps, other_end - j2 * ps);
                    for (long long jw = jw_lo; jw <= jw_hi; ++jw) {
                        const long long w_lo = max(len, jw * ps) - jw * ps;  // first offset written on entry jw
                        clash |= page == page_of(b, jw) && (other != b || j2 != jw) && w_lo < read_hi;
                    }
                }
                clash = __syncthreads_or(clash);
            }
            if (clash) arg = kArgAppendSlot;
        }
    }
    if (threadIdx.x == 0) {
        p.seq_bad[b] = arg >= 0;
        if (arg >= 0) report_bad_index(p, arg, at);
    }
    if (arg >= 0) return;

    const long long units = p.elem_bytes / 2;  // 16-bit units per element
    auto copy = [&](const void* cache, long long c_batch, long long c_row, long long c_head, const void* src, long long s_batch,
                    long long s_row, long long s_head, long long dim) {
        const long long per_row = dim * units, per_token = p.nheads_k * per_row;
        for (long long i = threadIdx.x; i < n_new * per_token; i += blockDim.x) {
            const long long t = i / per_token, h = i % per_token / per_row, u = i % per_row, pos = len + t;
            const long long slot_b = p.block_table ? page_of(b, pos / ps) : kv_b, slot = p.block_table ? pos % ps : pos;
            unsigned short* dst = const_cast<unsigned short*>(static_cast<const unsigned short*>(cache)) +
                                  (slot_b * c_batch + slot * c_row + h * c_head) * units + u;
            *dst = static_cast<const unsigned short*>(src)[(b * s_batch + t * s_row + h * s_head) * units + u];
        }
    };
    copy(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, p.k_new, p.knew_batch_stride, p.knew_row_stride,
         p.knew_head_stride, p.headdim_qk);
    copy(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.v_new, p.vnew_batch_stride, p.vnew_row_stride,
         p.vnew_head_stride, p.headdim_v);
}
