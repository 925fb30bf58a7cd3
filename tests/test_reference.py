"""The float64 oracle (cuflash.reference) checked from first principles.

Every other test trusts ``attention_ref``, so it is checked here against things that share no
code with it: a loop over single scores written with ``math``, central finite differences of
its own loss, analytic special cases, and the worked online-softmax examples.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash import reference as R

# ---------------------------------------------------------------------------------------------
# A second, deliberately naive implementation: one score at a time
# ---------------------------------------------------------------------------------------------


def loop_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, bias=None, mask=None, seqlens_k=None):
    """Attention by explicit loops over (b, h, i, j), straight from the contract's wording."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0 if right == -1 else min(right, 0)
    out = np.zeros((batch, seqlen_q, nheads, headdim_v))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        sk = seqlen_k if seqlens_k is None else int(seqlens_k[b])
        off = 0 if causal == "top_left" else sk - seqlen_q
        for h in range(nheads):
            hk = h // (nheads // nheads_k)
            for i in range(seqlen_q):
                scores = {}
                for j in range(sk):
                    if left != -1 and j < i + off - left:
                        continue
                    if right != -1 and j > i + off + right:
                        continue
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    s = scale * sum(float(q[b, i, h, d]) * float(k[b, j, hk, d]) for d in range(headdim))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        slope = alibi_slopes[h] if alibi_slopes.ndim == 1 else alibi_slopes[b, h]
                        s -= float(slope) * abs(i + off - j)
                    if bias is not None:
                        s += float(bias[b, h, i, j])
                    if s != -math.inf:
                        scores[j] = s
                if not scores:
                    continue
                m = max(scores.values())
                total = sum(math.exp(s - m) for s in scores.values())
                lse[b, h, i] = m + math.log(total)
                for j, s in scores.items():
                    out[b, i, h] += math.exp(s - m) / total * v[b, j, hk].astype(np.float64)
    return out, lse


def _inputs(rng, batch=2, sq=5, sk=7, hq=4, hkv=2, d=3, dv=2):
    q = rng.standard_normal((batch, sq, hq, d))
    k = rng.standard_normal((batch, sk, hkv, d))
    v = rng.standard_normal((batch, sk, hkv, dv))
    return q, k, v


LOOP_CASES = [
    dict(),
    dict(causal=True),
    dict(causal="top_left"),
    dict(causal="bottom_right", window_size=(2, -1)),
    dict(window_size=(1, 2)),
    dict(window_size=(0, 0)),
    dict(softmax_scale=0.0),
    dict(softmax_scale=2.5, softcap=0.7),
    dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
    dict(alibi_slopes=np.arange(1, 9).reshape(2, 4) / 8.0, causal="top_left"),
    dict(seqlens_k=np.array([3, 0])),
    dict(seqlens_k=np.array([5, 2]), causal=True, window_size=(1, -1)),
    dict(softcap=3.0, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.4]), causal=True),
]


@pytest.mark.parametrize("shape", [(5, 7), (7, 5), (1, 7), (6, 6)])
@pytest.mark.parametrize("opts", LOOP_CASES, ids=range(len(LOOP_CASES)))
def test_matches_loops(rng, opts, shape):
    q, k, v = _inputs(rng, sq=shape[0], sk=shape[1])
    out, lse = R.attention_ref(q, k, v, **opts)
    want_out, want_lse = loop_attention(q, k, v, **opts)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)


def test_matches_loops_with_bias_and_mask(rng):
    q, k, v = _inputs(rng)
    bias = rng.standard_normal((2, 4, 5, 7))
    bias[0, 1, 2, 3] = -np.inf  # an additive -inf is a mask too
    mask = rng.random((2, 4, 5, 7)) > 0.3
    mask[1, 2, 4] = False  # one fully masked row
    for opts in (dict(bias=bias), dict(mask=mask), dict(bias=bias, mask=mask, causal=True, softcap=2.0)):
        out, lse = R.attention_ref(q, k, v, **opts)
        want_out, want_lse = loop_attention(q, k, v, **opts)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
    out, lse = R.attention_ref(q, k, v, mask=mask)
    assert np.all(out[1, 4, 2] == 0) and lse[1, 2, 4] == -np.inf


def test_mask_and_bias_broadcast(rng):
    q, k, v = _inputs(rng)
    mask = np.tril(np.ones((5, 7), dtype=bool), k=2)  # (Sq, Sk) broadcasts over batch and heads
    bias = rng.standard_normal((4, 1, 7))  # (H, 1, Sk)
    out, lse = R.attention_ref(q, k, v, mask=mask, bias=bias)
    full_mask = np.broadcast_to(mask, (2, 4, 5, 7))
    want = loop_attention(q, k, v, mask=full_mask, bias=np.broadcast_to(bias, (2, 4, 5, 7)))
    np.testing.assert_allclose(out, want[0], rtol=1e-12)
    np.testing.assert_allclose(lse, want[1], rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Visibility, GQA mapping, layouts, scale
# ---------------------------------------------------------------------------------------------


def test_visible_mask_pictures():
    assert R.visible_mask(2, 5, causal=True).astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert R.visible_mask(2, 5, causal="top_left").astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    # causal with Sq > Sk: the top Sq - Sk rows see nothing
    assert R.visible_mask(4, 2, causal=True).astype(int).tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]
    # (1, 0): the diagonal key and one to its left, relative to the bottom-right diagonal
    assert R.visible_mask(3, 4, window_size=(1, 0)).astype(int).tolist() == [
        [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    # the causal flag clips a larger right window to 0
    np.testing.assert_array_equal(R.visible_mask(5, 5, causal=True, window_size=(2, 3)),
                                  R.visible_mask(5, 5, window_size=(2, 0)))
    # a valid key length shorter than seqlen_k moves the diagonal and hides the tail
    assert R.visible_mask(2, 5, causal=True, valid_k=3).astype(int).tolist() == [
        [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]


def test_gqa_repeats_heads_not_tiles(rng):
    q, k, v = _inputs(rng, hq=6, hkv=3)
    out, lse = R.attention_ref(q, k, v)
    for h in range(6):
        hk = h // 2  # repeat: 0 0 1 1 2 2
        o, l_ = R.attention_ref(q[:, :, h:h + 1], k[:, :, hk:hk + 1], v[:, :, hk:hk + 1])
        np.testing.assert_allclose(out[:, :, h:h + 1], o, rtol=1e-13)
        np.testing.assert_allclose(lse[:, h:h + 1], l_, rtol=1e-13)
    tiled, _ = R.attention_ref(q, np.tile(k, (1, 1, 2, 1)), np.tile(v, (1, 1, 2, 1)))
    assert not np.allclose(out, tiled)


def test_gqa_bad_ratio():
    with pytest.raises(ValueError, match="multiple"):
        R.attention_ref(np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 2, 4)))


def test_layout_bhsd(rng):
    q, k, v = _inputs(rng)
    out, lse = R.attention_ref(q, k, v, causal=True)
    t = lambda x: np.ascontiguousarray(x.swapaxes(1, 2))  # noqa: E731
    out2, lse2 = R.attention_ref(t(q), t(k), t(v), causal=True, layout="bhsd")
    np.testing.assert_array_equal(out2, t(out))
    np.testing.assert_array_equal(lse2, lse)
    dout = rng.standard_normal(out.shape)
    g = R.attention_backward_ref(dout, q, k, v, causal=True)
    g2 = R.attention_backward_ref(t(dout), t(q), t(k), t(v), causal=True, layout="bhsd")
    for a, b in zip(g, g2):
        np.testing.assert_array_equal(b, t(a))


def test_scale_default_and_literal_zero(rng):
    q, k, v = _inputs(rng, d=9)
    out, _ = R.attention_ref(q, k, v)
    explicit, _ = R.attention_ref(q, k, v, softmax_scale=1 / 3)
    np.testing.assert_array_equal(out, explicit)
    uniform, lse = R.attention_ref(q, k, v, softmax_scale=0.0)
    mean_v = np.repeat(v.mean(axis=1, keepdims=True), 2, axis=2)  # (B, 1, Hq, Dv)
    np.testing.assert_allclose(uniform, np.broadcast_to(mean_v, uniform.shape), rtol=1e-13)
    np.testing.assert_allclose(lse, np.log(7))


def test_bad_options():
    q = np.zeros((1, 2, 2, 4))
    for bad in (dict(causal="yes"), dict(softcap=-1.0), dict(layout="sbhd"), dict(window_size=(-2, 0))):
        with pytest.raises(ValueError):
            R.attention_ref(q, q, q, **bad)
    with pytest.raises(ValueError, match="head dim 0"):
        R.attention_ref(np.zeros((1, 2, 2, 0)), np.zeros((1, 2, 2, 0)), np.zeros((1, 2, 2, 3)))


# ---------------------------------------------------------------------------------------------
# Empty rows and empty problems
# ---------------------------------------------------------------------------------------------


def test_empty_rows_forward_and_backward(rng):
    q, k, v = _inputs(rng, sq=6, sk=3)  # causal, Sq > Sk: rows 0..2 see no key
    out, lse = R.attention_ref(q, k, v, causal=True)
    assert np.all(out[:, :3] == 0) and np.all(lse[:, :, :3] == -np.inf)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 3:]))
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = R.attention_backward_ref(dout, q, k, v, causal=True)
    assert np.all(dq[:, :3] == 0)
    # the empty rows add nothing: gradients equal those of the visible rows alone
    dq2, dk2, dv2 = R.attention_backward_ref(dout[:, 3:], q[:, 3:], k, v, causal=True)
    np.testing.assert_allclose(dq[:, 3:], dq2, rtol=1e-13)
    np.testing.assert_allclose(dk, dk2, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(dv, dv2, rtol=1e-13, atol=1e-15)
    for g in (dq, dk, dv):
        assert not np.isnan(g).any()


@pytest.mark.parametrize("shapes", [
    ((0, 4, 2, 3), (0, 5, 2, 3)),  # batch 0
    ((2, 0, 2, 3), (2, 5, 2, 3)),  # seqlen_q 0
    ((2, 4, 2, 3), (2, 0, 2, 3)),  # seqlen_k 0: every row empty
    ((2, 4, 0, 3), (2, 5, 0, 3)),  # no heads
    ((2, 4, 0, 3), (2, 5, 1, 3)),  # no query heads, one key/value head: zero dk, dv of k's shape
])
def test_empty_problems(rng, shapes):
    qs, ks = shapes
    q, k = rng.standard_normal(qs), rng.standard_normal(ks)
    v = rng.standard_normal(ks[:3] + (5,))
    out, lse, probs = R.attention_ref(q, k, v, causal=True, return_probs=True)
    assert out.shape == qs[:3] + (5,) and lse.shape == (qs[0], qs[2], qs[1])
    assert probs.shape == (qs[0], qs[2], qs[1], ks[1])
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv = R.attention_backward_ref(np.ones(out.shape), q, k, v, causal=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)
    naive, naive_lse = R.naive_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16),
                                         return_lse=True)
    assert naive.shape == out.shape and naive_lse.shape == lse.shape


def test_softcap_with_huge_logits_stays_finite(rng):
    q, k, v = _inputs(rng, d=8)
    q, k = q * 300, k * 300  # |scale q.k| ~ 1e5
    for cap in (50.0, 1.0, 0.1):
        out, lse = R.attention_ref(q, k, v, softcap=cap, causal=True)
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
        assert np.all(np.abs(lse) <= cap + np.log(7) + 1e-12)
        grads = R.attention_backward_ref(np.ones(out.shape), q, k, v, softcap=cap, causal=True)
        assert all(np.all(np.isfinite(g)) for g in grads)


def test_finite_minimum_additive_mask_is_not_a_mask(rng):
    q, k, v = _inputs(rng, batch=1, hq=1, hkv=1)
    bias = np.zeros((1, 1, 5, 7))
    bias[..., 3, :] = np.finfo(np.float32).min  # a whole row of the most negative float32
    out, lse = R.attention_ref(q, k, v, bias=bias)
    # every score in the row rounds to the same value: uniform weights, the mean of v
    np.testing.assert_allclose(out[0, 3, 0], v[0, :, 0].mean(axis=0), rtol=1e-12)
    assert np.isfinite(lse[0, 0, 3])


# ---------------------------------------------------------------------------------------------
# Backward against central finite differences
# ---------------------------------------------------------------------------------------------

FD_CASES = [
    dict(),
    dict(causal=True),
    dict(causal="top_left", window_size=(1, -1)),
    dict(window_size=(1, 1)),
    dict(softcap=1.5),
    dict(alibi_slopes=np.array([0.4, 0.7])),
    dict(seqlens_k=np.array([4, 2]), causal=True),
    dict(softcap=0.8, alibi_slopes=np.array([[0.1, 0.3], [0.2, 0.5]]), window_size=(2, 0)),
    dict(softmax_scale=1.7),
]


def _finite_difference(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        orig = x[idx]
        x[idx] = orig + eps
        plus = f()
        x[idx] = orig - eps
        minus = f()
        x[idx] = orig
        grad[idx] = (plus - minus) / (2 * eps)
    return grad


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("opts", FD_CASES, ids=range(len(FD_CASES)))
def test_backward_matches_finite_differences(rng, opts, gqa):
    q, k, v = _inputs(rng, sq=3, sk=4, hq=2, hkv=1 if gqa else 2, d=3, dv=2)
    bias = rng.standard_normal((1, 2, 3, 4))  # broadcast over batch: dbias sums over it
    dout = rng.standard_normal((2, 3, 2, 2))

    def loss():
        return float((R.attention_ref(q, k, v, bias=bias, **opts)[0] * dout).sum())

    dq, dk, dv, dbias = R.attention_backward_ref(dout, q, k, v, bias=bias, **opts)
    assert dbias.shape == bias.shape
    for name, got, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v), ("dbias", dbias, bias)):
        want = _finite_difference(loss, x)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8, err_msg=name)
    assert np.abs(dq).max() > 1e-3  # the check above is not comparing zeros


# ---------------------------------------------------------------------------------------------
# Variable-length batches
# ---------------------------------------------------------------------------------------------


def test_varlen_matches_padded_sequences(rng):
    cu_q, cu_k = np.array([0, 3, 3, 8]), np.array([0, 4, 6, 6])  # an empty q, an empty k sequence
    q = rng.standard_normal((10, 4, 3))  # 2 rows past cu_q[-1]
    k, v = rng.standard_normal((7, 2, 3)), rng.standard_normal((7, 2, 5))
    slopes = rng.random((3, 4))
    opts = dict(causal=True, alibi_slopes=slopes, softcap=2.0)
    out, lse = R.attention_varlen_ref(q, k, v, cu_q, cu_k, **opts)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = R.attention_varlen_backward_ref(dout, q, k, v, cu_q, cu_k, **opts)
    assert out.shape == (10, 4, 5) and lse.shape == (4, 10)
    assert np.all(out[8:] == 0) and np.all(lse[:, 8:] == -np.inf) and np.all(dq[8:] == 0)
    assert np.all(out[3:8] == 0) and np.all(lse[:, 3:8] == -np.inf)  # third sequence has no keys
    assert np.all(dk[6:] == 0) and np.all(dv[6:] == 0)  # keys past cu_k[-1]
    want_o, want_l = R.attention_ref(q[None, :3], k[None, :4], v[None, :4], causal=True,
                                     alibi_slopes=slopes[0], softcap=2.0)
    np.testing.assert_array_equal(out[:3], want_o[0])
    np.testing.assert_array_equal(lse[:, :3], want_l[0])
    g = R.attention_backward_ref(dout[None, :3], q[None, :3], k[None, :4], v[None, :4], causal=True,
                                 alibi_slopes=slopes[0], softcap=2.0)
    np.testing.assert_array_equal(dq[:3], g[0][0])
    np.testing.assert_array_equal(dk[:4], g[1][0])
    assert np.all(dk[4:6] == 0)  # the second sequence has keys but no queries


# ---------------------------------------------------------------------------------------------
# Naive same-dtype attention and the exactness rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_naive_attention(rng, dtype):
    q, k, v = (x.astype(dtype) for x in _inputs(rng, sq=20, sk=30, d=16, dv=8))
    opts = dict(causal=True, softcap=5.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]))
    out, lse = R.naive_attention(q, k, v, return_lse=True, **opts)
    ref, ref_lse = R.attention_ref(q, k, v, **opts)
    assert out.dtype == np.dtype(dtype) and out.shape == ref.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    err = np.abs(out.astype(np.float64) - ref).max()
    tol = {np.float16: 1e-2, ml_dtypes.bfloat16: 1e-1, np.float32: 1e-5, np.float64: 1e-13}[dtype]
    assert err < tol
    if dtype in (np.float16, ml_dtypes.bfloat16):
        assert err > 0  # rounded per stage: the error scale is not zero
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = R.naive_attention_backward(dout, q, k, v, **opts)
    refs = R.attention_backward_ref(dout, q, k, v, **opts)
    for g, r, x in zip(grads, refs, (q, k, v)):
        assert g.dtype == np.dtype(dtype) and g.shape == x.shape
        assert np.abs(g.astype(np.float64) - r).max() < 20 * tol * max(1.0, np.abs(r).max())


def test_max_error_ratio_rules():
    ref = np.array([1.0, -np.inf, 2.0])
    naive = np.array([1.001, -np.inf, 2.0])  # max naive error 1e-3
    assert R.max_error_ratio(ref, ref, naive) == 0.0
    ratio = R.max_error_ratio(np.array([1.0, -np.inf, 2.002]), ref, naive)
    assert ratio == pytest.approx(2e-3 / (2e-3 + 1e-5))
    assert R.max_error_ratio(np.array([1.0, np.nan, 2.0]), ref, naive) == math.inf
    assert R.max_error_ratio(np.array([1.0, 0.0, 2.0]), ref, naive) == math.inf  # lost the -inf
    assert R.max_error_ratio(np.array([np.inf, -np.inf, 2.0]), ref, naive) == math.inf
    # a naive result that overflowed does not widen the bound
    assert R.max_error_ratio(np.array([1.0, -np.inf, 2.0 + 2e-5]), ref, np.array([np.inf, -np.inf, 2.0])) > 1
    assert R.max_error_ratio(np.zeros(0), np.zeros(0), np.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="shapes"):
        R.max_error_ratio(np.zeros(2), np.zeros(3), np.zeros(3))
    # attention_ref's (out, lse) where one array goes: named, not NumPy's ragged-array error
    with pytest.raises(TypeError, match=r"ref64 is a tuple of 2 items.*attention_ref\(\.\.\.\)\[0\]"):
        R.max_error_ratio(np.zeros((1, 2)), (np.zeros((1, 2)), np.zeros(1)), np.zeros((1, 2)))
    with pytest.raises(TypeError, match="naive is a list"):
        R.assert_exact(np.zeros(2), np.zeros(2), [np.zeros(2)])


def test_assert_exact_message():
    ref = np.zeros((2, 3))
    naive = np.full((2, 3), 1e-3)
    R.assert_exact(ref + 2e-3, ref, naive, "ok")  # ratio just under 1
    bad = ref.copy()
    bad[1, 2] = 0.5
    with pytest.raises(AssertionError, match=r"dq: error ratio .* at index \(1, 2\)"):
        R.assert_exact(bad, ref, naive, "dq")
    with pytest.raises(AssertionError, match="NaN count 1"):
        R.assert_exact(np.where(bad > 0, np.nan, bad), ref, naive, "dq")


def test_accepts_low_precision_and_gpu_like_arrays(rng):
    q, k, v = _inputs(rng)

    class FakeGpuArray:  # anything with .get() is brought to the host, as CuPy arrays are
        def __init__(self, a):
            self.a = a

        def get(self):
            return self.a

    out, lse = R.attention_ref(FakeGpuArray(q), FakeGpuArray(k), FakeGpuArray(v))
    np.testing.assert_array_equal(out, R.attention_ref(q, k, v)[0])
    out16, _ = R.attention_ref(q.astype(ml_dtypes.bfloat16), k.astype(ml_dtypes.bfloat16),
                               v.astype(ml_dtypes.bfloat16))
    assert out16.dtype == np.float64 and lse.dtype == np.float64


# ---------------------------------------------------------------------------------------------
# The online softmax, worked by hand
# ---------------------------------------------------------------------------------------------


def test_online_softmax_worked_example_running_stats():
    steps, weights = R.online_softmax_trace([1.4, 3.9, 0.7, 2.2, 4.6, 1.1, 3.1, 0.3], 4)
    assert [round(m, 4) for m, _ in steps] == [3.9, 4.6]
    assert [round(s, 4) for _, s in steps] == [1.3055, 1.9152]
    assert weights.sum() == pytest.approx(1.0)


def test_online_softmax_worked_example_weights():
    row = np.array([2, 1, 3, 0.5, 5, 2.5, 1, 3.5])
    steps, weights = R.online_softmax_trace(row, 4)
    assert steps[-1][0] == 5.0 and round(steps[-1][1], 4) == 1.5381
    np.testing.assert_array_equal(np.round(weights, 4),
                                  [0.0324, 0.0119, 0.0880, 0.0072, 0.6502, 0.0534, 0.0119, 0.1451])
    plain = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    for block in (1, 3, 4, 8, 100):  # streamed equals plain, whatever the blocking
        np.testing.assert_allclose(R.online_softmax_trace(row, block)[1], plain, rtol=1e-15)


def test_online_softmax_all_masked_and_errors():
    steps, weights = R.online_softmax_trace([-np.inf, -np.inf, 1.0], 2)
    assert steps[0] == (-math.inf, 0.0) and steps[1] == (1.0, 1.0)
    np.testing.assert_array_equal(weights, [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(R.online_softmax_trace([-np.inf] * 3, 2)[1], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        R.online_softmax_trace([1.0, 2.0], 0)
