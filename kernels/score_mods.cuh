// Score modifiers of one (batch, head) problem: an additive bias, a boolean mask and dropout, read
// in place through their strides (params.cuh, the CUFLASH_MODS kernels).  Used by the forward's
// score pipeline (softmax_tile.cuh) and by the backward's P and dS (score_grad.cuh, flash_bwd.cu and
// flash_bwd_sm90.cu),
// so that both passes see the same scores and the same keep-mask.
#pragma once
#include "mma.cuh"
#include "params.cuh"
#include "philox.cuh"

// The additive bias and boolean mask of one (batch, head) problem (params.cuh: CUFLASH_MODS
// kernels), read in place through their strides, element by element (broadcast axes have stride 0:
// the same bytes, from L1/L2).  Entries outside the problem (rows past sq, keys past sk) are never
// read: bias 0 and hidden there.  Step 4 of the score pipeline of docs/conventions (after ALiBi,
// before the causal/window masks); a mask entry of 0 hides the key like those masks.
struct ScoreMods {
    // Reads its pointers and strides from the kernel's parameters (a __grid_constant__ struct:
    // constant-bank operands) at each use instead of holding them in registers through the main loop.
    const FlashParams& p;
    int b, h, sq, sk;

    // The bias at (i, j) (0 outside the problem), and whether the mask hides (i, j).
    __device__ __forceinline__ float bias(int i, int j) const {
        if (!p.bias || i >= sq || j >= sk) return 0.f;
        const long long at = b * p.bias_batch_stride + h * p.bias_head_stride + i * p.bias_row_stride + j * p.bias_col_stride;
        if (p.bias_dtype == 0) return static_cast<const float*>(p.bias)[at];
        const u16 x = static_cast<const u16*>(p.bias)[at];
        return p.bias_dtype == 1 ? to_float<half_t>(x) : to_float<bf16_t>(x);
    }
    // Dropout on the probabilities of keys j, j + 1 (j even) of query row i, after the row
    // statistics (the LSE ignores it): the dropped ones 0 (philox.cuh, the mask of
    // cuflash.dropout_mask); the kept ones' 1 / (1 - p) is applied with 1 / l at the end
    // (out_scale), so that P stays in [0, 1] in 16 bits.  One generator call gives the words of
    // keys 4 (j >> 2) .. + 3.
    // The call's seed, offset and keep threshold: the seed and offset from the kernel parameters, or
    // read on the device from a (2,) int64 array (dropout_seed_ptr: a captured graph's replays see
    // the values written there since); and the generator's words of keys 4 (j >> 2) .. + 3 of query
    // row i of this problem (batch entries numbered from dropout_first_batch).
    __device__ __forceinline__ DropoutKey dropout_key() const {
        const unsigned long long seed = p.dropout_seed_ptr ? __ldg(p.dropout_seed_ptr) : p.dropout_seed;
        const unsigned long long offset = p.dropout_seed_ptr ? __ldg(p.dropout_seed_ptr + 1) : p.dropout_offset;
        return DropoutKey{seed, offset, static_cast<unsigned long long>(p.dropout_threshold)};
    }
    __device__ __forceinline__ PhiloxWords dropout_words(const DropoutKey& key, int i, int j) const {
        const unsigned long long bh = static_cast<unsigned long long>(b + p.dropout_first_batch) * p.nheads_q + h;
        return key.words(bh, static_cast<unsigned>(i), static_cast<unsigned>(j));
    }
    __device__ __forceinline__ float out_scale() const { return p.dropout_scale > 0.0 ? static_cast<float>(p.dropout_scale) : 1.f; }
    __device__ __forceinline__ void drop(int i, int j, float& p0, float& p1) const {
        const DropoutKey key = dropout_key();
        const PhiloxWords w = dropout_words(key, i, j);
        const bool hi = j & 2;  // (no run-time index into w: it would go to local memory)
        p0 = key.keep(hi ? w.w[2] : w.w[0]) ? p0 : 0.f;
        p1 = key.keep(hi ? w.w[3] : w.w[1]) ? p1 : 0.f;
    }
    // The dropout factors of keys j, j + 1 (j even) of query row i in the backward, from one
    // generator call (as drop()): 1 / (1 - p) where kept, else 0.
    __device__ __forceinline__ void keep_scales(int i, int j, float& z0, float& z1) const {
        const DropoutKey key = dropout_key();
        const PhiloxWords w = dropout_words(key, i, j);
        const bool hi = j & 2;  // (no run-time index into w)
        z0 = key.keep(hi ? w.w[2] : w.w[0]) ? out_scale() : 0.f;
        z1 = key.keep(hi ? w.w[3] : w.w[1]) ? out_scale() : 0.f;
    }
    // The dropout factor of one probability (i, j) in the backward: 1 / (1 - p) if kept, else 0.
    __device__ __forceinline__ float keep_scale(int i, int j) const {
        const DropoutKey key = dropout_key();
        const PhiloxWords w = dropout_words(key, i, j);
        const unsigned word = (j & 2) ? ((j & 1) ? w.w[3] : w.w[2]) : ((j & 1) ? w.w[1] : w.w[0]);  // (no run-time index)
        return key.keep(word) ? out_scale() : 0.f;
    }
    // The bias gradient: dS at (i, j) added to the float32 accumulator of dbias (p.dbias; strides 0
    // on the bias's broadcast axes, which sum there: atomics, not bitwise repeatable; with
    // deterministic=True the host gives a full-size buffer, each element added once, to 0).
    __device__ __forceinline__ void add_dbias(int i, int j, float ds) const {
        if (!p.dbias || i >= sq || j >= sk || ds == 0.f) return;  // (hidden and dropped entries add nothing)
        atomicAdd(p.dbias + b * p.dbias_batch_stride + h * p.dbias_head_stride + i * p.dbias_row_stride + j * p.dbias_col_stride, ds);
    }
    __device__ __forceinline__ bool hides(int i, int j) const {
        return p.mask && (i >= sq || j >= sk ||
                          !p.mask[b * p.mask_batch_stride + h * p.mask_head_stride + i * p.mask_row_stride + j * p.mask_col_stride]);
    }
};
