"""GPU backward kernels against the float64 reference backward (exactness rule), NaN-poisoned grads.

Inputs are at unit scale: FlashAttention's D = rowsum(dO ∘ O) uses the rounded O, which on
near-one-hot rows can exceed twice the naive error (see tests/test_cpu.py's module docstring).
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _arrays
from cuflash import reference as R

from .conftest import requires_gpu
from .test_cpu import check_backward, make_qkv

pytestmark = [pytest.mark.gpu, requires_gpu]

DTYPES = [np.float16, ml_dtypes.bfloat16]


def _cp():
    return _arrays.cupy_module()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [32, 40, 59, 64, 72, 96, 111, 128, 160, 256])
@pytest.mark.parametrize("seqlens", [(1, 1), (7, 63), (65, 129), (130, 70)])
@pytest.mark.parametrize("causal", [False, True])
def test_headdims_and_lengths(rng, dtype, headdim, seqlens, causal):
    q, k, v = make_qkv(rng, dtype, 2, *seqlens, 3, 3, headdim)
    check_backward(_cp(), q, k, v, rng=rng, causal=causal)


OPTIONS = [
    dict(causal="top_left"),
    dict(window_size=(0, 0)),
    dict(window_size=(17, 5)),
    dict(window_size=(20, 3), causal=True),
    dict(softcap=5.0),
    dict(softcap=1.0, causal=True),
    dict(softmax_scale=0.0),
    dict(softmax_scale=-0.3, causal=True),
    dict(alibi=True, causal=True),
    dict(alibi="batch"),
    dict(seqlens_k=True, causal=True),
    dict(seqlens_k=True, window_size=(8, 8), alibi=True, softcap=3.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlens", [(63, 65), (129, 63), (1, 147)])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("headdim", [64, 200])  # 200: the Hopper kernel whose warpgroups split dK, dV by columns
def test_options(rng, dtype, seqlens, opts, headdim):
    sq, sk = seqlens
    batch, hq, hkv = 3, 4, 2
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    if alibi:
        slopes = 2.0 ** (-8.0 * (np.arange(hq) + 1) / hq)
        if alibi == "batch":
            slopes = slopes[None, :] * rng.uniform(0.5, 2.0, (batch, 1))
        opts["alibi_slopes"] = slopes.astype(np.float32)
    if opts.get("seqlens_k") is True:
        opts["seqlens_k"] = np.array([sk, 0, max(sk // 3, 1)], dtype=np.int32)
    q, k, v = make_qkv(rng, dtype, batch, sq, sk, hq, hkv, headdim)
    gpu_opts = {n: (_cp().asarray(x) if isinstance(x, np.ndarray) else x) for n, x in opts.items()}
    cp = _cp()
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, **gpu_opts)
    dout = (rng.standard_normal(out.shape)).astype(dtype)
    grads = [cp.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v)]
    cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], **gpu_opts)
    refs = R.attention_backward_ref(dout, q, k, v, **opts)
    naives = R.naive_attention_backward(dout, q, k, v, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(g.get(), r, n, name)


@pytest.mark.parametrize("hq_hkv", [(8, 1), (6, 2), (4, 4)])
def test_gqa_sums_over_groups(rng, hq_hkv):
    q, k, v = make_qkv(rng, np.float16, 2, 77, 93, *hq_hkv, 64)
    check_backward(_cp(), q, k, v, rng=rng, causal=True)


@pytest.mark.parametrize("dims", [(64, 32), (32, 128), (20, 36), (256, 136), (144, 256)])
def test_value_headdim_differs(rng, dims):
    q, k, v = make_qkv(rng, ml_dtypes.bfloat16, 1, 65, 129, 4, 2, dims[0], dims[1])
    check_backward(_cp(), q, k, v, rng=rng, causal=True)


def test_bhsd_and_broadcast_dout(rng):
    cp = _cp()
    q, k, v = make_qkv(rng, np.float16, 2, 50, 70, 4, 4, 64)
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # bhsd copies
    check_backward(cp, qt, kt, vt, rng=rng, layout="bhsd", causal=True)
    # dout broadcast from a single value: stride 0 on every axis.
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True)
    dout = cp.broadcast_to(cp.asarray(np.float16(0.7)), out.shape)
    grads = cuflash.attention_backward(dout, qd, kd, vd, out, lse)
    dout_h = np.full(out.shape, 0.7, dtype=np.float16)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, R.attention_backward_ref(dout_h, q, k, v),
                             R.naive_attention_backward(dout_h, q, k, v)):
        R.assert_exact(g.get(), r, n, name)


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_deterministic_backward_is_bitwise_repeatable(rng, headdim):
    """deterministic=True: the same bits on every run (no atomics); the default (atomic dQ on
    Hopper) is exact too."""
    cp = _cp()
    q, k, v = make_qkv(rng, ml_dtypes.bfloat16, 2, 700, 900, 8, 2, headdim)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuflash.attention(qd, kd, vd, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(ml_dtypes.bfloat16)
    runs = [cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, causal=True, deterministic=True)
            for _ in range(3)]
    for run in runs[1:]:
        for x, y in zip(runs[0], run):
            assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16))
    default = cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, causal=True)
    refs = R.attention_backward_ref(dout, q, k, v, causal=True)
    naives = R.naive_attention_backward(dout, q, k, v, causal=True)
    for name, g, r, n in zip(("dq", "dk", "dv"), default, refs, naives):
        R.assert_exact(g.get(), r, n, name)


@pytest.mark.parametrize("headdim", [64, 256])
def test_varlen_backward(rng, headdim):
    cp = _cp()
    cu_q = np.array([0, 5, 5, 70, 71], dtype=np.int64)
    cu_k = np.array([0, 9, 20, 150, 150], dtype=np.int32)
    q = rng.standard_normal((75, 4, headdim)).astype(np.float16)  # 4 rows past cu_q[-1]
    k = rng.standard_normal((150, 2, headdim)).astype(np.float16)
    v = rng.standard_normal((150, 2, headdim)).astype(np.float16)
    opts = dict(causal=True)
    out, lse = cuflash.attention_varlen(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu_q),
                                        cp.asarray(cu_k), return_lse=True, **opts)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    grads = cuflash.attention_varlen_backward(cp.asarray(dout), cp.asarray(q), cp.asarray(k), cp.asarray(v),
                                              out, lse, cp.asarray(cu_q), cp.asarray(cu_k), **opts)
    grads = [g.get() for g in grads]
    for b in range(len(cu_q) - 1):  # each sequence against its own reference and naive error
        qs, ks_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            assert (grads[1][ks_] == 0).all() and (grads[2][ks_] == 0).all()  # keys no query sees
            continue
        args = [x[None] for x in (dout[qs], q[qs], k[ks_], v[ks_])]
        refs = R.attention_backward_ref(*args, **opts)
        naives = R.naive_attention_backward(*args, **opts)
        for name, g, r, n, sl in zip(("dq", "dk", "dv"), grads, refs, naives, (qs, ks_, ks_)):
            R.assert_exact(g[sl], r[0], n[0], f"{name} of sequence {b}")
    assert (grads[0][71:] == 0).all()  # rows past cu_seqlens_q[-1]


@pytest.mark.parametrize("headdim", [128, 256])
def test_long_causal_4097(rng, headdim):
    q, k, v = make_qkv(rng, np.float16, 1, 1100, 4097, 2, 1, headdim)
    check_backward(_cp(), q, k, v, rng=rng, causal=True)
