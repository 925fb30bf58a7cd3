"""The precision= option (issue 24): which values each dtype takes, TF32 rounding, and the NumPy
path's "tf32" arithmetic against naive attention on TF32-rounded operands (the exactness rule).
The float32/float64 GPU kernels are tested in test_gpu_float32.py / test_gpu_float64.py; here the
GPU path only has to refuse what the dtype does not take, on first and on warm calls."""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import reference as R
from cuflash._precision import check_precision, tf32_round

from .conftest import requires_gpu


def _qkv(rng, dtype, b=2, sq=70, sk=45, hq=4, hk=2, d=32):
    return (rng.standard_normal((b, sq, hq, d)).astype(dtype) * 2, rng.standard_normal((b, sk, hk, d)).astype(dtype),
            rng.standard_normal((b, sk, hk, d)).astype(dtype))


@pytest.mark.parametrize(("dtype", "precision", "expect"), [
    ("float32", None, "ieee"), ("float32", "ieee", "ieee"), ("float32", "highest", "ieee"), ("float32", "tf32", "tf32"),
    ("float64", None, "ieee"), ("float64", "highest", "ieee"),
    ("float16", None, "ieee"), ("bfloat16", None, "ieee"),
])
def test_accepted_values(dtype, precision, expect):
    assert check_precision(precision, dtype) == expect


@pytest.mark.parametrize(("dtype", "precision", "error", "message"), [
    ("float16", "ieee", ValueError, "take only precision=None"),
    ("bfloat16", "tf32", ValueError, "take only precision=None"),
    ("float64", "tf32", ValueError, "applies to float32 inputs"),
    ("float32", "fast", ValueError, "must be None, 'ieee', 'highest' or 'tf32'"),
    ("float32", 32, TypeError, "must be None or one of"),
])
def test_refused_values_name_the_argument(dtype, precision, error, message):
    with pytest.raises(error, match=message):
        check_precision(precision, dtype)


def test_every_entry_point_checks_it(rng):
    q, k, v = _qkv(rng, np.float16)
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention(q, k, v, precision="tf32")
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention_backward(out, q, k, v, out, lse, precision="ieee")
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention_vjp(q, k, v, precision="tf32")
    cu = np.array([0, 30, 70], np.int32)
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention_varlen(q[0], k[0], v[0], cu, np.array([0, 20, 45], np.int32), precision="tf32")
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=np.array([45, 3], np.int32), precision="tf32")


def test_tf32_rounding():
    x = np.array([1.0, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 + 2**-12, np.inf, -np.inf, np.nan,
                  np.finfo(np.float32).max, 1e-40, 0.0], np.float32)
    r = tf32_round(x)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r[:5], np.array([1.0, 1 + 2**-10, 1 + 2**-9, -(1 + 2**-10), 1.0], np.float32))
    assert r[5] == np.inf and r[6] == -np.inf and np.isnan(r[7]) and r[8] == np.inf and r[10] == 0
    finite = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert not (tf32_round(finite).view(np.uint32) & 0x1FFF).any()  # 10 mantissa bits left
    assert np.abs(tf32_round(finite) / finite - 1).max() <= 2**-11


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_tf32_within_the_rule_against_naive_tf32(rng, causal):
    q, k, v = _qkv(rng, np.float32)
    opts = dict(causal=causal, softcap=8.0)
    out, lse = cuflash.attention(q, k, v, precision="tf32", return_lse=True, **opts)
    ref, ref_lse = R.attention_ref(q, k, v, **opts)
    naive, naive_lse = R.naive_attention(q, k, v, return_lse=True, precision="tf32", **opts)
    R.assert_exact(out.astype(np.float64), ref, naive, "out")
    R.assert_exact(lse, ref_lse, naive_lse, "lse")
    ieee = cuflash.attention(q, k, v, **opts)
    err_tf32, err_ieee = (np.abs(x.astype(np.float64) - ref).max() for x in (out, ieee))
    assert err_tf32 > 8 * err_ieee  # the operands really were rounded
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, precision="tf32", **opts)
    refs = R.attention_backward_ref(dout, q, k, v, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, precision="tf32", **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(g.astype(np.float64), r, n, name)


def test_ieee_names_are_the_default_bitwise(rng):
    q, k, v = _qkv(rng, np.float32)
    base = cuflash.attention(q, k, v, causal=True)
    for precision in ("ieee", "highest"):
        assert np.array_equal(cuflash.attention(q, k, v, causal=True, precision=precision), base)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    assert np.array_equal(cuflash.attention(q64, k64, v64, precision="highest"), cuflash.attention(q64, k64, v64))


def test_varlen_and_kvcache_take_it(rng):
    q, k, v = _qkv(rng, np.float32)
    cu_q, cu_k = np.array([0, 30, 70], np.int32), np.array([0, 20, 45], np.int32)
    a = cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, precision="tf32")
    b = cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k)
    assert not np.array_equal(a, b) and np.allclose(a, b, atol=2e-2)
    lengths = np.array([45, 3], np.int32)
    a = cuflash.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths, precision="tf32")
    b = cuflash.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths)
    assert not np.array_equal(a, b) and np.allclose(a, b, atol=2e-2)


@pytest.mark.gpu
@requires_gpu
def test_gpu_16_bit_inputs_refuse_a_precision_on_warm_calls_too(rng):
    from cuflash import _arrays

    cp = _arrays.cupy_module()
    q, k, v = (cp.asarray(x) for x in _qkv(rng, ml_dtypes.bfloat16))
    cuflash.attention(q, k, v)
    cuflash.attention(q, k, v)  # a plan exists now
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention(q, k, v, precision="highest")


def test_the_oracle_refuses_what_cuflash_refuses():
    q, k, v = _qkv(np.random.default_rng(1), np.float64)
    for bad, exc in (("TF32", ValueError), (123, TypeError), ("tf32", ValueError)):
        with pytest.raises(exc, match="precision"):
            R.naive_attention(q, k, v, precision=bad)
    h = q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
    with pytest.raises(ValueError, match="take only precision=None"):
        R.naive_attention_backward(h[0], *h, precision="tf32")
