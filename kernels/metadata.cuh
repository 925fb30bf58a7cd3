// Untrusted index arrays (cu_seqlens, seqlens_k / cache_seqlens, block_table, cache_batch_idx):
// reading them, checking them against the extents the host gave, and reporting a violation.
//
// GPU index arrays are never copied to the host (that would cost a synchronisation), so their
// values are checked here, by the kernels that read them.  A violation never leads to a read or
// write outside the arrays: the sequence concerned is "bad" (SeqInfo), its rows become NaN, and
// the first violation is recorded in p.error_word, a 64-bit word of mapped host memory that the
// host reads before its next call (cuflash/_guard.py raises InvalidIndexError from it):
//     error_call << 40 | argument << 36 | index     (all ones = nothing recorded)
// atomicMin keeps the smallest record: within one call, the first bad entry of an argument.
#pragma once
#include "params.cuh"

// Bits of FlashParams::index_64bit: which index arrays are int64 (the others are int32).
enum : int { kIndexCuQ = 1, kIndexCuK = 2, kIndexSeqlensK = 4, kIndexTable = 8, kIndexBatchIdx = 16 };

// Argument numbers of an error record (cuflash/_guard.py names them).
enum : int {
    kArgCuSeqlensQ = 0,
    kArgCuSeqlensK = 1,
    kArgSeqlensK = 2,     // seqlens_k, or cache_seqlens
    kArgBlockTable = 3,
    kArgBatchIdx = 4,
    kArgMaxSeqlenQ = 5,   // a packed sequence longer than max_seqlen_q (index: the sequence)
    kArgMaxSeqlenK = 6,
    kArgAppendSlot = 7,   // a new token sent to a cache slot another position uses (index: the sequence)
};

__device__ __forceinline__ long long load_index(const void* a, long long i, bool is64) {
    return is64 ? static_cast<const long long*>(a)[i] : static_cast<long long>(static_cast<const int*>(a)[i]);
}

__device__ __forceinline__ long long load_index(const FlashParams& p, const void* a, int bit, long long i) {
    return load_index(a, i, (p.index_64bit & bit) != 0);
}

// Record a violation (any thread; callers let one thread per block report).
__device__ __forceinline__ void report_bad_index(const FlashParams& p, int arg, long long index) {
    if (p.error_word == nullptr) return;
    const unsigned long long record = (static_cast<unsigned long long>(p.error_call) << 40) |
                                      (static_cast<unsigned long long>(arg) << 36) |
                                      (static_cast<unsigned long long>(index) & ((1ull << 36) - 1));
    atomicMin(p.error_word, record);
}

// The smallest i in [lo, hi) with bad(i) true, or -1; every thread of the block must call it
// (it synchronises) and gets the same answer.  A block-uniform cost of (hi - lo) / blockDim.x
// loads per thread; the second barrier is paid only when something is bad.
template <class Bad>
__device__ __forceinline__ long long block_first_bad(long long lo, long long hi, Bad bad) {
    __shared__ unsigned long long s_first;
    long long mine = -1;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x)
        if (bad(i)) {
            mine = i;
            break;
        }
    if (threadIdx.x == 0) s_first = ~0ull;
    if (!__syncthreads_or(mine >= 0)) return -1;
    if (mine >= 0) atomicMin(&s_first, static_cast<unsigned long long>(mine));
    __syncthreads();
    const long long first = static_cast<long long>(s_first);
    __syncthreads();  // every thread has read s_first before a later call resets it
    return first;
}

// First bad entry of packed offsets cu[0 .. last] (cu_seqlens_q or _k): entry 0 must be 0, and each
// later entry must lie in [previous entry, total].  -1 when entries 0 .. last are well formed.
__device__ __forceinline__ long long first_bad_offset(const FlashParams& p, const void* cu, int bit, long long last,
                                                      long long total) {
    return block_first_bad(0, last + 1, [&](long long i) {
        const long long v = load_index(p, cu, bit, i);
        return i == 0 ? v != 0 : (v < load_index(p, cu, bit, i - 1) || v > total);
    });
}
