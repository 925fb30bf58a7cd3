"""The public failure cases of ../shared/cases/public-cases.md, each with its family.

Every body takes the ``xp`` fixture: inputs are built with NumPy, moved with ``xp.asarray``,
and results come back through ``_arrays.to_numpy``, so the same test runs the CPU path (numpy)
and the CUDA kernels (cupy, skipped without a GPU).  Expected values come from the float64
oracle (cuflash.reference) under the exactness rule, or from an analytic answer where the case
gives one.  Cases about the KV cache and paged decoding are not here.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _arrays
from cuflash import reference as R

from .test_cpu import check_backward, check_forward, check_varlen, make_qkv, rand, varlen_inputs

BF16 = ml_dtypes.bfloat16


def np_(x):
    return _arrays.to_numpy(x)


def run(xp, *arrays):
    return tuple(xp.asarray(a) for a in arrays)


def no_nan(*arrays):
    for a in arrays:
        assert not np.isnan(np_(a).astype(np.float64)).any()


# ---------------------------------------------------------------------------------------------
# B01: fully masked rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_b01_fully_masked_rows_reference(rng, dtype):
    q, k, v = (rng.random((1, 8, 1, 8)).astype(dtype) for _ in range(3))
    mask = np.zeros((8, 8), dtype=bool)
    mask[:4, :4] = True  # rows 4-7 see nothing
    out, lse = R.attention_ref(q, k, v, mask=mask)
    sub_out, sub_lse = R.attention_ref(q[:, :4], k[:, :4], v[:, :4])
    np.testing.assert_allclose(out[:, :4], sub_out, rtol=1e-13)
    np.testing.assert_allclose(lse[..., :4], sub_lse, rtol=1e-13)
    assert np.all(out[:, 4:] == 0) and np.all(lse[..., 4:] == -np.inf)
    # the same mask as an additive -inf bias
    bias = np.where(mask, 0.0, -np.inf)
    out_b, lse_b = R.attention_ref(q, k, v, bias=bias)
    np.testing.assert_array_equal(out_b, out)
    np.testing.assert_array_equal(lse_b, lse)
    # backward with dO = 1: masked rows have dq = 0 and add nothing to dk, dv
    dq, dk, dv = R.attention_backward_ref(np.ones((1, 8, 1, 8)), q, k, v, mask=mask)
    sq, sk, sv = R.attention_backward_ref(np.ones((1, 4, 1, 8)), q[:, :4], k[:, :4], v[:, :4])
    assert np.all(dq[:, 4:] == 0) and np.all(dk[:, 4:] == 0) and np.all(dv[:, 4:] == 0)
    np.testing.assert_allclose(dk[:, :4], sk, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(dv[:, :4], sv, rtol=1e-12)
    no_nan(out, lse[..., :4], dq, dk, dv)
    # naive same-dtype attention also keeps the masked rows at 0, not NaN
    naive = R.naive_attention(q, k, v, mask=mask)
    assert np.all(naive[:, 4:] == 0)


def _rule_forward(out, lse, q, k, v, **opts):
    ref, ref_lse = R.attention_ref(q, k, v, **opts)
    naive, naive_lse = R.naive_attention(q, k, v, return_lse=True, **opts)
    R.assert_exact(np_(out), ref, naive, "out")
    R.assert_exact(np_(lse), ref_lse, naive_lse, "lse")


def _rule_backward(grads, refs, naives):
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(np_(g), r, n, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("form", ["mask", "inf-bias"])
def test_b01_fully_masked_rows_through_cuflash(xp, rng, dtype, form):
    """B01 through the public API (issue 23): masked rows give output 0 and LSE -inf, no NaN,
    and no gradient, as a boolean mask or as an additive -inf bias."""
    q, k, v = (rng.random((1, 8, 1, 8)).astype(dtype) for _ in range(3))
    mask = np.zeros((8, 8), dtype=bool)
    mask[:4, :4] = True
    opts = dict(mask=mask) if form == "mask" else dict(bias=np.where(mask, 0.0, -np.inf).astype(np.float32))
    opts = {name: xp.asarray(x) for name, x in opts.items()}  # with q's kind of array
    out, lse = cuflash.attention(*run(xp, q, k, v), return_lse=True, **opts)
    _rule_forward(out, lse, q, k, v, mask=mask)
    assert np.all(np_(out)[:, 4:] == 0) and np.all(np_(lse)[..., 4:] == -np.inf)
    dq, dk, dv = cuflash.attention_backward(*run(xp, np.ones((1, 8, 1, 8), dtype), q, k, v), out, lse, **opts)[:3]
    assert np.all(np_(dq)[:, 4:] == 0) and np.all(np_(dk)[:, 4:] == 0) and np.all(np_(dv)[:, 4:] == 0)
    no_nan(out, dq, dk, dv)


def test_b01_masked_row_inside_a_tile(xp, rng):
    """A fully masked row in the middle of a 128-row tile, Sq = Sk = 441."""
    q, k, v = make_qkv(rng, np.float16, 1, 441, 441, 2, 2, 32)
    mask = rng.random((441, 441)) < 0.8
    mask[200] = False
    out, lse = cuflash.attention(*run(xp, q, k, v), mask=xp.asarray(mask), return_lse=True)
    assert np.all(np_(out)[0, 200] == 0) and np.all(np_(lse)[0, :, 200] == -np.inf)
    _rule_forward(out, lse, q, k, v, mask=mask)


def test_b01_finite_minimum_bias_through_cuflash(xp, rng):
    q, k, v = (rng.random((1, 8, 1, 8)).astype(np.float32) for _ in range(3))
    bias = np.zeros((8, 8), dtype=np.float32)
    bias[4:] = np.finfo(np.float32).min
    out = np_(cuflash.attention(*run(xp, q, k, v), bias=xp.asarray(bias)))
    np.testing.assert_allclose(out[0, 4:, 0], np.broadcast_to(v[0, :, 0].astype(np.float64).mean(0), (4, 8)),
                               rtol=1e-5)
    assert np.all(np.isfinite(out))


# ---------------------------------------------------------------------------------------------
# B29: the gradient through the LSE
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_b29_lse_gradient(xp, rng, heads, causal):
    hq, hk = heads
    q, k, v = make_qkv(rng, BF16, 2, 113, 203, hq, hk, 64)
    mask = np.ones((2, 1, 113, 203), dtype=bool)
    mask[1, 0, 7] = False  # a fully masked row with dlse != 0
    opts = dict(causal=causal, mask=mask)
    gpu_opts = dict(opts, mask=xp.asarray(mask))  # with q's kind of array
    out, lse = cuflash.attention(*run(xp, q, k, v), return_lse=True, **gpu_opts)
    # Loss = sum(lse): dO = 0, dlse = 1.  Then dv = 0 exactly and dq_i = scale sum_j p_ij k_j.
    ones = np.ones(np_(lse).shape, np.float32)
    dq, dk, dv = cuflash.attention_backward(*run(xp, np.zeros(out.shape, BF16), q, k, v), out, lse,
                                            dlse=xp.asarray(ones), **gpu_opts)
    assert np.all(np_(dv).astype(np.float32) == 0)
    refs = R.attention_backward_ref(np.zeros(out.shape), q, k, v, dlse=ones, **opts)
    naives = R.naive_attention_backward(np.zeros(out.shape, BF16), q, k, v, dlse=ones, **opts)
    _rule_backward((dq, dk, dv), refs, naives)
    assert np.all(np_(dq)[1, 7].astype(np.float32) == 0)
    # Random dO and dlse together.
    dout = rand(rng, out.shape, BF16)
    dlse = rng.standard_normal(np_(lse).shape).astype(np.float32)
    grads = cuflash.attention_backward(*run(xp, dout, q, k, v), out, lse, dlse=xp.asarray(dlse), **gpu_opts)
    refs = R.attention_backward_ref(dout, q, k, v, dlse=dlse, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, dlse=dlse, **opts)
    _rule_backward(grads, refs, naives)
    no_nan(*grads)


def test_b01_finite_minimum_mask_is_the_mean_of_v(rng):
    q, k, v = (rng.random((1, 8, 1, 8)).astype(np.float32) for _ in range(3))
    bias = np.zeros((8, 8), dtype=np.float32)
    bias[4:] = np.finfo(np.float32).min  # whole rows at the float32 minimum: masks nothing
    out, lse = R.attention_ref(q, k, v, bias=bias)
    mean_v = v[0, :, 0].astype(np.float64).mean(0)
    np.testing.assert_allclose(out[0, 4:, 0], np.broadcast_to(mean_v, (4, 8)), rtol=1e-12)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    masked, _ = R.attention_ref(q, k, v, bias=np.where(bias < 0, -np.inf, 0.0))
    assert not np.allclose(out[:, 4:], masked[:, 4:])  # finite minimum != -inf
    naive = R.naive_attention(q, k, v, bias=bias)  # plain float32 stays finite too
    np.testing.assert_allclose(naive[0, 4:, 0], out[0, 4:, 0], rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_b01_empty_rows_through_the_api(xp, rng, dtype):
    """The API way to get whole empty rows: seqlens_k = 0 for a batch entry, and causal Sq > Sk."""
    q, k, v = (rng.random((2, 8, 1, 8)).astype(dtype) for _ in range(3))
    seqlens = np.array([4, 0], dtype=np.int32)
    out, lse = check_forward(xp, q, k, v, seqlens_k=seqlens)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    dout = np.ones(q.shape, dtype)
    dq, dk, dv = check_backward(xp, q, k, v, dout, seqlens_k=seqlens)
    assert np.all(dq[1] == 0) and np.all(dk[1] == 0) and np.all(dv[1] == 0)
    assert np.all(dk[0, 4:] == 0) and np.all(dv[0, 4:] == 0)  # keys past seqlens_k
    # a fully masked row inside a 128-row tile: Sq = 441, causal with Sk = 300 -> rows < 141 empty
    q, k, v = make_qkv(rng, dtype, 1, 441, 300, 2, 1, 32)
    out, lse = check_forward(xp, q, k, v, causal=True)
    assert np.all(out[:, :141] == 0) and np.all(lse[..., :141] == -np.inf)
    assert np.all(np.isfinite(lse[..., 141:]))
    dq, dk, dv = check_backward(xp, q, k, v, rng=rng, causal=True)
    assert np.all(dq[:, :141] == 0)


# ---------------------------------------------------------------------------------------------
# B02: causal with Sq > Sk
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
@pytest.mark.parametrize("sizes", [(5, 2), (200, 70), (129, 1)])
def test_b02_causal_more_queries_than_keys(xp, rng, dtype, sizes):
    sq, sk = sizes
    q, k, v = make_qkv(rng, dtype, 1, sq, sk, 2, 2, 64)
    out, lse = check_forward(xp, q, k, v, causal=True)
    empty = sq - sk
    assert np.all(out[:, :empty] == 0) and np.all(lse[..., :empty] == -np.inf)
    assert np.all(np.isfinite(lse[..., empty:]))
    dq, dk, dv = check_backward(xp, q, k, v, rng=rng, causal=True)
    assert np.all(dq[:, :empty] == 0)
    no_nan(out, dq, dk, dv)


def test_b02_varlen_one_sequence_with_empty_rows(xp, rng):
    # sequence 0: qo_len 9 > kv_len 4 (5 empty rows); sequence 1: qo_len 6 <= kv_len 10
    q, k, v, cu_q, cu_k = varlen_inputs(rng, np.float16, [9, 6], [4, 10], 2, 2, 64)
    out, lse, (dq, dk, dv) = check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng, causal=True)
    assert np.all(out[:5] == 0) and np.all(lse[:, :5] == -np.inf) and np.all(dq[:5] == 0)
    # the sequence without empty rows is unaffected: same numbers as running it alone
    alone, alone_lse = cuflash.attention(*run(xp, q[None, 9:], k[None, 4:], v[None, 4:]), causal=True,
                                         return_lse=True)
    np.testing.assert_array_equal(out[9:], np_(alone)[0])
    np.testing.assert_array_equal(lse[:, 9:], np_(alone_lse)[0])


# ---------------------------------------------------------------------------------------------
# B03: causal with Sq < Sk is bottom-right aligned
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(1, 147), (2, 5), (113, 203)])
@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_b03_bottom_right_causal(xp, rng, dtype, sizes):
    sq, sk = sizes
    q, k, v = make_qkv(rng, dtype, 2, sq, sk, 4, 4, 64)
    out, lse = check_forward(xp, q, k, v, causal=True)
    check_backward(xp, q, k, v, rng=rng, causal=True)
    # the first query sees keys 0 .. Sk - Sq exactly: the oracle without any mask, on those keys
    seen = slice(0, sk - sq + 1)
    first = R.attention_ref(q[:, :1], k[:, seen], v[:, seen])
    first_naive = R.naive_attention(q[:, :1], k[:, seen], v[:, seen], return_lse=True)
    R.assert_exact(out[:, :1], first[0], first_naive[0], "row 0")
    R.assert_exact(lse[..., :1], first[1], first_naive[1], "row 0 lse")
    # top-left is a different mode, tested by name
    top, _ = check_forward(xp, q, k, v, causal="top_left")
    ref_top, _ = R.attention_ref(q, k, v, causal=True)
    assert R.max_error_ratio(top, ref_top, R.naive_attention(q, k, v, causal=True)) > 1
    if sq == 1:  # decode: causal equals non-causal over all Sk keys
        full, full_lse = R.attention_ref(q, k, v)
        naive, naive_lse = R.naive_attention(q, k, v, return_lse=True)
        R.assert_exact(out, full, naive, "decode out")
        R.assert_exact(lse, full_lse, naive_lse, "decode lse")


def test_b03_mask_picture():
    assert R.visible_mask(2, 5, causal=True).astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("sizes", [(1023, 1024), (1024, 1023)])
def test_b03_large_off_by_one(xp, rng, sizes):
    sq, sk = sizes
    q, k, v = make_qkv(rng, np.float16, 2, sq, sk, 4, 4, 64)
    out, lse = check_forward(xp, q, k, v, causal=True)
    if sq > sk:
        assert np.all(out[:, 0] == 0) and np.all(lse[..., 0] == -np.inf)  # one empty row
    else:
        assert np.all(np.isfinite(lse))


def test_b03_varlen(xp, rng):
    q, k, v, cu_q, cu_k = varlen_inputs(rng, np.float16, [2, 3], [5, 4], 4, 4, 64)
    out, _, _ = check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng, causal=True)
    # sequence 0 (2 queries, 5 keys): query 0 sees keys 0..3, query 1 sees all 5
    first, _ = R.attention_ref(q[None, :1], k[None, :4], v[None, :4])
    R.assert_exact(out[:1], first[0], R.naive_attention(q[None, :1], k[None, :4], v[None, :4])[0], "row 0")


# ---------------------------------------------------------------------------------------------
# B06: one query, one key
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [8, 16, 32, 64, 128])
def test_b06_single_query_single_key(xp, rng, headdim, causal):
    q, k, v = make_qkv(rng, np.float16, 1, 1, 1, 1, 1, headdim, scale=3.0)
    out, lse = check_forward(xp, q, k, v, causal=causal)
    np.testing.assert_array_equal(out, v)  # p = 1: out = v exactly
    scale = 1 / np.sqrt(headdim)
    np.testing.assert_allclose(lse[0, 0, 0], scale * (q.astype(np.float64) * k).sum(), atol=1e-5)
    dout = np.ones_like(q, shape=v.shape)
    dq, dk, dv = check_backward(xp, q, k, v, dout, causal=causal)  # dq = dk = 0 up to the rule
    np.testing.assert_array_equal(dv, dout)  # dv = dO exactly
    no_nan(dq, dk, dv)
    assert np.abs(dq.astype(np.float64)).max() <= 1e-5 and np.abs(dk.astype(np.float64)).max() <= 1e-5


# ---------------------------------------------------------------------------------------------
# B08: varlen causal, one key per sequence, long query sequences
# ---------------------------------------------------------------------------------------------


def test_b08_varlen_one_key_per_sequence(xp, rng):
    cu_q = np.array([0, 76, 110, 256], dtype=np.int32)
    cu_k = np.array([0, 1, 2, 3], dtype=np.int32)
    q, k, v = rand(rng, (256, 1, 32), np.float16, 3.0), rand(rng, (3, 1, 32), np.float16, 3.0), \
        rand(rng, (3, 1, 32), np.float16, 3.0)
    dout = np.ones((256, 1, 32), np.float16)
    out, lse, (dq, dk, dv) = check_varlen(xp, q, k, v, cu_q, cu_k, dout=dout, causal=True)
    last = cu_q[1:] - 1
    others = np.setdiff1d(np.arange(256), last)
    assert np.all(out[others] == 0) and np.all(lse[:, others] == -np.inf)
    np.testing.assert_array_equal(out[last], v)  # the last row of each sequence: its one key
    np.testing.assert_array_equal(dv, np.ones_like(dv))  # dv_j = dO of that row
    assert np.abs(dq.astype(np.float64)).max() <= 1e-5 and np.abs(dk.astype(np.float64)).max() <= 1e-5
    assert np.all(dq[others] == 0)
    no_nan(out, dq, dk, dv)


# ---------------------------------------------------------------------------------------------
# B09: zero-length sequences, GQA, single-token queries
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["A", "B"])
def test_b09_zero_length_sequences(xp, rng, case):
    if case == "A":
        lens_q, lens_k, hq, hkv, d = [0, 1, 0, 1], [0, 3, 0, 5], 9, 3, 64
        opts = dict(causal=True, softmax_scale=1.0)
    else:
        lens_q, lens_k, hq, hkv, d = [0, 0, 0, 1], [0, 0, 0, 1], 21, 7, 120
        opts = dict(causal=True)
    q, k, v, cu_q, cu_k = varlen_inputs(rng, BF16, lens_q, lens_k, hq, hkv, d)
    # scale 1.0 with d = 64 makes rows nearly one-hot: the gradients are only required finite
    # there (module docstring of test_cpu.py); the default scale checks them by the rule
    out, lse, (dq, dk, dv) = check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng, grads_rule=False, **opts)
    assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    assert np.all(np.isfinite(lse))  # every query row has keys here
    check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng, causal=True)


def test_b09_large_gqa_with_empty_sequences(xp, rng):
    cu_q = np.array([0, 0, 1208, 2048, 2048])
    cu_k = np.array([0, 2538, 4280, 5120, 8192])
    q = rand(rng, (2048, 4, 256), np.float16)
    k, v = rand(rng, (8192, 1, 256), np.float16), rand(rng, (8192, 1, 256), np.float16)
    out, lse, (dq, dk, dv) = check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng)
    assert out.shape == (2048, 4, 256)
    # keys of sequences without queries get exactly zero gradient
    assert np.all(dk[:2538] == 0) and np.all(dv[:2538] == 0)
    assert np.all(dk[5120:] == 0) and np.all(dv[5120:] == 0)
    assert np.abs(dk[2538:5120].astype(np.float32)).max() > 0


def test_b09_queries_without_keys_give_zeros(xp, rng):
    q, k, v, cu_q, cu_k = varlen_inputs(rng, np.float16, [3, 2], [0, 4], 4, 2, 16)
    out, lse, (dq, _, _) = check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng)
    assert np.all(out[:3] == 0) and np.all(lse[:, :3] == -np.inf) and np.all(dq[:3] == 0)


# ---------------------------------------------------------------------------------------------
# B11: empty problems
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shapes", [
    ((0, 3952, 10, 64), (0, 16, 10, 64)),
    ((2, 5, 4, 64), (2, 0, 4, 64)),
    ((2, 0, 4, 64), (2, 7, 4, 64)),
    ((2, 5, 0, 64), (2, 7, 0, 64)),
], ids=["batch0", "seqlen_k0", "seqlen_q0", "heads0"])
def test_b11_empty_problems(xp, rng, shapes):
    qs, ks = shapes
    q, k, v = rand(rng, qs, np.float16), rand(rng, ks, np.float16), rand(rng, ks, np.float16)
    out, lse = cuflash.attention(*run(xp, q, k, v), return_lse=True, causal=True)
    assert out.shape == qs and lse.shape == (qs[0], qs[2], qs[1])
    out, lse = np_(out), np_(lse)
    assert np.all(out == 0) and np.all(lse == -np.inf)  # Sk = 0: every row empty
    grads = cuflash.attention_backward(*run(xp, np.ones(qs, np.float16), q, k, v, out, lse), causal=True)
    assert [g.shape for g in grads] == [qs, ks, ks]
    assert all(np.all(np_(g) == 0) for g in grads)


def test_b11_zero_headdim_is_a_clear_error(xp):
    z = xp.zeros((0, 0, 0, 0), dtype=np.float16)
    with pytest.raises(ValueError, match="head dim"):
        cuflash.attention(z, z, z)
    z = xp.zeros((2, 3, 4, 0), dtype=np.float16)
    with pytest.raises(ValueError, match="head dim"):
        cuflash.attention(z, z, z)


# ---------------------------------------------------------------------------------------------
# B12: GQA head mapping and LSE
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hkv", [8, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_b12_gqa_lse(xp, rng, hkv, causal):
    q, k, v = make_qkv(rng, np.float16, 1, 256, 256, 64, hkv, 128)
    out, lse = check_forward(xp, q, k, v, causal=causal)
    # the mapping is h // group (np.repeat), not h % hkv (np.tile)
    g = 64 // hkv
    k_tiled, v_tiled = np.tile(k, (1, 1, g, 1)), np.tile(v, (1, 1, g, 1))
    tiled, _ = R.attention_ref(q, k_tiled, v_tiled, causal=causal)
    if hkv > 1:
        assert R.max_error_ratio(out, tiled, R.naive_attention(q, k_tiled, v_tiled, causal=causal)) > 1
    if causal:
        check_backward(xp, q, k, v, rng=rng, causal=True)


@pytest.mark.parametrize("heads", [(33, 2), (3, 2)])
def test_b12_invalid_head_ratios(xp, heads):
    hq, hkv = heads
    q, k = xp.ones((1, 4, hq, 8), dtype=np.float16), xp.ones((1, 4, hkv, 8), dtype=np.float16)
    with pytest.raises(ValueError, match=f"k has {hkv} heads"):
        cuflash.attention(q, k, k)


# ---------------------------------------------------------------------------------------------
# B13: LSE is a natural log, merges exactly
# ---------------------------------------------------------------------------------------------


def test_b13_lse_and_split_merge(xp, rng):
    q, k, v = make_qkv(rng, BF16, 2, 37, 1600, 4, 4, 128)
    out, lse = check_forward(xp, q, k, v)
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 37)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(128)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-6)  # natural log, scale once
    halves = []
    for sl in (slice(0, 800), slice(800, 1600)):
        o, l_ = cuflash.attention(*run(xp, q, k[:, sl], v[:, sl]), return_lse=True)
        halves += [o, l_]
    merged, merged_lse = cuflash.merge_states(*halves)
    ref, ref_lse = R.attention_ref(q, k, v)
    naive, naive_lse = R.naive_attention(q, k, v, return_lse=True)
    R.assert_exact(np_(merged), ref, naive, "merged out")
    R.assert_exact(np_(merged_lse), ref_lse, naive_lse, "merged lse")
    np.testing.assert_allclose(np_(merged_lse), np.logaddexp(np_(halves[1]), np_(halves[3])), rtol=1e-6)


def test_b13_varlen_lse_shape(xp, rng):
    q, k, v, cu_q, cu_k = varlen_inputs(rng, BF16, [37, 5], [160, 20], 4, 4, 128)
    _, lse, _ = check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng)
    assert lse.shape == (4, 42) and lse.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# B20: window boundaries
# ---------------------------------------------------------------------------------------------

WINDOWS = [dict(window_size=(0, 0)), dict(window_size=(1, 0)), dict(window_size=(0, 1)),
           dict(window_size=(31, 0)),
           dict(window_size=(300, 0)),  # (L, 0) non-causal with L >= S: exactly causal, no future key
           dict(window_size=(40, 5), causal=True),  # causal clips the right edge: (40, 0)
           dict(window_size=(7, 9))]


@pytest.mark.parametrize("sizes", [(128, 128), (64, 96), (96, 64)])
def test_b20_windows(xp, rng, sizes):
    sq, sk = sizes
    q, k, v = make_qkv(rng, BF16, 2, sq, sk, 4, 4, 64)
    outs = []
    for opts in WINDOWS:
        out, _ = check_forward(xp, q, k, v, **opts)
        check_backward(xp, q, k, v, rng=rng, **opts)
        outs.append(out)
    # (0, 0): out_i is v at j = i + Sk - Sq, exactly; rows whose diagonal key does not exist are 0
    for i in range(sq):
        j = i + sk - sq
        np.testing.assert_array_equal(outs[0][:, i], v[:, j] if 0 <= j < sk else 0)
    # different windows give different outputs
    for a in range(len(outs)):
        for b in range(a + 1, len(outs)):
            assert not np.array_equal(outs[a], outs[b]), (WINDOWS[a], WINDOWS[b])


def test_b20_inclusive_window_counts_keys(xp, rng):
    """(w, w) sees 2w + 1 keys: with all scores equal, out is the mean of exactly those values."""
    q = np.ones((1, 20, 1, 8), np.float32)
    k = np.ones((1, 20, 1, 8), np.float32)
    v = rand(rng, (1, 20, 1, 4), np.float32)
    out = np_(cuflash.attention(*run(xp, q, k, v), window_size=(2, 2)))
    np.testing.assert_allclose(out[0, 10, 0], v[0, 8:13, 0].mean(0), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# B21: softcap
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cap", [50.0, 1.0, 0.1])
def test_b21_softcap(xp, rng, cap, causal):
    q, k, v = make_qkv(rng, BF16, 2, 113, 203, 4, 4, 128)
    check_forward(xp, q, k, v, softcap=cap, causal=causal)
    check_backward(xp, q, k, v, rng=rng, softcap=cap, causal=causal)


@pytest.mark.parametrize("cap", [50.0, 1.0, 0.1])
def test_b21_softcap_large_logits(xp, rng, cap):
    q, k, v = make_qkv(rng, BF16, 2, 113, 203, 4, 4, 128)
    q, k = q * BF16(100), k * BF16(100)  # |scale q.k| ~ 1e4
    out, lse = check_forward(xp, q, k, v, softcap=cap, causal=True)
    assert np.all(np.isfinite(lse)) and np.all(np.abs(lse) <= cap + np.log(203) + 1e-3)
    dq, dk, dv = check_backward(xp, q, k, v, rng=rng, softcap=cap, causal=True)
    # masked keys get exactly zero weight even for a tiny cap: changing them changes nothing
    v2 = v.copy()
    v2[:, 91:] = BF16(1e4)  # keys that query 0 (sees 0..90) must not read
    out2 = np_(cuflash.attention(*run(xp, q, k, v2), softcap=cap, causal=True))
    np.testing.assert_array_equal(out2[:, 0], out[:, 0])


# ---------------------------------------------------------------------------------------------
# B22: ALiBi
# ---------------------------------------------------------------------------------------------

ALIBI_H = np.array([2.0 ** (-8 * (h + 1) / 12) for h in range(12)], dtype=np.float32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sizes", [(1, 147), (113, 203), (203, 113)])
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
def test_b22_alibi(xp, rng, sizes, causal, per_batch):
    sq, sk = sizes
    slopes = np.stack([ALIBI_H, ALIBI_H[::-1]]) if per_batch else ALIBI_H
    q, k, v = make_qkv(rng, np.float16, 2, sq, sk, 12, 12, 64)
    out, _ = check_forward(xp, q, k, v, alibi_slopes=xp.asarray(slopes), causal=causal)
    check_backward(xp, q, k, v, rng=rng, alibi_slopes=slopes, causal=causal)
    # the same bias written out by hand, through the oracle's generic additive bias
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    bias = -np.broadcast_to(slopes, (2, 12))[:, :, None, None] * np.abs(i + sk - sq - j)
    by_hand, _ = R.attention_ref(q, k, v, bias=bias, causal=causal)
    R.assert_exact(out, by_hand, R.naive_attention(q, k, v, bias=bias, causal=causal), "alibi by hand")


def test_b22_decode_newest_key_has_zero_bias(xp, rng):
    """With equal scores, decode weights are exp(-slope * (Sk - 1 - j)): the newest key has bias 0."""
    sk = 147
    q = np.zeros((2, 1, 12, 64), np.float16)  # scores all 0, so only ALiBi shapes the weights
    k = rand(rng, (2, sk, 12, 64), np.float16)
    v = rand(rng, (2, sk, 12, 64), np.float16)
    out = np_(cuflash.attention(*run(xp, q, k, v), alibi_slopes=xp.asarray(ALIBI_H)))
    w = np.exp(-ALIBI_H[:, None].astype(np.float64) * (sk - 1 - np.arange(sk)))  # (H, Sk)
    want = np.einsum("hk,bkhd->bhd", w / w.sum(1, keepdims=True), v.astype(np.float64))
    np.testing.assert_allclose(out[:, 0].astype(np.float64), want, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# B23: backward in every mask mode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1024, 1000])
def test_b23_backward_every_mode(xp, rng, seqlen, causal):
    q, k, v = make_qkv(rng, np.float16, 2, seqlen, seqlen, 4, 4, 64)
    check_backward(xp, q, k, v, rng=rng, causal=causal)


@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(causal="top_left"),
                                  dict(window_size=(64, 16)), dict(window_size=(32, 0), causal=True)],
                         ids=["full", "causal", "top_left", "window", "window_causal"])
def test_b23_backward_sq_ne_sk(xp, rng, opts):
    q, k, v = make_qkv(rng, np.float16, 2, 512, 256, 4, 4, 64)
    check_backward(xp, q, k, v, rng=rng, **opts)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_padding_past_seqlens_k_is_never_read(xp, rng, dtype):
    """Keys and values past seqlens_k are padding a caller may leave uninitialised (NaN, Inf):
    out, lse and the gradients are those of the valid keys alone, and dk, dv are 0 there; the
    oracle (cuflash.reference) does not read them either."""
    q, k, v = make_qkv(rng, dtype, 2, 70, 90, 4, 2, 32)
    lengths = np.array([33, 90], np.int32)
    k[0, 33:], v[0, 33:] = np.nan, np.inf
    check_forward(xp, q, k, v, seqlens_k=xp.asarray(lengths), causal=True)
    dq, dk, dv = check_backward(xp, q, k, v, rng=rng, seqlens_k=xp.asarray(lengths), causal=True)
    assert not np.any(dk[0, 33:]) and not np.any(dv[0, 33:])


# ---------------------------------------------------------------------------------------------
# B28: merging empty partitions
# ---------------------------------------------------------------------------------------------


def _merge_parts(rng, dtype, n, shape=(37, 32, 128)):
    """n partial states of packed (total, heads, dim) outputs: outputs in dtype, finite LSEs (float32)."""
    outs = np.stack([rand(rng, shape, dtype) for _ in range(n)])
    lses = rng.uniform(-5.0, 5.0, (n, shape[1], shape[0])).astype(np.float32)
    return outs, lses


def _merge_ref(outs, lses):
    """The merge in float64: rows where every part is -inf give 0 and -inf."""
    lses = lses.astype(np.float64)
    top = np.max(lses, axis=0)
    live = np.isfinite(top)
    w = np.where(live, np.exp(lses - np.where(live, top, 0.0)), 0.0)  # (n, heads, total)
    total = w.sum(0)
    lse = np.where(live, top + np.log(np.where(live, total, 1.0)), -np.inf)
    w = w / np.where(live, total, 1.0)
    out = np.einsum("nht,nthd->thd", w, outs.astype(np.float64))
    return out, lse


def _assert_merged(out, lse, outs, lses, dtype):
    """Each element within a few units of dtype's rounding of the float64 merge (measured: half a
    unit for fp16/bf16 outputs, about three for fp32 on the CPU), LSE within float32's."""
    ref, ref_lse = _merge_ref(outs, lses)
    scale, _ = _merge_ref(np.abs(outs.astype(np.float64)), lses)  # sum of |weight * part|: each element's own scale
    eps = float(np.finfo(dtype).eps) * (2 if np.dtype(dtype).itemsize == 2 else 8)
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= eps * scale + 1e-30), float((err / (scale + 1e-30)).max() / eps)
    live = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~live)
    np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-6, atol=2e-6)


SPLIT_DTYPES = [np.float16, BF16, np.float32]


@pytest.mark.parametrize("dtype", SPLIT_DTYPES, ids=["fp16", "bf16", "fp32"])
def test_b28_merge_of_empty_partitions(xp, rng, dtype):
    """Both parts empty give (0, -inf) with no NaN; one part empty gives the other bitwise; a mixed
    batch (a quarter of the rows empty in both parts, a tenth in one or the other) gives each row
    its own case; equal very negative finite LSEs give the outputs' mean and LSE + ln 2."""
    (o1, o2), (l1, l2) = _merge_parts(rng, dtype, 2)
    ninf = np.full_like(l1, -np.inf)
    out, lse = (np_(x) for x in cuflash.merge_states(*run(xp, o1, ninf, o2, ninf)))
    assert not np.isnan(out.astype(np.float64)).any() and (out == 0).all() and np.isneginf(lse).all()
    out, lse = (np_(x) for x in cuflash.merge_states(*run(xp, o1, l1, o2, ninf)))
    assert np.array_equal(out.view(np.uint8), o1.view(np.uint8)) and np.array_equal(lse, l1)
    out, lse = (np_(x) for x in cuflash.merge_states(*run(xp, o1, ninf, o2, l2)))
    assert np.array_equal(out.view(np.uint8), o2.view(np.uint8)) and np.array_equal(lse, l2)

    kind = rng.uniform(size=l1.shape)  # (heads, total): < 0.25 both empty, < 0.3 the first, < 0.35 the second
    m1 = np.where(kind < 0.3, -np.inf, l1).astype(np.float32)
    m2 = np.where((kind < 0.25) | ((kind >= 0.3) & (kind < 0.35)), -np.inf, l2).astype(np.float32)
    out, lse = (np_(x) for x in cuflash.merge_states(*run(xp, o1, m1, o2, m2)))
    both, first, second = (kind < 0.25).T, ((kind >= 0.25) & (kind < 0.3)).T, ((kind >= 0.3) & (kind < 0.35)).T
    assert not np.isnan(out.astype(np.float64)).any()
    assert (out[both] == 0).all() and np.isneginf(lse.T[both]).all()
    assert np.array_equal(out[first].view(np.uint8), o2[first].view(np.uint8)) and np.array_equal(lse.T[first], l2.T[first])
    assert np.array_equal(out[second].view(np.uint8), o1[second].view(np.uint8)) and np.array_equal(lse.T[second], l1.T[second])
    _assert_merged(out, lse, np.stack([o1, o2]), np.stack([m1, m2]), dtype)

    for far in (-1e4, -1e30):  # exp() of either alone underflows; at -1e4 the + ln 2 shows in float32
        lf = np.full_like(l1, far)
        out, lse = (np_(x) for x in cuflash.merge_states(*run(xp, o1, lf, o2, lf)))
        _assert_merged(out, lse, np.stack([o1, o2]), np.stack([lf, lf]), dtype)
        if far == -1e4:
            np.testing.assert_allclose(lse.astype(np.float64), far + np.log(2.0), atol=2e-3)


@pytest.mark.parametrize("dtype", SPLIT_DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_b28_n_way_merge_with_rows_empty_in_every_part(xp, rng, parts, dtype):
    """A stacked merge of 1, 2 or 5 parts where some rows are empty in all of them (0, -inf)
    and others in some: each row as the float64 merge of its live parts."""
    outs, lses = _merge_parts(rng, dtype, parts)
    dead = rng.uniform(size=lses.shape[1:]) < 0.2  # (heads, total): empty in every part
    some = rng.uniform(size=lses.shape) < 0.3
    lses = np.where(dead[None] | some, -np.inf, lses).astype(np.float32)
    out, lse = (np_(x) for x in cuflash.merge_states(*run(xp, outs, lses)))
    assert not np.isnan(out.astype(np.float64)).any()
    empty = np.isneginf(_merge_ref(outs, lses)[1])
    assert (out[empty.T] == 0).all()
    _assert_merged(out, lse, outs, lses, dtype)


def test_b28_merging_a_call_without_keys_changes_nothing(xp, rng):
    q, k, v = make_qkv(rng, BF16, 2, 37, 90, 4, 4, 64)
    full, full_lse = (np_(x) for x in cuflash.attention(*run(xp, q, k, v), return_lse=True))
    empty, empty_lse = cuflash.attention(*run(xp, q, k[:, :0], v[:, :0]), return_lse=True)
    assert np.isneginf(np_(empty_lse)).all() and not np_(empty).astype(np.float64).any()
    for args in ((full, full_lse, empty, empty_lse), (empty, empty_lse, full, full_lse)):
        out, lse = (np_(x) for x in cuflash.merge_states(*(xp.asarray(a) for a in args)))
        assert np.array_equal(out.view(np.uint16), full.view(np.uint16)) and np.array_equal(lse, full_lse)


# ---------------------------------------------------------------------------------------------
# B31: backward with Dv != Dqk and with padded head dims
# ---------------------------------------------------------------------------------------------

B31_DIMS = [(128, 96), (128, 64), (128, 40), (192, 128), (64, 128), (96, 64), (72, 72), (104, 104), (80, 80),
            (40, 40), (8, 8)]


def _columns_scaled(rng, shape, dtype):
    """dO with column c scaled by (1 + c / Dv): a gradient column written to the wrong place shows."""
    return (rng.standard_normal(shape) * (1.0 + np.arange(shape[-1]) / shape[-1])).astype(dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dims", B31_DIMS, ids=[f"{a}-{b}" for a, b in B31_DIMS])
def test_b31_value_and_padded_head_dims_backward(xp, rng, dims, heads, causal):
    """out (..., Dv), dq and dk (..., Dqk), dv (..., Dv) into NaN-poisoned buffers against the
    float64 backward, bf16 and fp16 alternating over the cases, GQA 8/2 summing its groups."""
    dqk, dv = dims
    dtype = BF16 if (dqk // 8 + (heads == (8, 2)) + causal) % 2 else np.float16
    q, k, v = make_qkv(rng, dtype, 2, 113, 203, *heads, dqk, dv)
    check_forward(xp, q, k, v, causal=causal)
    check_backward(xp, q, k, v, _columns_scaled(rng, q.shape[:3] + (dv,), dtype), causal=causal)


@pytest.mark.parametrize("dims", [(128, 96), (72, 72)], ids=["128-96", "72-72"])
def test_b31_square_512_and_varlen(xp, rng, dims):
    dqk, dv = dims
    q, k, v = make_qkv(rng, np.float16, 2, 512, 512, 8, 2, dqk, dv)
    check_backward(xp, q, k, v, _columns_scaled(rng, q.shape[:3] + (dv,), np.float16), causal=True)
    for lens in ([512], [113, 203]):
        qv, kv, vv, cu_q, cu_k = varlen_inputs(rng, BF16, lens, lens, 4, 2, dqk, dv)
        dout = _columns_scaled(rng, qv.shape[:2] + (dv,), BF16)
        check_varlen(xp, qv, kv, vv, cu_q, cu_k, dout=dout, causal=True)


# ---------------------------------------------------------------------------------------------
# B34: ALiBi's anchor when Sq != Sk, and decode against the full call
# ---------------------------------------------------------------------------------------------

ALIBI_8 = np.array([2.0 ** (-8 * (h + 1) / 8) for h in range(8)], dtype=np.float32)


@pytest.mark.parametrize("sizes", [(3, 9), (113, 203), (1, 147)])
def test_b34_causal_alibi_lse_has_no_offset(xp, rng, sizes):
    """The LSE of causal ALiBi with Sq != Sk is the oracle's, whose bias is -slope |i + Sk - Sq - j|
    (a bias of +slope j would give the same output and an LSE offset by slope (i + Sk - Sq))."""
    sq, sk = sizes
    q, k, v = make_qkv(rng, np.float32, 2, sq, sk, 8, 8, 64)
    _, lse = check_forward(xp, q, k, v, alibi_slopes=xp.asarray(ALIBI_8), causal=True)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / 8.0
    s = s - ALIBI_8[None, :, None, None] * np.abs(i + sk - sq - j)
    s = np.where(j <= i + sk - sq, s, -np.inf)
    top = s.max(-1, keepdims=True)
    np.testing.assert_allclose(lse, (top + np.log(np.exp(s - top).sum(-1, keepdims=True)))[..., 0], rtol=1e-5, atol=1e-5)


def test_b34_decode_steps_equal_the_full_causal_call(xp, rng):
    """Causal self-attention with ALiBi, Sq = Sk = 129, against 129 decode calls (Sq = 1, Sk = i + 1):
    row i of the full call and decode step i are the same attention problem, so their outputs and
    LSEs agree to float32's rounding (1e-5; the full call is checked against the oracle)."""
    n = 129
    q, k, v = make_qkv(rng, np.float32, 1, n, n, 8, 8, 64)
    full, full_lse = check_forward(xp, q, k, v, alibi_slopes=xp.asarray(ALIBI_8), causal=True)
    for i in range(n):
        out, lse = (np_(x) for x in cuflash.attention(*run(xp, q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1]),
                                                         alibi_slopes=xp.asarray(ALIBI_8), causal=True, return_lse=True))
        np.testing.assert_allclose(out[:, 0], full[:, i], rtol=1e-5, atol=1e-5, err_msg=f"step {i}")
        np.testing.assert_allclose(lse[:, :, 0], full_lse[:, :, i], rtol=1e-5, atol=1e-5, err_msg=f"step {i}")


def test_b34_cross_attention_full_call_against_steps(xp, rng):
    """Non-causal cross-attention with ALiBi, T = 7 queries over S = 50 keys: the anchor is
    bottom-right (the docstrings' -slope |i + Sk - Sq - j|), so query i of the full call sits at key
    position i + S - T, and a step sending query i alone sits at S - 1.  Every call matches the
    oracle on its own inputs; the last query's step is the full call's last row."""
    t, s = 7, 50
    q, k, v = make_qkv(rng, np.float32, 2, t, s, 8, 8, 64)
    full, full_lse = check_forward(xp, q, k, v, alibi_slopes=xp.asarray(ALIBI_8))
    for i in range(t):
        out, lse = check_forward(xp, q[:, i:i + 1], k, v, alibi_slopes=xp.asarray(ALIBI_8))
        if i == t - 1:  # the same anchor: query at key position S - 1
            np.testing.assert_allclose(out[:, 0], full[:, i], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(lse[:, :, 0], full_lse[:, :, i], rtol=1e-5, atol=1e-5)
