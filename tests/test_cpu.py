"""The tiled algorithm (cuflash._cpu, run by the public API for NumPy inputs) against the oracle.

Every comparison uses the exactness rule of docs/conventions.md through ``reference.assert_exact``,
on outputs poisoned with NaN first.  The helpers at the top take an array module ``xp`` so
that test_public_cases.py runs the same checks on the GPU.

Backward inputs are drawn at unit scale; forward tests also scale by x5.  The FlashAttention
backward (our GPU kernels) computes D = rowsum(dO ∘ O) from the output *rounded to the input
dtype*, and then dP − D in fp32.  Where rows are nearly one-hot (inputs x5, few visible keys,
tiny problems) that rounding alone can exceed 2x the naive error, because the naive gradient
dS = P ∘ (dP − rowsum(P ∘ dP)) is exactly 0 where P rounds to one-hot.  The NumPy path
recomputes the LSE and D = rowsum(P ∘ dP) from its own tiles at its accumulation precision and
stays within the rule there too (test_backward_exact_on_short_rows, test_hypothesis_shapes).
On the GPU (H200) that test's problems break the rule in 0–12 of 60 per head dim (4, 64, 128),
dtype and mask, by up to 2.9x the bound, on dq and dk and, from P rounded before dV = Pᵀ dO, on
dv too: documented in attention_backward's docstring (scripts/backward_rounding_model.py models
it), not a GPU test.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _arrays, _cpu
from cuflash import _validate as V
from cuflash import reference as R

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
DTYPE_IDS = ["fp16", "bf16", "fp32", "fp64"]

# ---------------------------------------------------------------------------------------------
# Helpers shared with test_public_cases.py
# ---------------------------------------------------------------------------------------------


def rand(rng, shape, dtype, scale=1.0):
    """Standard normal values times ``scale``, rounded to dtype (never zeros)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def lse_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def nan_like(xp, shape, dtype):
    return xp.full(shape, np.nan, dtype=dtype)


def check_forward(xp, q, k, v, *, layout="bshd", **opts):
    """cuflash.attention on xp copies of the NumPy inputs, into a NaN-poisoned ``out``.

    Checks out and lse against the oracle with the exactness rule; returns them as NumPy.
    """
    out_shape = q.shape[:3] + v.shape[3:]
    buf = nan_like(xp, out_shape, q.dtype)
    out, lse = cuflash.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), out=buf,
                                 return_lse=True, layout=layout, **opts)
    assert out is buf
    out, lse = _arrays.to_numpy(out), _arrays.to_numpy(lse)
    assert lse.dtype == lse_dtype(q.dtype)
    ref, ref_lse = R.attention_ref(q, k, v, layout=layout, **opts)
    naive, naive_lse = R.naive_attention(q, k, v, layout=layout, return_lse=True, **opts)
    R.assert_exact(out, ref, naive, "out")
    R.assert_exact(lse, ref_lse, naive_lse, "lse")
    return out, lse


def check_backward(xp, q, k, v, dout=None, *, layout="bshd", rng=None, deterministic=False, **opts):
    """Forward then cuflash.attention_backward into NaN-poisoned dq, dk, dv; the rule for each.

    ``dout`` defaults to standard normal values.  Returns (dq, dk, dv) as NumPy arrays.
    """
    qd, kd, vd = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, layout=layout, **opts)
    if dout is None:
        dout = rand(rng or np.random.default_rng(0), tuple(out.shape), q.dtype)
    bufs = [nan_like(xp, x.shape, x.dtype) for x in (q, k, v)]
    grads = cuflash.attention_backward(xp.asarray(dout), qd, kd, vd, out, lse, layout=layout,
                                       dq=bufs[0], dk=bufs[1], dv=bufs[2], deterministic=deterministic, **opts)
    assert all(g is b for g, b in zip(grads, bufs))
    grads = [_arrays.to_numpy(g) for g in grads]
    refs = R.attention_backward_ref(dout, q, k, v, layout=layout, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, layout=layout, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(g, r, n, name)
    return grads


def make_qkv(rng, dtype, batch, sq, sk, hq, hkv, d, dv=None, scale=1.0):
    q = rand(rng, (batch, sq, hq, d), dtype, scale)
    k = rand(rng, (batch, sk, hkv, d), dtype, scale)
    v = rand(rng, (batch, sk, hkv, d if dv is None else dv), dtype, scale)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Sizes, head dims and dtypes
# ---------------------------------------------------------------------------------------------

SIZES = [(1, 1), (1, 129), (7, 63), (63, 65), (65, 7), (129, 129), (65, 130)]
HEADDIMS = [16, 33, 64, 7, 40, 32, 1]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{a}x{b}" for a, b in SIZES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_sizes(rng, dtype, size, causal):
    sq, sk = size
    d = HEADDIMS[SIZES.index(size)]
    scale = 5.0 if (sq + sk + causal) % 2 else 1.0  # x5 on about half of the cases
    q, k, v = make_qkv(rng, dtype, 2, sq, sk, 4, 2, d, dv=24, scale=scale)
    check_forward(np, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{a}x{b}" for a, b in SIZES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_sizes(rng, dtype, size, causal):
    sq, sk = size
    d = HEADDIMS[SIZES.index(size)]
    q, k, v = make_qkv(rng, dtype, 2, sq, sk, 6, 2, d, dv=24)
    check_backward(np, q, k, v, rng=rng, causal=causal)


@pytest.mark.parametrize("opts", [{}, dict(causal=True), dict(window_size=(1, 0))], ids=["full", "causal", "window"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_backward_exact_on_short_rows(dtype, opts):
    """16-bit inputs, rows of 1-9 keys, head dim 4: with D formed from the rounded output, 2-16 %
    of such problems broke the rule on dq or dk (hostile run, session 5); all 60 must pass."""
    rng = np.random.default_rng(5)
    for _ in range(60):
        q, k, v = make_qkv(rng, dtype, 1, 4, int(rng.integers(2, 10)), 2, 2, 4)
        check_backward(np, q, k, v, rng=rng, **opts)


def test_long_sequence_1000(rng):
    q, k, v = make_qkv(rng, np.float16, 1, 1000, 1000, 2, 1, 64)
    check_forward(np, q, k, v, causal=True)
    check_backward(np, q, k, v, rng=rng, causal=True)


# ---------------------------------------------------------------------------------------------
# Every option, forward and backward, each dtype
# ---------------------------------------------------------------------------------------------

SLOPES_H = np.array([2.0 ** (-8 * (h + 1) / 4) for h in range(4)], dtype=np.float32)
OPTIONS = {
    "top_left": dict(causal="top_left"),
    "bottom_right": dict(causal="bottom_right"),
    "win00": dict(window_size=(0, 0)),
    "win10": dict(window_size=(1, 0)),
    "win01": dict(window_size=(0, 1)),
    "win31_0": dict(window_size=(31, 0)),
    "win_left": dict(window_size=(20, -1)),
    "win_right": dict(window_size=(-1, 20)),
    "win_causal": dict(window_size=(40, 7), causal=True),
    "win_top_left": dict(window_size=(40, 7), causal="top_left"),
    "softcap50": dict(softcap=50.0),
    "softcap0.5_causal": dict(softcap=0.5, causal=True),
    "alibi_h": dict(alibi_slopes=SLOPES_H),
    "alibi_bh_causal": dict(alibi_slopes=np.stack([SLOPES_H, SLOPES_H[::-1]]), causal=True),
    "seqlens_k": dict(seqlens_k=np.array([100, 3], dtype=np.int32)),
    "seqlens_k_causal_win": dict(seqlens_k=np.array([0, 77]), causal=True, window_size=(10, -1)),
    "scale0": dict(softmax_scale=0.0),
    "scale_big": dict(softmax_scale=0.5),
    "everything": dict(causal=True, window_size=(50, 3), softcap=3.0, alibi_slopes=SLOPES_H,
                       seqlens_k=np.array([129, 60]), softmax_scale=0.2),
}


@pytest.mark.parametrize("shape", [(65, 129), (129, 65)], ids=["65x129", "129x65"])
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_options_forward_backward(rng, dtype, name, shape):
    opts = dict(OPTIONS[name])
    sq, sk = shape
    if "seqlens_k" in opts:
        opts["seqlens_k"] = np.minimum(opts["seqlens_k"], sk)
    q, k, v = make_qkv(rng, dtype, 2, sq, sk, 4, 2, 32, dv=16)
    check_forward(np, q * dtype(5), k, v, **opts)  # x5 on q: larger scores, errors show
    check_backward(np, q, k, v, rng=rng, **opts)


# ---------------------------------------------------------------------------------------------
# Layouts and strides
# ---------------------------------------------------------------------------------------------


def test_layout_bhsd_and_out_buffer(rng):
    q, k, v = make_qkv(rng, np.float16, 2, 37, 70, 4, 2, 32, dv=8)
    t = lambda x: np.ascontiguousarray(x.swapaxes(1, 2))  # noqa: E731
    out, lse = check_forward(np, t(q), t(k), t(v), layout="bhsd", causal=True)
    assert out.shape == (2, 4, 37, 8)
    base_out, base_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, t(base_out))  # same tiles, same numbers
    np.testing.assert_array_equal(lse, base_lse)
    grads = check_backward(np, t(q), t(k), t(v), layout="bhsd", rng=rng, causal=True)
    assert [g.shape for g in grads] == [(2, 4, 37, 32), (2, 2, 70, 32), (2, 2, 70, 8)]


def test_strided_packed_qkv(rng):
    qkv = rand(rng, (2, 77, 3, 4, 32), ml_dtypes.bfloat16)  # packed: q, k, v interleaved
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    check_forward(np, q, k, v, causal=True)
    # dout with zero strides (a broadcast), and a non-contiguous last axis on k
    dout = np.broadcast_to(rand(rng, (1, 1, 4, 32), ml_dtypes.bfloat16), (2, 77, 4, 32))
    k_t = np.ascontiguousarray(k.swapaxes(2, 3)).swapaxes(2, 3)  # last-axis stride != itemsize
    assert k_t.strides[-1] != k_t.itemsize
    check_backward(np, q, k_t, v, dout, causal=True)


def test_out_buffer_is_a_strided_view(rng):
    q, k, v = make_qkv(rng, np.float32, 1, 20, 30, 2, 2, 16)
    big = np.full((1, 20, 2, 40), np.nan, dtype=np.float32)
    view = big[..., ::2][..., :16]  # every other element
    cuflash.attention(q, k, v, out=view)
    ref, _ = R.attention_ref(q, k, v)
    R.assert_exact(view, ref, R.naive_attention(q, k, v), "out view")
    assert np.isnan(big[..., 1::2]).all()  # nothing written outside the view


# ---------------------------------------------------------------------------------------------
# The tiles themselves: small blocks, skipped blocks, repeatability
# ---------------------------------------------------------------------------------------------


def _problem(q, k, v, **opts):
    return V.make_problem(q, k, v, **opts)


@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(4, 2)),
                                  dict(causal="top_left", softcap=2.0, seqlens_k=np.array([9, 30]))],
                         ids=["full", "causal", "window", "mixed"])
def test_small_tiles_direct(rng, opts):
    """_cpu.forward/backward called directly with odd tile sizes, into NaN-filled buffers."""
    q, k, v = make_qkv(rng, np.float32, 2, 23, 30, 6, 3, 8, dv=5)
    p = _problem(q, k, v, **opts)
    out = np.full((2, 23, 6, 5), np.nan, np.float32)
    lse = np.full((2, 6, 23), np.nan, np.float32)
    _cpu.forward(p, q, k, v, out, lse, block_m=3, block_n=5)
    ref, ref_lse = R.attention_ref(q, k, v, **opts)
    naive, naive_lse = R.naive_attention(q, k, v, return_lse=True, **opts)
    R.assert_exact(out, ref, naive, "out")
    R.assert_exact(lse, ref_lse, naive_lse, "lse")
    dout = rand(rng, out.shape, np.float32)
    grads = [np.full(x.shape, np.nan, np.float32) for x in (q, k, v)]
    _cpu.backward(p, dout, q, k, v, out, lse, *grads, block_m=4, block_n=7)
    refs = R.attention_backward_ref(dout, q, k, v, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(g, r, n, name)


def test_blocks_outside_the_band_are_skipped(rng, monkeypatch):
    q, k, v = make_qkv(rng, np.float32, 1, 256, 256, 1, 1, 16)
    tiles = []
    real = _cpu._score_tile

    def counting(p, band, slopes, q_t, k_t, i0, i1, j0, j1, mods=None):
        tiles.append((i0, j0))
        return real(p, band, slopes, q_t, k_t, i0, i1, j0, j1, mods)

    monkeypatch.setattr(_cpu, "_score_tile", counting)
    out, lse = cuflash.attention(q, k, v, window_size=(3, 3), return_lse=True)
    band = [(0, 0), (0, 64), (64, 0), (64, 64), (64, 128), (128, 64), (128, 128), (128, 192), (192, 128), (192, 192)]
    assert sorted(tiles) == band  # a band 7 wide: 10 of 16 tiles
    tiles.clear()
    cuflash.attention(q, k, v, causal=True)
    assert len(tiles) == 10 and all(j0 <= i0 for i0, j0 in tiles)  # lower triangle only
    tiles.clear()
    cuflash.attention_backward(q, q, k, v, out, lse, window_size=(3, 3))
    assert sorted(tiles) == sorted(band * 3)  # the same band three times: the LSE, D, the gradients


def test_bitwise_repeatable(rng):
    q, k, v = make_qkv(rng, ml_dtypes.bfloat16, 2, 100, 90, 4, 1, 32)
    out1, lse1 = cuflash.attention(q, k, v, causal=True, return_lse=True)
    out2, lse2 = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out1.tobytes() == out2.tobytes() and lse1.tobytes() == lse2.tobytes()
    dout = rand(rng, out1.shape, ml_dtypes.bfloat16)
    g1 = cuflash.attention_backward(dout, q, k, v, out1, lse1, causal=True, deterministic=True)
    g2 = cuflash.attention_backward(dout, q, k, v, out1, lse1, causal=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(g1, g2))


# ---------------------------------------------------------------------------------------------
# Hypothesis: random shapes and options
# ---------------------------------------------------------------------------------------------


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 2))
    dims = dict(batch=draw(st.integers(1, 2)), sq=draw(st.integers(1, 70)), sk=draw(st.integers(0, 70)),
                hq=hkv * draw(st.integers(1, 3)), hkv=hkv, d=draw(st.integers(1, 40)),
                dv=draw(st.integers(1, 40)))
    opts = dict(causal=draw(st.sampled_from([False, True, "top_left"])),
                window_size=(draw(st.integers(-1, 30)), draw(st.integers(-1, 30))))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([0.5, 5.0, 30.0]))
    if draw(st.booleans()) and dims["sk"]:
        opts["seqlens_k"] = np.array(draw(st.lists(st.integers(0, dims["sk"]), min_size=dims["batch"],
                                                   max_size=dims["batch"])))
    dtype = draw(st.sampled_from(DTYPES))
    return dims, opts, dtype, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_hypothesis_shapes(problem):
    dims, opts, dtype, seed = problem
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, dtype, dims["batch"], dims["sq"], dims["sk"], dims["hq"], dims["hkv"],
                       dims["d"], dv=dims["dv"])
    out, lse = check_forward(np, q, k, v, **opts)
    if np.dtype(dtype).itemsize > 2:
        check_backward(np, q, k, v, rng=rng, **opts)
        return
    # 16-bit: D = rowsum(dO ∘ O) from the rounded O can exceed the rule on tiny random problems
    # (module docstring), so the tiles are checked given the exact O; the API is checked above
    # and in the fixed-shape tests.
    exact_out, _ = R.attention_ref(q, k, v, **opts)
    dout = rand(rng, out.shape, dtype)
    grads = [np.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    _cpu.backward(_problem(q, k, v, **opts), dout, q, k, v, exact_out, lse, *grads)
    refs = R.attention_backward_ref(dout, q, k, v, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(g, r, n, name)


# ---------------------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_matches_plain(rng, dtype, axis):
    x = rand(rng, (300, 7, 601), dtype, 5.0)  # 601 > one streamed block of 256
    y = cuflash.softmax(x, axis=axis)
    assert y.dtype == np.dtype(dtype) and y.shape == x.shape
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    want = e / e.sum(axis=axis, keepdims=True)
    tol = {np.float16: 1e-3, ml_dtypes.bfloat16: 8e-3, np.float32: 1e-5, np.float64: 1e-13}[dtype]
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol * 1e-2)


def test_softmax_worked_example_and_masked_rows():
    row = np.array([[2, 1, 3, 0.5, 5, 2.5, 1, 3.5], [-np.inf] * 8])
    for block in (3, 4, 256):
        y = _cpu.softmax(row, 1, block=block)
        np.testing.assert_array_equal(np.round(y[0], 4),
                                      [0.0324, 0.0119, 0.0880, 0.0072, 0.6502, 0.0534, 0.0119, 0.1451])
        np.testing.assert_array_equal(y[1], 0.0)  # all -inf: zeros, not NaN
    streamed = cuflash.softmax(np.array([1.4, 3.9, 0.7, 2.2, 4.6, 1.1, 3.1, 0.3]))
    np.testing.assert_allclose(streamed.sum(), 1.0)
    np.testing.assert_allclose(streamed[4], 1 / 1.9152, rtol=1e-4)  # exp(0) / final sum


def test_softmax_errors_and_empty():
    with pytest.raises(TypeError, match="float"):
        cuflash.softmax(np.arange(4))
    with pytest.raises(np.exceptions.AxisError):
        cuflash.softmax(np.ones((2, 3)), axis=2)
    for axis in (1.0, "1", True, (0, "1"), [0, 1]):  # NumPy's own messages did not name axis; True was taken as 1
        with pytest.raises(TypeError, match="axis must be an integer"):
            cuflash.softmax(np.ones((2, 3)), axis=axis)
    for axis, message in (((), "at least one axis"), ((0, -2), "names an axis twice")):
        with pytest.raises(ValueError, match=message):
            cuflash.softmax(np.ones((2, 3)), axis=axis)
    np.testing.assert_array_equal(cuflash.softmax(np.ones((2, 3)), axis=np.int64(0)), np.full((2, 3), 0.5))
    assert cuflash.softmax(np.ones((0, 3), np.float32)).shape == (0, 3)
    assert cuflash.softmax(np.ones((0, 3), np.float32), axis=None).shape == (0, 3)


@pytest.mark.parametrize("axis", [None, (0, 2), (2, 0), (1,), (-1, 1)])
def test_softmax_over_several_axes(rng, axis):
    """axis=None (every axis) and tuples of axes normalise over all of them together, as
    scipy.special.softmax does (a new user's report, session 36); float64 against the plain formula."""
    x = rng.standard_normal((3, 4, 5)) * 3
    m = np.max(x, axis=axis, keepdims=True)
    ref = np.exp(x - m) / np.exp(x - m).sum(axis=axis, keepdims=True)
    y = cuflash.softmax(x, axis=axis)
    assert y.shape == x.shape
    np.testing.assert_allclose(y, ref, rtol=1e-13, atol=0)
    np.testing.assert_allclose(y.sum(axis=axis), 1.0, rtol=1e-13)
    assert cuflash.softmax(np.float64(2.0), axis=None) == 1.0  # (a 0-d array: its one element)


# ---------------------------------------------------------------------------------------------
# Public API around the kernels: vjp, varlen, merge_states, out= buffers (NumPy and CuPy)
# ---------------------------------------------------------------------------------------------


def test_attention_vjp(xp, rng):
    q, k, v = make_qkv(rng, np.float16, 2, 33, 47, 4, 2, 16)
    opts = dict(causal=True, softcap=10.0)
    out, vjp = cuflash.attention_vjp(xp.asarray(q), xp.asarray(k), xp.asarray(v), deterministic=True, **opts)
    ref, _ = R.attention_ref(q, k, v, **opts)
    R.assert_exact(_arrays.to_numpy(out), ref, R.naive_attention(q, k, v, **opts), "out")
    dout = rand(rng, out.shape, np.float16)
    grads = vjp(xp.asarray(dout))
    refs = R.attention_backward_ref(dout, q, k, v, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(_arrays.to_numpy(g), r, n, name)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        cuflash.attention_vjp(q, k, v, return_lse="yes")
    (out2, lse), vjp2 = cuflash.attention_vjp(xp.asarray(q), xp.asarray(k), xp.asarray(v), return_lse=True,
                                              deterministic=True, **opts)
    assert bool((out2 == out).all()) and lse.shape == (2, 4, 33)
    assert all(bool((a == b).all()) for a, b in zip(vjp2(xp.asarray(dout)), grads))


def varlen_inputs(rng, dtype, lens_q, lens_k, hq, hkv, d, dv=None, pad_q=0):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = rand(rng, (int(cu_q[-1]) + pad_q, hq, d), dtype)
    k = rand(rng, (int(cu_k[-1]), hkv, d), dtype)
    v = rand(rng, (int(cu_k[-1]), hkv, d if dv is None else dv), dtype)
    return q, k, v, cu_q, cu_k


def check_varlen(xp, q, k, v, cu_q, cu_k, *, dout=None, rng=None, grads_rule=True, **opts):
    """attention_varlen and its backward on xp arrays vs the per-sequence oracle (exactness rule).

    ``grads_rule=False`` only requires finite gradients (for near one-hot rows, see the module
    docstring).  Returns (out, lse, (dq, dk, dv)) as NumPy arrays.
    """
    qd, kd, vd, cqd, ckd = (xp.asarray(x) for x in (q, k, v, cu_q, cu_k))
    buf = nan_like(xp, q.shape[:2] + v.shape[2:], q.dtype)
    out, lse = cuflash.attention_varlen(qd, kd, vd, cqd, ckd, out=buf, return_lse=True, **opts)
    assert out is buf
    if dout is None:
        dout = rand(rng or np.random.default_rng(0), out.shape, q.dtype)
    grads = cuflash.attention_varlen_backward(xp.asarray(dout), qd, kd, vd, out, lse, cqd, ckd, **opts)
    results = [_arrays.to_numpy(x) for x in (out, lse, *grads)]
    refs = R.attention_varlen_ref(q, k, v, cu_q, cu_k, **opts)
    refs += R.attention_varlen_backward_ref(dout, q, k, v, cu_q, cu_k, **opts)
    naives = _naive_varlen(dout, q, k, v, cu_q, cu_k, **opts)
    for name, got, ref, naive in zip(("out", "lse", "dq", "dk", "dv"), results, refs, naives):
        if grads_rule or name in ("out", "lse"):
            R.assert_exact(got, ref, naive, name)
        else:
            assert np.all(np.isfinite(got.astype(np.float64))), name
    return results[0], results[1], results[2:]


def _naive_varlen(dout, q, k, v, cu_q, cu_k, **opts):
    """The naive error scale of a packed batch, sequence by sequence: out, lse, dq, dk, dv."""
    out, dq, dk, dv = (np.zeros(x.shape[:-1] + (y.shape[-1],), q.dtype)
                       for x, y in ((q, v), (q, q), (k, k), (k, v)))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, lse_dtype(q.dtype))
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        sub = dict(opts)
        if np.ndim(opts.get("alibi_slopes")) == 2:
            sub["alibi_slopes"] = opts["alibi_slopes"][b]
        args = (q[None, qs], k[None, ks], v[None, ks])
        o, l_ = R.naive_attention(*args, return_lse=True, **sub)
        g = R.naive_attention_backward(dout[None, qs], *args, **sub)
        out[qs], lse[:, qs], dq[qs], dk[ks], dv[ks] = o[0], l_[0], g[0][0], g[1][0], g[2][0]
    return out, lse, dq, dk, dv


def test_attention_varlen(xp, rng):
    lens_q, lens_k = [5, 0, 70, 1, 33], [9, 4, 66, 0, 33]
    q, k, v, cu_q, cu_k = varlen_inputs(rng, np.float32, lens_q, lens_k, 4, 2, 16, dv=8, pad_q=3)
    slopes = rng.random((5, 4)).astype(np.float32)
    out, lse, (dq, dk, dv) = check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng, causal=True,
                                          alibi_slopes=slopes, softcap=4.0)
    assert np.all(out[-3:] == 0) and np.all(lse[:, -3:] == -np.inf) and np.all(dq[-3:] == 0)
    assert np.all(dk[9:13] == 0) and np.all(dv[9:13] == 0)  # keys of the sequence without queries
    assert np.all(out[75] == 0) and np.all(lse[:, 75] == -np.inf)  # a query without keys
    # the first sequence alone, through the padded API on the same path, gives the same numbers
    alone = cuflash.attention(*(xp.asarray(x[None, :n]) for x, n in ((q, 5), (k, 9), (v, 9))), causal=True,
                              alibi_slopes=xp.asarray(slopes[0]), softcap=4.0)
    np.testing.assert_array_equal(out[:5], _arrays.to_numpy(alone)[0])


def test_attention_varlen_fp16_windows(xp, rng):
    q, k, v, cu_q, cu_k = varlen_inputs(rng, np.float16, [40, 129, 2], [100, 64, 7], 6, 3, 32)
    check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng, window_size=(8, 4))
    check_varlen(xp, q, k, v, cu_q, cu_k, rng=rng, causal="top_left")


def _split_keys(xp, q, k, v, cut, layout="bshd", **opts):
    axis = 1 if layout == "bshd" else 2
    parts = []
    for sl in (slice(0, cut), slice(cut, None)):
        idx = (slice(None),) * axis + (sl,)
        parts.append(cuflash.attention(xp.asarray(q), xp.asarray(k[idx]), xp.asarray(v[idx]),
                                       return_lse=True, layout=layout, **opts))
    return parts


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_merge_states_two_halves(xp, rng, layout, dtype):
    q, k, v = make_qkv(rng, dtype, 2, 9, 50, 3, 3, 16)
    if layout == "bhsd":
        q, k, v = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v))
    (o1, l1), (o2, l2) = _split_keys(xp, q, k, v, 20, layout=layout)
    ref, ref_lse = R.attention_ref(q, k, v, layout=layout)
    naive, naive_lse = R.naive_attention(q, k, v, layout=layout, return_lse=True)
    out, lse = cuflash.merge_states(o1, l1, o2, l2, layout=layout)
    R.assert_exact(_arrays.to_numpy(out), ref, naive, "merged out")
    R.assert_exact(_arrays.to_numpy(lse), ref_lse, naive_lse, "merged lse")
    out2, lse2 = cuflash.merge_states(xp.stack([o1, o2]), xp.stack([l1, l2]), layout=layout)
    np.testing.assert_array_equal(_arrays.to_numpy(out2), _arrays.to_numpy(out))
    np.testing.assert_array_equal(_arrays.to_numpy(lse2), _arrays.to_numpy(lse))
    # merging with a part that saw nothing changes nothing
    empty_o, empty_l = xp.zeros_like(o1), xp.full(l1.shape, -np.inf, dtype=l1.dtype)
    out3, lse3 = cuflash.merge_states(o1, l1, empty_o, empty_l, layout=layout)
    np.testing.assert_array_equal(_arrays.to_numpy(out3), _arrays.to_numpy(o1))
    np.testing.assert_array_equal(_arrays.to_numpy(lse3), _arrays.to_numpy(l1))
    out4, lse4 = cuflash.merge_states(empty_o, empty_l, empty_o, empty_l, layout=layout)
    assert np.all(_arrays.to_numpy(out4) == 0) and np.all(_arrays.to_numpy(lse4) == -np.inf)


def test_merge_states_packed(xp, rng):
    lens_q, lens_k = [3, 8], [10, 12]
    q, k, v, cu_q, cu_k = varlen_inputs(rng, np.float32, lens_q, lens_k, 2, 2, 8)
    # split each sequence's keys into its first 4 and the rest
    parts = []
    for lo, hi in ((0, 4), (4, None)):
        ks = [k[cu_k[b]:cu_k[b + 1]][lo:hi] for b in range(2)]
        vs = [v[cu_k[b]:cu_k[b + 1]][lo:hi] for b in range(2)]
        cu = np.concatenate([[0], np.cumsum([len(x) for x in ks])])
        parts.append(cuflash.attention_varlen(xp.asarray(q), xp.asarray(np.concatenate(ks)),
                                              xp.asarray(np.concatenate(vs)), xp.asarray(cu_q),
                                              xp.asarray(cu), return_lse=True))
    out, lse = cuflash.merge_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    ref, ref_lse = R.attention_varlen_ref(q, k, v, cu_q, cu_k)
    np.testing.assert_allclose(_arrays.to_numpy(out), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_arrays.to_numpy(lse), ref_lse, rtol=1e-6)


def test_merge_states_errors(xp):
    o = xp.zeros((1, 2, 3, 4), dtype=np.float32)
    l_ = xp.zeros((1, 3, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="lse must have shape"):
        cuflash.merge_states(o, xp.zeros((1, 2, 3), np.float32), o, l_)
    with pytest.raises(ValueError, match="arguments"):
        cuflash.merge_states(o, l_, o)
    with pytest.raises(TypeError, match="floating"):
        cuflash.merge_states(o.astype(np.int32), l_, o.astype(np.int32), l_)


def test_out_buffers_are_checked(xp, rng):
    q, k, v = (xp.asarray(x) for x in make_qkv(rng, np.float32, 1, 5, 6, 2, 2, 8))
    with pytest.raises(ValueError, match="out must have shape"):
        cuflash.attention(q, k, v, out=xp.empty((1, 5, 2, 7), dtype=np.float32))
    with pytest.raises(TypeError, match="out must have dtype"):
        cuflash.attention(q, k, v, out=xp.empty((1, 5, 2, 8), dtype=np.float64))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dq must have shape"):
        cuflash.attention_backward(out, q, k, v, out, lse, dq=xp.empty((1, 5, 2, 9), dtype=np.float32))


def test_backward_into_given_buffers_and_layout_bhsd(xp, rng):
    q, k, v = make_qkv(rng, np.float64, 2, 12, 17, 4, 1, 8, dv=3)
    t = lambda x: np.ascontiguousarray(x.swapaxes(1, 2))  # noqa: E731
    grads = check_backward(xp, t(q), t(k), t(v), layout="bhsd", rng=rng, window_size=(3, 3))
    assert [g.shape for g in grads] == [(2, 4, 12, 8), (2, 1, 17, 8), (2, 1, 17, 3)]



def test_float32_scores_stay_within_the_rule_on_a_padded_batch():
    """Large scores (|s| ~ 50), a one-key window, ALiBi and a padded batch: a float32 matmul in
    the batch's summation order once broke the exactness rule on the LSE by 3 % (hostile run);
    float32 inputs are now multiplied in float64."""
    failures = 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        q = (rng.standard_normal((3, 70, 6, 64)) * 5).astype(np.float32)
        k = (rng.standard_normal((3, 48, 3, 64)) * 5).astype(np.float32)
        v = rng.standard_normal((3, 48, 3, 5)).astype(np.float32)
        lengths = rng.integers(1, 49, 3)
        slopes = rng.uniform(0.01, 1, (3, 6)).astype(np.float32)
        opts = dict(causal=True, window_size=(0, 0))
        out, lse = cuflash.attention(q, k, v, seqlens_k=lengths, alibi_slopes=slopes, return_lse=True, **opts)
        for b, n in enumerate(lengths):
            args = (q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
            ref, ref_lse = R.attention_ref(*args, alibi_slopes=slopes[b], **opts)
            naive, naive_lse = R.naive_attention(*args, alibi_slopes=slopes[b], return_lse=True, **opts)
            failures += R.max_error_ratio(lse[b:b + 1], ref_lse, naive_lse) > 1
            failures += R.max_error_ratio(out[b:b + 1], ref, naive) > 1
    assert failures == 0


def test_merge_states_with_an_infinite_lse_warns_nothing():
    """A +inf LSE makes its rows NaN (documented), without a NumPy RuntimeWarning reaching the user."""
    import warnings

    oa = np.ones((1, 2, 1, 4), np.float32)
    la = np.zeros((1, 1, 2), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cuflash.merge_states(oa, np.full_like(la, np.inf), oa, la)
    assert np.isnan(out).all() and np.isnan(lse).all()
