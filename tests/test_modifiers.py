"""Additive bias, boolean masks, dropout and the LSE gradient (issue 23) against the float64
oracle, with the exactness rule; every broadcast form, strided and stride-0 views, fully masked
rows, causal and window with masks, GQA, every dtype of the NumPy path, and the same bodies on the
GPU (float16/bfloat16; tests/test_gpu_backward.py covers the GPU kernels' head dims)."""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _arrays
from cuflash import reference as R

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
B, SQ, SK, HQ, HK, D = 2, 65, 47, 4, 2, 16


def _qkv(rng, dtype, sq=SQ, sk=SK):
    q = (rng.standard_normal((B, sq, HQ, D)) * 2).astype(dtype)
    k = rng.standard_normal((B, sk, HK, D)).astype(dtype)
    v = rng.standard_normal((B, sk, HK, D)).astype(dtype)
    return q, k, v


def _bias_forms(rng, sq=SQ, sk=SK):
    full = rng.standard_normal((B, HQ, sq, 2 * sk)).astype(np.float32)
    return {
        "1-1-sq-sk": rng.standard_normal((1, 1, sq, sk)).astype(np.float32),
        "key-padding": np.where(rng.random((B, 1, 1, sk)) < 0.2, -np.inf, 0.0).astype(np.float32),
        "1-h-sq-sk": rng.standard_normal((1, HQ, sq, sk)).astype(np.float16),
        "sq-sk": rng.standard_normal((sq, sk)),  # fewer axes: NumPy broadcasting
        "strided": full[..., ::2],
        "stride-0": np.broadcast_to(rng.standard_normal((1, HQ, 1, sk)).astype(np.float32), (B, HQ, sq, sk)),
    }


def _check(name, got, ref, naive):
    R.assert_exact(_arrays.to_numpy(got).astype(np.float64) if got.dtype.kind == "f" else got, ref, naive, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("form", list(_bias_forms(np.random.default_rng(0))))
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(9, 3), softcap=5.0)],
                         ids=["plain", "causal", "window-softcap"])
def test_bias_forward_and_backward(xp, rng, dtype, form, opts):
    q, k, v = _qkv(rng, dtype)
    bias = _bias_forms(rng)[form]
    args = dict(opts, bias=bias)
    out, lse = cuflash.attention(*(xp.asarray(x) for x in (q, k, v)), return_lse=True,
                                 **dict(opts, bias=xp.asarray(bias) if xp is not np else bias))
    ref, ref_lse = R.attention_ref(q, k, v, **args)
    naive, naive_lse = R.naive_attention(q, k, v, return_lse=True, **args)
    _check("out", out, ref, naive)
    _check("lse", lse, ref_lse, naive_lse)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(lse.dtype)
    grads = cuflash.attention_backward(xp.asarray(dout), *(xp.asarray(x) for x in (q, k, v)), out, lse,
                                       return_dbias=True, dlse=xp.asarray(dlse),
                                       **dict(opts, bias=xp.asarray(bias) if xp is not np else bias))
    refs = R.attention_backward_ref(dout, q, k, v, dlse=dlse, **args)
    naives = R.naive_attention_backward(dout, q, k, v, dlse=dlse, **args)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        _check(name, g, r, n)
    dbias = grads[3]
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    _check("dbias", dbias, refs[3], naives[3].astype(bias.dtype))  # dbias comes in bias's dtype


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_masks_and_fully_masked_rows(xp, rng, dtype):
    q, k, v = _qkv(rng, dtype)
    mask = rng.random((B, 1, SQ, SK)) < 0.7
    mask[0, 0, 3] = False  # a row that sees no key
    mask[1, 0, :, 10:30] = False  # a block of keys
    opts = dict(mask=mask, causal=True)
    gpu_opts = dict(opts, mask=xp.asarray(mask))  # the mask goes with q's kind of array
    out, lse = cuflash.attention(*(xp.asarray(x) for x in (q, k, v)), return_lse=True, **gpu_opts)
    ref, ref_lse = R.attention_ref(q, k, v, **opts)
    naive, naive_lse = R.naive_attention(q, k, v, return_lse=True, **opts)
    _check("out", out, ref, naive)
    _check("lse", lse, ref_lse, naive_lse)
    out_np, lse_np = _arrays.to_numpy(out), _arrays.to_numpy(lse)
    assert (out_np[0, 3] == 0).all() and np.isneginf(lse_np[0, :, 3]).all()
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cuflash.attention_backward(xp.asarray(dout), *(xp.asarray(x) for x in (q, k, v)), out, lse, **gpu_opts)
    refs = R.attention_backward_ref(dout, q, k, v, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        _check(name, g, r, n)
    assert (_arrays.to_numpy(grads[0])[0, 3] == 0).all()
    # A key-padding mask equals the same keys cut off by seqlens_k.
    pad = np.arange(SK)[None, None, None, :] < np.array([40, 17])[:, None, None, None]
    masked = cuflash.attention(q, k, v, mask=pad)
    assert np.allclose(masked.astype(np.float64),
                       cuflash.attention(q, k, v, seqlens_k=np.array([40, 17])).astype(np.float64), atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_forward_backward(xp, rng, dtype, p):
    q, k, v = _qkv(rng, dtype)
    seed = (2024, 7)
    keep = cuflash.dropout_mask(seed, (B, HQ, SQ, SK), p)
    opts = dict(causal=True, alibi_slopes=np.linspace(0.1, 1.0, HQ).astype(np.float32))
    run = dict(opts, dropout_p=p, dropout_seed=seed)
    out, lse = cuflash.attention(*(xp.asarray(x) for x in (q, k, v)), return_lse=True, **run)
    ref, ref_lse = R.attention_ref(q, k, v, dropout_p=p, dropout_keep=keep, **opts)
    naive, naive_lse = R.naive_attention(q, k, v, return_lse=True, dropout_p=p, dropout_keep=keep, **opts)
    _check("out", out, ref, naive)
    _check("lse", lse, ref_lse, naive_lse)  # the LSE ignores dropout
    again = cuflash.attention(*(xp.asarray(x) for x in (q, k, v)), **run)
    assert np.array_equal(_arrays.to_numpy(again).view(np.uint8), _arrays.to_numpy(out).view(np.uint8))
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cuflash.attention_backward(xp.asarray(dout), *(xp.asarray(x) for x in (q, k, v)), out, lse, **run)
    refs = R.attention_backward_ref(dout, q, k, v, dropout_p=p, dropout_keep=keep, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, dropout_p=p, dropout_keep=keep, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        _check(name, g, r, n)


def test_dropout_zero_is_bitwise_no_dropout(rng):
    q, k, v = _qkv(rng, np.float32)
    plain = cuflash.attention(q, k, v, causal=True)
    assert np.array_equal(cuflash.attention(q, k, v, causal=True, dropout_p=0.0, dropout_seed=5), plain)
    assert np.array_equal(cuflash.attention(q, k, v, causal=True, dropout_p=0.0), plain)


def test_vjp_returns_dbias_and_takes_dlse(rng):
    q, k, v = _qkv(rng, np.float64, sq=9, sk=11)
    bias = rng.standard_normal((1, HQ, 1, 11))
    (out, lse), vjp = cuflash.attention_vjp(q, k, v, bias=bias, causal=True, return_lse=True)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    dq, dk, dv, dbias = vjp(dout, dlse)
    refs = R.attention_backward_ref(dout, q, k, v, bias=bias, causal=True, dlse=dlse)
    for g, r in zip((dq, dk, dv, dbias), refs):
        assert np.allclose(g, r, atol=1e-10)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(bias=np.zeros((3, HQ, SQ, SK), np.float32)), ValueError, "bias of shape"),
    (dict(bias=np.zeros((SQ, SK), bool)), TypeError, "bias must be a float array.*mask="),
    (dict(bias=np.zeros((SQ, SK), np.int32)), TypeError, "bias must be a float array"),
    (dict(bias=[[0.0]]), TypeError, "bias must be an array"),
    (dict(mask=np.zeros((SQ, SK), np.float32)), TypeError, "mask must be a bool array.*bias="),
    (dict(mask=np.ones((SQ, SK), np.int8)), TypeError, "mask must be a bool array.*astype\\(bool\\)"),
    (dict(mask=np.ones((SQ, SK + 1), bool)), ValueError, "mask of shape"),
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, "dropout_p must lie in"),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, "dropout_p must lie in"),
    (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p"),
    (dict(dropout_p=0.1), ValueError, "needs a dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=(1, 2, 3)), TypeError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed"),
])
def test_bad_modifiers_name_the_argument(rng, kwargs, exc, words):
    q, k, v = _qkv(rng, np.float32)
    with pytest.raises(exc, match=words):
        cuflash.attention(q, k, v, **kwargs)


def test_bad_backward_arguments(rng):
    q, k, v = _qkv(rng, np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="return_dbias=True needs a bias"):
        cuflash.attention_backward(out, q, k, v, out, lse, return_dbias=True)
    with pytest.raises(ValueError, match="dlse"):
        cuflash.attention_backward(out, q, k, v, out, lse, dlse=lse[:, :, :-1])
    with pytest.raises(TypeError, match="dlse"):
        cuflash.attention_backward(out, q, k, v, out, lse, dlse=lse.astype(np.float16))


def test_varlen_dropout_is_each_sequences_padded_mask(rng):
    """Packed sequences draw the keep-mask of (sequence, head, position within the sequence), so
    sequence b of a packed batch equals batch entry b of a padded call with the same seed."""
    lengths_q, lengths_k = [5, 0, 17, 9], [7, 3, 17, 12]
    cu_q, cu_k = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    q = rng.standard_normal((cu_q[-1], HQ, D))
    k, v = rng.standard_normal((cu_k[-1], HK, D)), rng.standard_normal((cu_k[-1], HK, D))
    run = dict(dropout_p=0.3, dropout_seed=(77, 2), causal=True)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **run)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **run)
    mq, mk = max(lengths_q), max(lengths_k)
    for b in (0, 2, 3):
        keep = cuflash.dropout_mask((77, 2), (4, HQ, mq, mk), 0.3)[b:b + 1, :, :lengths_q[b], :lengths_k[b]]
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]][None], k[cu_k[b]:cu_k[b + 1]][None], v[cu_k[b]:cu_k[b + 1]][None]
        ref, ref_lse = R.attention_ref(qs, ks, vs, causal=True, dropout_p=0.3, dropout_keep=keep)
        assert np.allclose(out[cu_q[b]:cu_q[b + 1]], ref[0], atol=1e-12)
        refs = R.attention_backward_ref(dout[cu_q[b]:cu_q[b + 1]][None], qs, ks, vs, causal=True, dropout_p=0.3,
                                        dropout_keep=keep)
        assert np.allclose(grads[0][cu_q[b]:cu_q[b + 1]], refs[0][0], atol=1e-12)
        assert np.allclose(grads[2][cu_k[b]:cu_k[b + 1]], refs[2][0], atol=1e-12)
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.3)


def test_no_numpy_warning_and_vjp_dlse_needs_return_lse(rng):
    """From a new-user trial: overflowing scores printed NumPy RuntimeWarnings from cuflash's own
    code; attention_vjp without return_lse took dlse silently."""
    import warnings

    q, k, v = np.ones((1, 1, 1, 1)), np.array([1.0, -17.0]).reshape(1, 2, 1, 1), np.array([3.0, 5.0]).reshape(1, 2, 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = cuflash.attention(q, k, v, softmax_scale=1e307)
        cuflash.attention(q, k, v, bias=np.array([np.inf, 0.0]))
        cuflash.attention_backward(out, q, k, v, *cuflash.attention(q, k, v, softmax_scale=1e307, return_lse=True),
                                   softmax_scale=1e307)
    assert float(out.ravel()[0]) == 3.0
    out, vjp = cuflash.attention_vjp(q, k, v)
    with pytest.raises(ValueError, match="dlse needs attention_vjp"):
        vjp(out, np.zeros((1, 1, 1)))
    assert cuflash.dropout_mask(1, np.array([1, 1, 4, 4]), 0.5).shape == (1, 1, 4, 4)


def test_vjp_keeps_the_forward_keep_mask_when_the_seed_array_advances(rng):
    """A NumPy (seed, offset) array advanced in place after attention_vjp (as a training loop
    advances its offset) must not change the backward of the forward already taken."""
    q, k, v = _qkv(rng, np.float32)
    seed = np.array([11, 0], np.int64)
    out, vjp = cuflash.attention_vjp(q, k, v, dropout_p=0.3, dropout_seed=seed)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    before = vjp(dout)
    seed[1] += 1
    after = vjp(dout)
    for a, b in zip(before, after):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lowest_float_bias_on_a_masked_row(rng, dtype):
    """The Hugging Face mask (finfo(float32).min added to the scores) on a whole query row: its
    scores round to one value, so the row is uniform; the backward must not form P from the
    LSE m + log n, which rounds back to m there (every P would be 1 instead of 1/n)."""
    q, k, v = _qkv(rng, dtype, sq=7, sk=5)
    bias = np.zeros((1, 1, 7, 5), dtype=dtype)
    bias[..., 3, :] = np.finfo(np.float32).min
    out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias)
    ref = R.attention_backward_ref(dout, q, k, v, bias=bias)
    naive = R.naive_attention_backward(dout, q, k, v, bias=bias)
    for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        _check(name, g, r, n)


def test_bias_past_float32_is_refused_for_float32_scores():
    q = np.ones((1, 2, 1, 4), np.float32)
    k = np.ones((1, 3, 1, 4), np.float32)
    with pytest.raises(ValueError, match="bias holds finite values above float32's range"):
        cuflash.attention(q, k, k, bias=np.array([[1e39, 0, 0], [0, 0, 0]]))
    out = cuflash.attention(q, k, k, bias=np.array([[-1e39, 0, 0], [0, 0, 0]]))  # -inf in float32: masks
    assert np.isfinite(out).all()
    assert np.isfinite(cuflash.attention(q.astype(np.float64), k.astype(np.float64), k.astype(np.float64),
                                         bias=np.array([[1e39, 0, 0], [0, 0, 0]]))).all()  # float64 scores


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_reference_gives_nan_lse_on_a_nan_row(value):
    """The oracle agrees with the documented rule: a row with a NaN or +inf score is NaN, LSE too."""
    q, k = np.ones((1, 2, 1, 4)), np.ones((1, 3, 1, 4))
    bias = np.zeros((1, 1, 2, 3))
    bias[..., 0, :] = value
    out, lse = R.attention_ref(q, k, k, bias=bias)
    assert np.isnan(lse[0, 0, 0]) and np.isnan(out[0, 0]).all() and np.isfinite(lse[0, 0, 1])
    got, got_lse = cuflash.attention(q, k, k, bias=bias, return_lse=True)
    assert np.isnan(got_lse[0, 0, 0]) and np.isnan(got[0, 0]).all()


def test_gradient_buffers_may_not_overlap_bias_mask_or_dlse(rng):
    """From a review: the backward reads bias, mask and dlse while it writes dq, dk, dv, so a
    gradient buffer sharing their memory is refused like one sharing q's."""
    q, k, v = _qkv(rng, np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    store = np.zeros(B * HQ * SQ * SK + q.size, np.float32)
    bias = store[:B * HQ * SQ * SK].reshape(B, HQ, SQ, SK)
    dq = store[:q.size].reshape(q.shape)
    with pytest.raises(ValueError, match="dq overlaps bias"):
        cuflash.attention_backward(out, q, k, v, out, lse, bias=bias, dq=dq)
    dlse = np.zeros(lse.size + q.size, np.float32)
    with pytest.raises(ValueError, match="dq overlaps dlse"):
        cuflash.attention_backward(out, q, k, v, out, lse, dlse=dlse[:lse.size].reshape(lse.shape),
                                   dq=dlse[:q.size].reshape(q.shape))
