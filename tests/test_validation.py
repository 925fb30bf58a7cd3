"""Every bad input of the conventions raises the documented exception, naming the argument.

Conventions (docs/conventions.md, "Errors"): ValueError for shapes and values,
TypeError for dtypes and array kinds, and the message names the argument.  Empty problems are
valid and return correctly shaped results.
"""

import re
import warnings

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash.reference import attention_ref

BF16 = np.dtype(ml_dtypes.bfloat16)


def make(b=2, sq=4, sk=5, hq=4, hk=2, d=8, dv=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, dv)).astype(dtype)
    return q, k, v


def make_packed(total_q=7, total_k=9, hq=4, hk=2, d=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((total_q, hq, d)).astype(dtype)
    k = rng.standard_normal((total_k, hk, d)).astype(dtype)
    v = rng.standard_normal((total_k, hk, d)).astype(dtype)
    return q, k, v


CU_Q = np.array([0, 3, 7], dtype=np.int32)
CU_K = np.array([0, 4, 9], dtype=np.int32)


# --- q, k, v: kinds, dtypes, ranks, shapes ---------------------------------------------------


def test_list_inputs_run_as_numpy_arrays():
    """Array-likes work on the CPU path as NumPy functions take them (issue 20): lists of floats
    are float64 arrays, lists of integers too."""
    q, k, v = (x.astype(np.float64) for x in make())
    out, lse = cuflash.attention(q.tolist(), k.tolist(), v.tolist(), causal=True, return_lse=True)
    ref, ref_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == np.float64 and np.array_equal(out, ref) and np.array_equal(lse, ref_lse)
    ints = cuflash.attention(np.ones(q.shape, int).tolist(), k, v)
    assert ints.dtype == np.float64


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_a_list_among_float32_arrays_is_a_dtype_error(which):
    args = dict(zip("qkv", make()))
    args[which] = args[which].tolist()  # float64 once converted
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        cuflash.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("bad, words", [([[1.0], [1.0, 2.0]], "not a rectangular array"), (["a"], "expected numbers"),
                                        ([[[1 + 2j]]], "expected numbers")])
def test_array_likes_that_are_not_numbers(bad, words):
    q = make()[0]
    with pytest.raises(TypeError, match=rf"^k \(list\).*{words}"):
        cuflash.attention(q, bad, q)


def test_unbatched_inputs_equal_a_batch_of_one():
    """(seqlen, nheads, headdim) inputs (layout "bhsd": (nheads, seqlen, headdim)) run as one
    sequence: out has q's shape, the LSE is (nheads, seqlen); the backward and attention_vjp
    take them too (issue 20, as jax.nn.dot_product_attention does)."""
    q, k, v = make(b=1)
    for layout, axes in (("bshd", (0, 1, 2)), ("bhsd", (1, 0, 2))):
        q3, k3, v3 = (x[0].transpose(axes) for x in (q, k, v))
        out, lse = cuflash.attention(q3, k3, v3, causal=True, return_lse=True, layout=layout)
        ref, ref_lse = cuflash.attention(q3[None], k3[None], v3[None], causal=True, return_lse=True, layout=layout)
        assert out.shape == q3.shape and lse.shape == (q.shape[2], q.shape[1])
        assert np.array_equal(out, ref[0]) and np.array_equal(lse, ref_lse[0])
        grads = cuflash.attention_backward(out, q3, k3, v3, out, lse, causal=True, layout=layout)
        ref_grads = cuflash.attention_backward(ref, q3[None], k3[None], v3[None], ref, ref_lse, causal=True, layout=layout)
        for g, r, x in zip(grads, ref_grads, (q3, k3, v3)):
            assert g.shape == x.shape and np.array_equal(g, r[0])
        given = np.full(q3.shape, np.nan, np.float32)
        assert cuflash.attention(q3, k3, v3, out=given, causal=True, layout=layout) is given
        assert np.array_equal(given, out)
        vjp_out, vjp = cuflash.attention_vjp(q3, k3, v3, layout=layout)
        assert np.array_equal(vjp(vjp_out)[0], cuflash.attention_backward(vjp_out, q3, k3, v3, *cuflash.attention(
            q3, k3, v3, return_lse=True, layout=layout), layout=layout)[0])


def test_unbatched_q_needs_unbatched_k_v_and_lse():
    q, k, v = make(b=1)
    with pytest.raises(ValueError, match=r"q is unbatched \(seqlen, nheads, headdim\), so k must be too"):
        cuflash.attention(q[0], k, v[0])
    out, lse = cuflash.attention(q[0], k[0], v[0], return_lse=True)
    with pytest.raises(ValueError, match=r"lse of an unbatched call must have shape \(nheads, seqlen_q\)"):
        cuflash.attention_backward(out, q[0], k[0], v[0], out, lse[None])
    # Buffers of the wrong shape: the message gives the unbatched shapes, not the lifted ones.
    wrong = np.empty(out.shape[:-1] + (out.shape[-1] + 1,), out.dtype)
    with pytest.raises(ValueError, match=re.escape(f"out must have shape {tuple(out.shape)}; got {tuple(wrong.shape)}")):
        cuflash.attention(q[0], k[0], v[0], out=wrong)
    with pytest.raises(ValueError, match=re.escape(f"dk must have shape {tuple(k[0].shape)}")):
        cuflash.attention_backward(out, q[0], k[0], v[0], out, lse, dk=np.empty(wrong.shape[:-1] + (3,), k.dtype))
    with pytest.raises(ValueError, match=re.escape(f"lse must have shape {tuple(lse.shape)}")):
        cuflash.attention_backward(out, q[0], k[0], v[0], out, np.zeros((lse.shape[0], lse.shape[1] + 1), lse.dtype))
    with pytest.raises(ValueError, match=re.escape(f"dout must have shape {tuple(out.shape)}")):
        cuflash.attention_backward(wrong, q[0], k[0], v[0], out, lse)
    with pytest.raises(ValueError, match=re.escape(f"dlse must have shape {tuple(lse.shape)}; got {(1,) + tuple(lse.shape)}")):
        cuflash.attention_backward(out, q[0], k[0], v[0], out, lse, dlse=np.zeros((1,) + lse.shape, lse.dtype))


def test_two_dimensional_input_says_how_to_reshape():
    q, k, v = make(b=1)
    with pytest.raises(ValueError, match=r"for a single head pass q\[:, None, :\]"):
        cuflash.attention(q[0, :, 0], k[0, :, 0], v[0, :, 0])


@pytest.mark.parametrize("rank", [1, 5])
def test_any_wrong_rank_names_the_unbatched_form(rank):
    """A newcomer's 1-D or 5-D input learns that one unbatched sequence (3-D) is taken too."""
    q, k, v = make(b=1)
    bad = q[0, :, 0, 0] if rank == 1 else q[None]
    with pytest.raises(ValueError, match=r"or 3 \(seqlen, nheads, headdim\) for one unbatched sequence"):
        cuflash.attention(bad, k, v)
    with pytest.raises(ValueError, match=r"must have 4 dimensions \(batch, seqlen, nheads, headdim\); got"):
        cuflash.attention_with_kvcache(bad, k, v, cache_seqlens=np.zeros(1, np.int32))  # takes no unbatched form


class _CpuDLPack:
    """A CPU array known only through DLPack (as a CPU torch tensor or JAX array is)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_cpu_dlpack_inputs_take_the_numpy_path():
    """Fresh-user report (session 6): such inputs were called GPU arrays ("CuPy is not installed")."""
    q, k, v = make()
    out = cuflash.attention(*(_CpuDLPack(x) for x in (q, k, v)), causal=True)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v, causal=True))


class _Bf16CpuArray(_CpuDLPack):
    """A CPU bfloat16 array whose DLPack export NumPy refuses (JAX's: NumPy's DLPack has no
    bfloat16), and which converts through __array__ (to an ml_dtypes array)."""

    def __dlpack__(self, **kwargs):
        raise BufferError("Unsupported dtype in DLTensor")

    def __array__(self, dtype=None, copy=None):
        return self.a.copy()


def test_cpu_bfloat16_arrays_numpy_dlpack_refuses_take_the_numpy_path():
    """Fresh-user report (session 38): a JAX CPU bfloat16 array got "NumPy cannot take [it] through
    DLPack", with no way out named; it now converts through __array__ (a copy), and where the call
    would write into it the message says to pass np.asarray and write back."""
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in make())
    out = cuflash.attention(*(_Bf16CpuArray(x) for x in (q, k, v)))
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v))
    assert out.dtype == ml_dtypes.bfloat16
    from cuflash import _arrays

    with pytest.raises(TypeError, match=r"pass np.asarray\(k_cache\) \(and write back"):
        _arrays.as_array(_Bf16CpuArray(q), "k_cache", written="(the new tokens are appended there)")


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix's own
def test_numpy_subclasses_are_taken_as_plain_arrays():
    """Session 6's hostile inputs: softmax of an np.matrix failed inside np.matrix.max."""
    x = np.random.default_rng(0).standard_normal((3, 5))
    for sub in (np.asmatrix(x), x.view(np.recarray)):
        out = cuflash.softmax(sub)
        assert type(out) is np.ndarray
        np.testing.assert_array_equal(out, cuflash.softmax(x))
    q, k, v = make()
    np.testing.assert_array_equal(cuflash.attention(q.view(np.recarray), k, v), cuflash.attention(q, k, v))


def test_masked_arrays_are_type_errors():
    """Every array argument, not only q, k and v (session 31's hostile inputs: bias, mask and
    seqlens_k took a masked array and dropped its mask)."""
    q, k, v = make()
    with pytest.raises(TypeError, match=r"^k is a masked array"):
        cuflash.attention(q, np.ma.masked_array(k, mask=k > 1), v)
    hidden = np.triu(np.ones((4, 5), bool), 1)
    for name, x in (("bias", np.ma.masked_array(np.zeros((4, 5)), mask=hidden)),
                    ("mask", np.ma.masked_array(np.ones((4, 5), bool), mask=hidden)),
                    ("seqlens_k", np.ma.masked_array(np.array([5, 3], np.int32), mask=[False, True])),
                    ("alibi_slopes", np.ma.masked_array(np.full(4, 0.5), mask=[True, False, False, False])),
                    ("out", np.ma.masked_array(np.zeros(q.shape, q.dtype)))):
        with pytest.raises(TypeError, match=rf"^{name} is a masked array, whose mask cuflash would ignore"):
            cuflash.attention(q, k, v, **{name: x})


@pytest.mark.parametrize(
    "dtypes",
    [(np.float16, np.float32, np.float32), (np.float32, np.float32, np.float64),
     (np.float16, BF16, np.float16)],
)
def test_mixed_dtypes(dtypes):
    q, k, v = make()
    q, k, v = (x.astype(t) for x, t in zip((q, k, v), dtypes))
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype, one of float16, .*; got q \w+, k \w+, v \w+"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.uint16, np.bool_, np.complex64])
def test_unsupported_dtypes(dtype):
    q, k, v = (x.astype(dtype) for x in make())
    with pytest.raises(TypeError, match=r"q has dtype \w+; expected one of float16, bfloat16, float32, float64"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [3, 5])
def test_wrong_rank(which, rank):
    args = dict(zip("qkv", make()))
    x = args[which]
    args[which] = x[0] if rank == 3 else x[None]
    expect = "q is unbatched" if (which, rank) == ("q", 3) else f"{which} must have 4 dimensions"
    with pytest.raises(ValueError, match=rf"^{expect}"):
        cuflash.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["k", "v"])
def test_batch_mismatch(which):
    args = dict(zip("qkv", make(b=2)))
    args[which] = np.concatenate([args[which]] * 2)
    with pytest.raises(ValueError, match=r"q, k, v must share the batch size"):
        cuflash.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("hq, hk", [(33, 2), (3, 2), (4, 3), (1, 2)])
def test_query_heads_not_a_multiple_of_key_heads(hq, hk):
    q, k, v = make(hq=hq, hk=hk)
    with pytest.raises(ValueError, match=rf"k has {hk} heads?; q's {hq} heads? must be a multiple of it .*layout='bhsd'"):
        cuflash.attention(q, k, v)


def test_zero_key_heads_with_query_heads():
    q, k, v = make(hq=2, hk=0)
    with pytest.raises(ValueError, match=r"k has 0 heads"):
        cuflash.attention(q, k, v)


def test_head_dim_mismatch():
    q, _, _ = make(d=8)
    _, k, v = make(d=16, dv=8)
    with pytest.raises(ValueError, match=r"k has head dim 16; it must equal q's head dim 8"):
        cuflash.attention(q, k, v)


def test_value_head_dim_may_differ():
    q, k, v = make(d=8, dv=4)
    assert cuflash.attention(q, k, v).shape == (2, 4, 4, 4)


@pytest.mark.parametrize("axis", [1, 2])
def test_v_must_match_k_seqlen_and_heads(axis):
    q, k, v = make()
    v = np.concatenate([v, v], axis=axis)
    with pytest.raises(ValueError, match=r"v must have k's seqlen and heads"):
        cuflash.attention(q, k, v)


def test_zero_head_dim():
    q, k, v = make(d=0)
    with pytest.raises(ValueError, match=r"head dims must be >= 1"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("layout", ["bsdh", "BSHD", "", None, 0, np.array(["bshd", "bhsd"])])
def test_invalid_layout(layout):
    """Unknown names are ValueErrors, other types TypeErrors (an array gave NumPy's ambiguous-truth error)."""
    q, k, v = make()
    with pytest.raises(ValueError if isinstance(layout, str) else TypeError, match=r"layout must be 'bshd' or 'bhsd'"):
        cuflash.attention(q, k, v, layout=layout)


def test_bhsd_layout_checks_shapes_in_its_own_order():
    q, k, v = (x.swapaxes(1, 2) for x in make(hq=3, hk=2))  # (B, H, S, D)
    with pytest.raises(ValueError, match=r"k has 2 heads; q's 3 heads"):
        cuflash.attention(q, k, v, layout="bhsd")


# --- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window, exc, pattern",
    [
        ((-2, 0), ValueError, r"window_size\[0\] must be >= -1; got -2"),
        ((0, -5), ValueError, r"window_size\[1\] must be >= -1; got -5"),
        ((1,), ValueError, r"window_size must be a pair"),
        ((1, 2, 3), ValueError, r"window_size must be a pair"),
        ("a", TypeError, r"window_size must be a pair"),
        (3, TypeError, r"window_size must be a pair"),
        ((1.5, 0), TypeError, r"window_size\[0\] must be an integer"),
        ((0, "1"), TypeError, r"window_size\[1\] must be an integer"),
        ((True, 0), TypeError, r"window_size\[0\] must be an integer"),
    ],
)
def test_bad_window(window, exc, pattern):
    q, k, v = make()
    with pytest.raises(exc, match=pattern):
        cuflash.attention(q, k, v, window_size=window)


def test_window_none_is_no_window():
    """window_size=None (JAX's local_window_size=None) is (-1, -1) in every function and the oracle."""
    from cuflash import reference

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, s, 2, 16)).astype(np.float32) for s in (9, 13, 13))
    for causal in (False, True):
        out, lse = cuflash.attention(q, k, v, causal=causal, window_size=None, return_lse=True)
        ref_out, ref_lse = cuflash.attention(q, k, v, causal=causal, window_size=(-1, -1), return_lse=True)
        np.testing.assert_array_equal(out, ref_out)
        dout = rng.standard_normal(out.shape).astype(np.float32)
        for a, b in zip(cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window_size=None),
                        cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(reference.attention_ref(q, k, v, causal=causal, window_size=None)[0],
                                      reference.attention_ref(q, k, v, causal=causal)[0])
    cu = np.array([0, 4, 9], np.int32)
    np.testing.assert_array_equal(
        cuflash.attention_varlen(q[0], k[0], v[0], cu, np.array([0, 6, 13], np.int32), window_size=None),
        cuflash.attention_varlen(q[0], k[0], v[0], cu, np.array([0, 6, 13], np.int32)))
    np.testing.assert_array_equal(
        cuflash.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=np.array([5, 13]), window_size=None),
        cuflash.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=np.array([5, 13])))


def test_window_accepts_numpy_integers_and_lists():
    q, k, v = make()
    a = cuflash.attention(q, k, v, window_size=(np.int64(1), np.int32(0)))
    b = cuflash.attention(q, k, v, window_size=[1, 0])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal, exc", [("yes", ValueError), ("bottom-right", ValueError), ("TOP_LEFT", ValueError),
                                         (1, TypeError), (0, TypeError), (None, TypeError), (1.0, TypeError),
                                         ((True,), TypeError)])
def test_bad_causal(causal, exc):
    """An unknown mode is a ValueError; a value that is neither a bool nor a string a TypeError."""
    q, k, v = make()
    with pytest.raises(exc, match=r"causal must be False, True, 'bottom_right' or 'top_left'"):
        cuflash.attention(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [True, False, "bottom_right", "top_left", np.bool_(True)])
def test_good_causal_values(causal):
    q, k, v = make()
    assert cuflash.attention(q, k, v, causal=causal).shape == q.shape


@pytest.mark.parametrize("softcap", [-1.0, -1e-9, -np.inf])
def test_negative_softcap(softcap):
    q, k, v = make()
    with pytest.raises(ValueError, match=r"softcap must be"):
        cuflash.attention(q, k, v, softcap=softcap)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, float("nan")])
def test_non_finite_softmax_scale(value):
    q, k, v = make()
    with pytest.raises(ValueError, match=r"softmax_scale must be finite"):
        cuflash.attention(q, k, v, softmax_scale=value)


def test_nan_softcap():
    q, k, v = make()
    with pytest.raises(ValueError, match=r"softcap must be finite"):
        cuflash.attention(q, k, v, softcap=np.nan)


@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
@pytest.mark.parametrize("value", ["0.5", True, [0.5], 1j])
def test_non_real_scalars(name, value):
    q, k, v = make()
    with pytest.raises(TypeError, match=rf"{name} must be a real number"):
        cuflash.attention(q, k, v, **{name: value})


@pytest.mark.parametrize(
    "slopes, exc, pattern",
    [
        (np.ones(3, np.float32), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\); got \(3,\)"),
        (np.ones((4, 2), np.float32), ValueError, r"alibi_slopes must have shape"),
        (np.ones((1, 4), np.float32), ValueError, r"alibi_slopes must have shape"),
        (np.ones((2, 4, 1), np.float32), ValueError, r"alibi_slopes must have shape"),
        (np.ones(4, np.int32), TypeError, r"alibi_slopes must be a float array; got dtype int32"),
        (np.ones(4, np.bool_), TypeError, r"alibi_slopes must be a float array"),
        ([0.5] * 4, TypeError, r"alibi_slopes must be an array; got list"),
    ],
)
def test_bad_alibi_slopes(slopes, exc, pattern):
    q, k, v = make(b=2, hq=4, hk=2)
    with pytest.raises(exc, match=pattern):
        cuflash.attention(q, k, v, alibi_slopes=slopes)


def test_alibi_slopes_range_follows_the_dtype_they_are_used_in():
    """float64 inputs use the slopes as float64 (both paths): slopes past float32's range are
    theirs to use; the other dtypes keep float32's range (session 31's hostile inputs)."""
    q, k, v = make(b=2, hq=4, hk=2, dtype=np.float64)
    big = np.full(4, 1e39)
    out = cuflash.attention(q, k, v, alibi_slopes=big)
    ref, _ = attention_ref(q, k, v, alibi_slopes=big)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"alibi_slopes must be finite within float64's range"):
        cuflash.attention(q, k, v, alibi_slopes=np.array([np.inf, 1, 1, 1]))
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"alibi_slopes must be finite within float32's range \(they are used as float32\)"):
        cuflash.attention(q32, k32, v32, alibi_slopes=big)
    with pytest.raises(ValueError, match=r"must stay within float32's range"):
        cuflash.attention(q32, k32, v32, alibi_slopes=np.full(4, 1e38))  # (times the distance 4)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_alibi_slopes_in_any_float_dtype(dtype):
    q, k, v = make(b=2, hq=4, hk=2)
    out = cuflash.attention(q, k, v, alibi_slopes=np.full(4, 0.25, dtype=dtype))
    assert out.shape == q.shape


@pytest.mark.parametrize(
    "seqlens, exc, pattern",
    [
        (np.array([3.0, 4.0]), TypeError, r"seqlens_k must have dtype int32 or int64; got float64"),
        (np.array([3, 4], np.int16), TypeError, r"seqlens_k must have dtype int32 or int64; got int16"),
        (np.array([3, 4], np.uint32), TypeError, r"seqlens_k must have dtype int32 or int64"),
        ({3, 4}, TypeError, r"seqlens_k must be an integer array \(or a list of ints\); got set"),
        ([3.0, 4.0], TypeError, r"seqlens_k must have dtype int32 or int64; got float64"),
        (np.array([3], np.int32), ValueError, r"seqlens_k must have length 2; got 1"),
        (np.array([3, 4, 5], np.int64), ValueError, r"seqlens_k must have length 2; got 3"),
        (np.array([[3, 4]], np.int32), ValueError, r"seqlens_k must have 1 dimension"),
        (np.array([3, 6], np.int32), ValueError, r"seqlens_k values must lie in \[0, 5\]"),
        (np.array([-1, 4], np.int64), ValueError, r"seqlens_k values must lie in \[0, 5\]"),
    ],
)
def test_bad_seqlens_k(seqlens, exc, pattern):
    q, k, v = make(b=2, sk=5)
    with pytest.raises(exc, match=pattern):
        cuflash.attention(q, k, v, seqlens_k=seqlens)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_seqlens_k_accepts_int32_and_int64(dtype):
    q, k, v = make(b=2, sk=5)
    out = cuflash.attention(q, k, v, seqlens_k=np.array([5, 2], dtype=dtype))
    assert out.shape == q.shape


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_out_wrong_shape(layout):
    q, k, v = make(b=2, sq=4, hq=4, hk=2, d=8, dv=6)
    if layout == "bhsd":
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    good = (2, 4, 4, 6)
    bad = np.empty((2, 4, 4, 8), np.float32)
    with pytest.raises(ValueError, match=rf"out must have shape \({', '.join(map(str, good))}\); got \(2, 4, 4, 8\)"):
        cuflash.attention(q, k, v, out=bad, layout=layout)


def test_out_wrong_dtype():
    q, k, v = make()
    with pytest.raises(TypeError, match=r"out must have dtype float32; got float16"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, np.float16))


def test_out_not_an_array():
    q, k, v = make()
    with pytest.raises(TypeError, match=r"out must be a NumPy or CuPy array; got list"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, np.float32).tolist())


def test_out_is_filled_and_returned():
    q, k, v = make()
    out = np.full(q.shape, np.nan, np.float32)
    res = cuflash.attention(q, k, v, out=out)
    assert res is out
    assert np.isfinite(out).all()


# --- backward ---------------------------------------------------------------------------------


def _forward_like(q, v):
    out = np.zeros(q.shape[:3] + (v.shape[3],), q.dtype)
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    return out, lse


@pytest.mark.parametrize("name", ["dout", "out"])
def test_backward_checks_dout_and_out(name):
    q, k, v = make()
    out, lse = _forward_like(q, v)
    args = dict(dout=out.copy(), out=out)
    args[name] = args[name][:, :-1]
    with pytest.raises(ValueError, match=rf"{name} must have shape"):
        cuflash.attention_backward(args["dout"], q, k, v, args["out"], lse)
    args[name] = out.astype(np.float64)
    with pytest.raises(TypeError, match=rf"{name} must have dtype float32"):
        cuflash.attention_backward(args["dout"], q, k, v, args["out"], lse)


def test_backward_checks_lse():
    q, k, v = make()
    out, lse = _forward_like(q, v)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 4, 4\)"):
        cuflash.attention_backward(out, q, k, v, out, lse.swapaxes(1, 2)[:, :, :3])
    with pytest.raises(TypeError, match=r"lse must have dtype float32; got float64"):
        cuflash.attention_backward(out, q, k, v, out, lse.astype(np.float64))


def test_backward_checks_preallocated_gradients():
    q, k, v = make()
    out, lse = _forward_like(q, v)
    with pytest.raises(ValueError, match=r"dk must have shape"):
        cuflash.attention_backward(out, q, k, v, out, lse, dk=np.empty(q.shape, q.dtype))
    with pytest.raises(TypeError, match=r"dv must have dtype float32"):
        cuflash.attention_backward(out, q, k, v, out, lse, dv=np.empty(v.shape, np.float16))


def test_backward_checks_deterministic_and_options():
    q, k, v = make()
    out, lse = _forward_like(q, v)
    with pytest.raises(TypeError, match=r"deterministic must be a bool"):
        cuflash.attention_backward(out, q, k, v, out, lse, deterministic="yes")
    with pytest.raises(ValueError, match=r"causal must be"):
        cuflash.attention_backward(out, q, k, v, out, lse, causal="yes")
    with pytest.raises(TypeError, match=r"dout must have dtype float32; got float64"):
        cuflash.attention_backward(out.tolist(), q, k, v, out, lse)  # a list is taken as float64


@pytest.mark.parametrize("bad", ["return_lse", "out"])
def test_vjp_rejects_forward_only_options(bad):
    q, k, v = make()
    with pytest.raises(TypeError, match=bad):
        cuflash.attention_vjp(q, k, v, **{bad: None})


# --- varlen -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cu_q, cu_k, exc, pattern",
    [
        ([0, 5, 3], CU_K, ValueError, r"cu_seqlens_q must be non-decreasing"),
        (CU_Q, [0, 6, 4], ValueError, r"cu_seqlens_k must be non-decreasing"),
        ([1, 3, 7], CU_K, ValueError, r"cu_seqlens_q must start at 0; got 1"),
        (CU_Q, [2, 4, 9], ValueError, r"cu_seqlens_k must start at 0; got 2"),
        ([0, 3, 8], CU_K, ValueError, r"cu_seqlens_q\[-1\] = 8 exceeds the 7 packed tokens"),
        (CU_Q, [0, 4, 10], ValueError, r"cu_seqlens_k\[-1\] = 10 exceeds the 9 packed tokens"),
        ([0, 3, 7], [0, 9], ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
        ([], [], ValueError, r"cu_seqlens_q must have at least one entry"),
    ],
)
def test_bad_cu_seqlens_values(cu_q, cu_k, exc, pattern):
    q, k, v = make_packed()
    with pytest.raises(exc, match=pattern):
        cuflash.attention_varlen(q, k, v, np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_offsets_that_wrap_around_are_refused(dtype):
    """Offsets whose differences overflow the index dtype (2**31 - 1, then -2**31) are refused
    before anything runs (np.diff of them wraps to a positive step; the call then hung)."""
    q, k, v = make_packed()
    big = np.iinfo(dtype).max
    cu = np.array([0, big, -big - 1], dtype)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing; entry 2 = -\d+ is below entry 1"):
        cuflash.attention_varlen(q, k, v, cu, np.asarray(CU_K, dtype))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        cuflash.attention_varlen_backward(q, q, k, v, np.zeros_like(q), np.zeros((q.shape[1], q.shape[0]), np.float32),
                                          cu, np.asarray(CU_K, dtype))


def test_packed_head_count_error_names_the_packed_axis():
    q, k, v = make_packed()
    with pytest.raises(ValueError, match=r"multiple of it \(axis 1 of packed \(total_tokens, nheads, headdim\)\)$"):
        cuflash.attention_varlen(np.concatenate([q, q[:, :1]], axis=1), k, v, CU_Q, CU_K)


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_bad_cu_seqlens_types(which):
    q, k, v = make_packed()
    args = {"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K}
    args[which] = args[which].astype(np.float32)
    with pytest.raises(TypeError, match=rf"{which} must have dtype int32 or int64; got float32"):
        cuflash.attention_varlen(q, k, v, **args)
    args[which] = "0 3 7"
    with pytest.raises(TypeError, match=rf"{which} must be an integer array \(or a list of ints\); got str"):
        cuflash.attention_varlen(q, k, v, **args)
    args[which] = [0.0, 3.0, 7.0]
    with pytest.raises(TypeError, match=rf"{which} must have dtype int32 or int64; got float64"):
        cuflash.attention_varlen(q, k, v, **args)
    args[which] = np.array([[0, 3, 7]], np.int32)
    with pytest.raises(ValueError, match=rf"{which} must have 1 dimension"):
        cuflash.attention_varlen(q, k, v, **args)


def test_cuflash_debug_is_read_at_every_call(monkeypatch):
    """CUFLASH_DEBUG is read from the environment at each call (setting it in a running process
    takes effect at the next call; "" and "0" mean off), and NumPy index values are checked on the
    host at the call whatever it says (GPU values: tests/test_gpu_index_safety.py)."""
    from cuflash import _validate

    q, k, v = make_packed()
    for value, on in (("1", True), ("0", False), ("", False), ("yes", True), (None, False)):
        if value is None:
            monkeypatch.delenv("CUFLASH_DEBUG", raising=False)
        else:
            monkeypatch.setenv("CUFLASH_DEBUG", value)
        assert _validate.debug_checks_enabled() is on, value
        with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
            cuflash.attention_varlen(q, k, v, np.array([0, 5, 3], np.int32), CU_K, max_seqlen_q=5, max_seqlen_k=5)


def test_varlen_max_seqlen_checks():
    q, k, v = make_packed()
    with pytest.raises(ValueError, match=r"max_seqlen_q = 3 is smaller than the longest sequence 4"):
        cuflash.attention_varlen(q, k, v, CU_Q, CU_K, max_seqlen_q=3)
    with pytest.raises(ValueError, match=r"max_seqlen_k must be >= 0"):
        cuflash.attention_varlen(q, k, v, CU_Q, CU_K, max_seqlen_k=-1)
    with pytest.raises(TypeError, match=r"max_seqlen_k must be an integer"):
        cuflash.attention_varlen(q, k, v, CU_Q, CU_K, max_seqlen_k=5.0)


def test_varlen_shapes():
    q, k, v = make_packed(hq=3, hk=2)
    with pytest.raises(ValueError, match=r"k has 2 heads; q's 3 heads must be a multiple of it"):
        cuflash.attention_varlen(q, k, v, CU_Q, CU_K)
    q, k, v = make_packed()
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total_tokens, nheads, headdim\)"):
        cuflash.attention_varlen(q[None], k, v, CU_Q, CU_K)
    with pytest.raises(ValueError, match=r"v must have k's tokens and heads"):
        cuflash.attention_varlen(q, k, v[:-1], CU_Q, CU_K)
    with pytest.raises(ValueError, match=r"k has head dim 4; it must equal q's head dim 8"):
        cuflash.attention_varlen(q, k[..., :4], v, CU_Q, CU_K)
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        cuflash.attention_varlen(q, k.astype(np.float16), v, CU_Q, CU_K)
    with pytest.raises(ValueError, match=r"out must have shape \(7, 4, 8\)"):
        cuflash.attention_varlen(q, k, v, CU_Q, CU_K, out=np.empty((7, 4, 4), np.float32))


# --- merge_states -----------------------------------------------------------------------------


def _state(shape=(2, 3, 4, 8), dtype=np.float32):
    rng = np.random.default_rng(1)
    b, s, h, _ = shape
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal((b, h, s)).astype(np.float32)


def test_merge_states_mismatched_output_shapes():
    oa, la = _state((2, 3, 4, 8))
    ob, lb = _state((2, 3, 4, 6))
    with pytest.raises(ValueError, match=r"part 1: output shape \(2, 3, 4, 6\) differs from \(2, 3, 4, 8\)"):
        cuflash.merge_states(oa, la, ob, lb)


def test_merge_states_mismatched_lse_shape():
    oa, la = _state()
    ob, lb = _state()
    with pytest.raises(ValueError, match=r"part 1: lse must have shape \(2, 4, 3\); got \(2, 3, 4\)"):
        cuflash.merge_states(oa, la, ob, lb.swapaxes(1, 2))


def test_merge_states_argument_errors():
    oa, la = _state()
    with pytest.raises(ValueError, match=r"merge_states takes"):
        cuflash.merge_states(oa, la, oa)
    with pytest.raises(TypeError, match=r"out_b must be a NumPy or CuPy array.*; got str"):
        cuflash.merge_states(oa, la, "oa", la)
    with pytest.raises(TypeError, match=r"part 1: outputs and LSEs must be floating point"):
        cuflash.merge_states(oa, la, oa.astype(np.int32), la)
    with pytest.raises(TypeError, match=r"part 1: output dtype float16 differs from float32"):
        cuflash.merge_states(oa, la, oa.astype(np.float16), la)
    with pytest.raises(ValueError, match=r"outs and lses must be stacked"):
        cuflash.merge_states(np.stack([oa, oa]), np.stack([la, la, la]))
    with pytest.raises(ValueError, match=r"layout must be"):
        cuflash.merge_states(oa, la, oa, la, layout="sbhd")


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_merge_states_accepts_every_float_dtype(dtype):
    oa, la = _state(dtype=dtype)
    ob, lb = _state(dtype=dtype)
    out, lse = cuflash.merge_states(oa, la, ob, lb)
    assert out.dtype == np.dtype(dtype) and out.shape == oa.shape
    assert lse.shape == la.shape


# --- softmax ----------------------------------------------------------------------------------


def test_softmax_errors():
    with pytest.raises(TypeError, match=r"x must be a NumPy or CuPy array"):
        cuflash.softmax({1.0, 2.0})
    with pytest.raises(ValueError, match=r"x must have at least one dimension"):
        cuflash.softmax(3.0)
    assert np.allclose(cuflash.softmax([0.0, np.log(3.0)]), [0.25, 0.75])  # array-likes as in NumPy
    with pytest.raises(TypeError, match=r"x must be a float array \(float16, bfloat16, float32 or float64\); got dtype int64 \(cast it"):
        cuflash.softmax(np.arange(3))
    with pytest.raises(np.exceptions.AxisError if hasattr(np, "exceptions") else np.AxisError):
        cuflash.softmax(np.ones((2, 3)), axis=2)


# --- empty problems ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(
    "b, sq, sk, hq, hk",
    [(0, 4, 5, 4, 2), (2, 0, 5, 4, 2), (2, 4, 0, 4, 2), (2, 4, 5, 0, 0), (0, 0, 0, 4, 2)],
)
def test_empty_problems(layout, b, sq, sk, hq, hk):
    q, k, v = make(b=b, sq=sq, sk=sk, hq=hq, hk=hk, d=8, dv=6)
    if layout == "bhsd":
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    out, lse = cuflash.attention(q, k, v, return_lse=True, layout=layout)
    expected = (b, sq, hq, 6) if layout == "bshd" else (b, hq, sq, 6)
    assert out.shape == expected and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32
    assert (out == 0).all()  # Sk = 0: every row is empty
    assert np.isneginf(lse).all()


def test_empty_keys_overwrite_a_poisoned_out():
    q, k, v = make(sk=0)
    out = np.full(q.shape, np.nan, np.float32)
    res, lse = cuflash.attention(q, k, v, out=out, return_lse=True, causal=True)
    assert res is out and (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float64])
def test_empty_keys_in_other_dtypes(dtype):
    q, k, v = make(sk=0, dtype=dtype)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.dtype == np.dtype(dtype) and (out.astype(np.float32) == 0).all()
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert np.isneginf(lse).all()


@pytest.mark.parametrize("b, sq, sk", [(0, 4, 5), (2, 0, 5), (2, 4, 0)])
def test_empty_backward(b, sq, sk):
    q, k, v = make(b=b, sq=sq, sk=sk)
    out = np.zeros(q.shape, np.float32)
    lse = np.full((b, 4, sq), -np.inf, np.float32)
    dq, dk, dv = cuflash.attention_backward(out, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for g in (dq, dk, dv):
        assert (g == 0).all()


def test_empty_varlen():
    q, k, v = make_packed(total_q=5, total_k=0)
    out, lse = cuflash.attention_varlen(
        q, k, v, np.array([0, 2, 5], np.int64), np.array([0, 0, 0], np.int64), return_lse=True
    )
    assert out.shape == (5, 4, 8) and (out == 0).all()
    assert lse.shape == (4, 5) and np.isneginf(lse).all()
    # No sequences at all.
    out, lse = cuflash.attention_varlen(
        q, k, v, np.array([0], np.int32), np.array([0], np.int32), return_lse=True
    )
    assert out.shape == (5, 4, 8) and (out == 0).all() and np.isneginf(lse).all()


def test_empty_softmax():
    x = np.ones((0, 3), np.float32)
    assert cuflash.softmax(x).shape == (0, 3)


def test_alibi_slopes_times_distance_must_fit_float32():
    """Hostile pass 3: finite slopes of 2e38 overflowed slope x distance and emptied a row."""
    q, k, v = make()
    with pytest.raises(ValueError, match=r"alibi_slopes times the largest query-key distance"):
        cuflash.attention(q, k, v, alibi_slopes=np.full(q.shape[2], 2e38, np.float32))
    # The bound is the largest |i + offset - j|, max(Sq, Sk) - 1: one query and one key is distance 0.
    one = tuple(x[:, :1] for x in (q, k, v))
    np.testing.assert_array_equal(cuflash.attention(*one, alibi_slopes=np.full(q.shape[2], 3e38, np.float32)),
                                  cuflash.attention(*one))


@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_huge_integer_scalars_are_value_errors(name):
    """Hostile pass 3: 10**400 raised OverflowError from float()."""
    q, k, v = make()
    with pytest.raises(ValueError, match=rf"^{name} must be finite"):
        cuflash.attention(q, k, v, **{name: 10**400})


def test_tiny_softcap_with_large_scores_warns_nothing():
    """Hostile pass 3: s / softcap overflowed to inf (the right tanh) with a RuntimeWarning."""
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((1, 4, 1, 8)) * 3e4).clip(-6e4, 6e4).astype(np.float16)
    k = (rng.standard_normal((1, 6, 1, 8)) * 3e4).clip(-6e4, 6e4).astype(np.float16)
    v = rng.standard_normal((1, 6, 1, 8)).astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cuflash.attention(q, k, v, softcap=1e-30, return_lse=True)
        cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, softcap=1e-30)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_softmax_scale_range_follows_the_score_dtype():
    """Issue 20: float64 inputs form their scores in float64, so 1e300 is a valid scale there;
    float32 inputs keep float32's range; a float32 row whose scores overflow is NaN (out and LSE,
    as on the GPU and as the docstring says), with no NumPy warning."""
    import warnings

    q, k, v = make()
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out, lse = cuflash.attention(q64 * 1e-300, k64, v64, softmax_scale=1e300, return_lse=True)
    ref, ref_lse = cuflash.attention(q64, k64, v64, softmax_scale=1.0, return_lse=True)
    assert np.allclose(out, ref) and np.allclose(lse, ref_lse)
    with pytest.raises(ValueError, match=r"softmax_scale must lie within float32's range .* float32 inputs"):
        cuflash.attention(q, k, v, softmax_scale=1e39)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning from NumPy would fail here
        out, lse = cuflash.attention(np.full_like(q, 4.0), np.full_like(k, 4.0), v, softmax_scale=3e38, return_lse=True)
    assert np.isnan(out).all() and np.isnan(lse).all()


def test_unbatched_buffers_that_are_not_arrays_are_named():
    q, k, v = make(b=1)
    with pytest.raises(TypeError, match="out must be a NumPy or CuPy array; got list"):
        cuflash.attention(q[0], k[0], v[0], out=[1.0])
    out, lse = cuflash.attention(q[0], k[0], v[0], return_lse=True)
    with pytest.raises(TypeError, match="dq must be a NumPy or CuPy array; got int"):
        cuflash.attention_backward(out, q[0], k[0], v[0], out, lse, dq=3)


def test_a_non_array_names_what_is_accepted():
    """A string is refused with the kinds that are taken, array-likes included (they work on the CPU path)."""
    import cuflash

    q = np.zeros((1, 4, 1, 8), dtype=np.float32)
    with pytest.raises(TypeError, match=r"q must be a NumPy or CuPy array, a DLPack GPU array, or a list, tuple or number"):
        cuflash.attention("not an array", q, q)


def test_index_lists_are_taken_as_integer_arrays():
    """cu_seqlens and seqlens_k given as lists of Python ints run as the int64 arrays of those values
    (as q, k, v and cache_seqlens take lists)."""
    q, k, v = make_packed()
    want = cuflash.attention_varlen(q, k, v, CU_Q, CU_K)
    got = cuflash.attention_varlen(q, k, v, [0, 3, 7], (0, 4, 9))
    np.testing.assert_array_equal(got, want)
    qb, kb, vb = make()
    np.testing.assert_array_equal(cuflash.attention(qb, kb, vb, seqlens_k=[5, 2]),
                                  cuflash.attention(qb, kb, vb, seqlens_k=np.array([5, 2], np.int64)))


@pytest.mark.parametrize("cu, pattern", [
    ([[0, 3], [7]], r"cu_seqlens_q must be an integer array \(or a list of ints\); got a ragged list"),
    ([0, 3, None], r"cu_seqlens_q must be an integer array .*got a list of \['NoneType', 'int'\]"),
    ([0, 3, 2**70], r"cu_seqlens_q must be an integer array \(or a list of ints, each within int64\)"),
    ([0, 3, 2**63], r"cu_seqlens_q must be an integer array \(or a list of ints, each within int64\)"),  # (NumPy: float64)
    ([0, 3, 2**64], r"cu_seqlens_q must be an integer array \(or a list of ints, each within int64\)"),
    ([0, 1.5, 3], r"cu_seqlens_q must have dtype int32 or int64; got float64"),
    ([True, False, True], r"cu_seqlens_q must have dtype int32 or int64; got bool"),
])
def test_bad_index_lists(cu, pattern):
    q, k, v = make_packed()
    with pytest.raises(TypeError, match=pattern):
        cuflash.attention_varlen(q, k, v, cu, CU_K)


def test_first_contact_messages_say_what_to_do():
    """Session 31's new-user walk-through: a (batch, Sk) key-padding mask, a missing lse, and the
    GPU-only error class importable from the package."""
    q, k, v = make()
    valid = np.ones((q.shape[0], k.shape[1]), bool)
    with pytest.raises(ValueError, match=re.escape("a (batch, seqlen_k) key-padding mask goes in as mask[:, None, None, :]")):
        cuflash.attention(q, k, v, mask=valid)
    out = cuflash.attention(q, k, v, mask=valid[:, None, None, :])
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v))
    with pytest.raises(TypeError, match=r"^lse is None: .* return_lse=True"):
        cuflash.attention_backward(out, q, k, v, out, None)
    from cuflash import _gpu

    assert cuflash.NotAvailableOnGPU is _gpu.NotAvailableOnGPU and issubclass(cuflash.NotAvailableOnGPU, TypeError)
    assert "NotAvailableOnGPU" in cuflash.__all__


def test_kvcache_heads_message_names_q_too():
    """Fresh-user report (session 38): q passed in (batch, nheads, seqlen, headdim) order to
    attention_with_kvcache got "k_cache has 4 heads; q's 1 heads ..., a k_cache in ... order needs
    .swapaxes(1, 2)": the cache was right, q was not.  The hint now names both, and "1 head"."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)  # (batch, seqlen 1, nheads 4, headdim)
    kc = rng.standard_normal((2, 6, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"k_cache has 4 heads; q's 1 head must .* for q and .* \.swapaxes\(1, 2\)"):
        cuflash.attention_with_kvcache(q.transpose(0, 2, 1, 3), kc, kc, cache_seqlens=[3, 3])
