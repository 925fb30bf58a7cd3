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


def _check_varlen_grads(grads, dout, q, k, v, cu_q, cu_k, **opts):
    """Each packed sequence's gradients against its own reference and naive error; keys of a
    sequence without queries get zero dK, dV."""
    for b in range(len(cu_q) - 1):
        qs, ks_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            assert (grads[1][ks_] == 0).all() and (grads[2][ks_] == 0).all()  # keys no query sees
            continue
        args = [x[None] for x in (dout[qs], q[qs], k[ks_], v[ks_])]
        refs = R.attention_backward_ref(*args, **opts)
        naives = R.naive_attention_backward(*args, **opts)
        for name, g, r, n, sl in zip(("dq", "dk", "dv"), grads, refs, naives, (qs, ks_, ks_)):
            R.assert_exact(g[sl], r[0], n[0], f"{name} of sequence {b}")


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
    _check_varlen_grads(grads, dout, q, k, v, cu_q, cu_k, **opts)
    assert (grads[0][71:] == 0).all()  # rows past cu_seqlens_q[-1]


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_varlen_backward_reads_no_row_past_its_sequence(rng, headdim):
    """The Hopper dK/dV kernels copy whole 64-row query tiles (the copy engine reads rows past a
    sequence from the array): rows past the last sequence hold NaN in q and dout, and a sequence's
    last tile reaches into the next sequence's rows; every sequence stays exact, no NaN leaks."""
    cp = _cp()
    cu_q = np.array([0, 70, 100, 163], dtype=np.int32)
    cu_k = np.array([0, 90, 150, 230], dtype=np.int32)
    q = rng.standard_normal((200, 4, headdim)).astype(np.float16)
    k = rng.standard_normal((230, 2, headdim)).astype(np.float16)
    v = rng.standard_normal((230, 2, headdim)).astype(np.float16)
    dout = rng.standard_normal((200, 4, headdim)).astype(np.float16)
    q[163:], dout[163:] = np.nan, np.nan  # rows no sequence owns
    out, lse = cuflash.attention_varlen(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu_q), cp.asarray(cu_k),
                                        return_lse=True)
    grads = cuflash.attention_varlen_backward(cp.asarray(dout), cp.asarray(q), cp.asarray(k), cp.asarray(v), out, lse,
                                              cp.asarray(cu_q), cp.asarray(cu_k))
    _check_varlen_grads([g.get() for g in grads], dout, q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("headdim", [128, 256])
def test_long_causal_4097(rng, headdim):
    q, k, v = make_qkv(rng, np.float16, 1, 1100, 4097, 2, 1, headdim)
    check_backward(_cp(), q, k, v, rng=rng, causal=True)


MODIFIERS = ["bias+mask", "key-padding", "dropout", "dropout+bias+dlse", "dlse"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("case", MODIFIERS)
def test_bias_mask_dropout_and_dlse(rng, dtype, headdim, case):
    """The backward with an additive bias (and its gradient), a boolean mask, dropout regenerated
    from the forward's seed, and the gradient through the LSE (flash_bwd.cu's CUFLASH_MODS kernels,
    which also serve the head dims the Hopper backward takes without them), against the float64
    reference: GQA, causal on odd cases, sizes past one tile, a row that sees no key."""
    cp = _cp()
    b, sq, sk, hq, hk = 2, 70, 130, 4, 2
    q, k, v = make_qkv(rng, dtype, b, sq, sk, hq, hk, headdim)
    opts = dict(causal=MODIFIERS.index(case) % 2 == 1)
    if "bias" in case:
        opts["bias"] = rng.standard_normal((1, hq, sq, sk)).astype(np.float32)
    if "mask" in case:
        mask = rng.random((b, 1, sq, sk)) < 0.8
        mask[1, 0, 5] = False  # a row that sees no key: output 0, gradients 0
        opts["mask"] = mask
    if case == "key-padding":
        opts["bias"] = np.where(rng.random((b, 1, 1, sk)) < 0.2, -np.inf, 0.0).astype(np.float16)
    run = dict(opts)
    ref_opts = dict(opts)
    if "dropout" in case:
        seed = (77, 3)
        run.update(dropout_p=0.2, dropout_seed=seed)
        ref_opts.update(dropout_p=0.2, dropout_keep=cuflash.dropout_mask(seed, (b, hq, sq, sk), 0.2))
    gpu = {key: cp.asarray(x) if isinstance(x, np.ndarray) else x for key, x in run.items()}
    out, lse = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), return_lse=True, **gpu)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(np.float32) if "dlse" in case else None
    bufs = [cp.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v)]
    grads = cuflash.attention_backward(cp.asarray(dout), *(cp.asarray(x) for x in (q, k, v)), out, lse,
                                       dq=bufs[0], dk=bufs[1], dv=bufs[2], return_dbias="bias" in run,
                                       dlse=None if dlse is None else cp.asarray(dlse), **gpu)
    refs = R.attention_backward_ref(dout, q, k, v, dlse=dlse, **ref_opts)
    naives = R.naive_attention_backward(dout, q, k, v, dlse=dlse, **ref_opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(_arrays.to_numpy(g).astype(np.float64), r, n, name)
    if "bias" in run:
        dbias = grads[3]
        assert dbias.shape == run["bias"].shape and dbias.dtype == run["bias"].dtype
        R.assert_exact(_arrays.to_numpy(dbias).astype(np.float64), refs[3], naives[3].astype(dbias.dtype), "dbias")


def test_vjp_with_bias_on_the_gpu(rng):
    """attention_vjp with a GPU bias: out, and (dq, dk, dv, dbias) from the GPU backward."""
    cp = _cp()
    q, k, v = make_qkv(rng, np.float16, 1, 33, 65, 2, 2, 64)
    bias = rng.standard_normal((33, 65)).astype(np.float32)
    out, vjp = cuflash.attention_vjp(*(cp.asarray(x) for x in (q, k, v)), bias=cp.asarray(bias), causal=True)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    grads = vjp(cp.asarray(dout))
    refs = R.attention_backward_ref(dout, q, k, v, bias=bias, causal=True)
    naives = R.naive_attention_backward(dout, q, k, v, bias=bias, causal=True)
    for name, g, r, n in zip(("dq", "dk", "dv", "dbias"), grads, refs, naives):
        R.assert_exact(_arrays.to_numpy(g).astype(np.float64), r, n.astype(g.dtype) if name == "dbias" else n, name)


@pytest.mark.parametrize("headdim", [64, 128])
def test_varlen_dropout_backward_numbers_each_sequence_from_zero(rng, headdim):
    """attention_varlen_backward with dropout on the GPU: sequence b's gradients are those of batch
    entry b of a padded problem with the same seed (the forward's keep-mask, regenerated)."""
    cp = _cp()
    lengths_q, lengths_k = [5, 0, 70, 33], [7, 3, 130, 12]
    cu_q, cu_k = np.cumsum([0] + lengths_q).astype(np.int32), np.cumsum([0] + lengths_k).astype(np.int32)
    hq, hk = 4, 2
    q = rng.standard_normal((cu_q[-1], hq, headdim)).astype(np.float16)
    k = rng.standard_normal((cu_k[-1], hk, headdim)).astype(np.float16)
    v = rng.standard_normal((cu_k[-1], hk, headdim)).astype(np.float16)
    run = dict(dropout_p=0.25, dropout_seed=(5, 9), causal=True, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    args = [cp.asarray(x) for x in (q, k, v)] + [cp.asarray(cu_q), cp.asarray(cu_k)]
    out, lse = cuflash.attention_varlen(*args, return_lse=True, **run)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    grads = [_arrays.to_numpy(g).astype(np.float64)
             for g in cuflash.attention_varlen_backward(cp.asarray(dout), *args[:3], out, lse, *args[3:], **run)]
    mq, mk = max(lengths_q), max(lengths_k)
    for b in (0, 2, 3):
        keep = cuflash.dropout_mask((5, 9), (4, hq, mq, mk), 0.25)[b:b + 1, :, :lengths_q[b], :lengths_k[b]]
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        opts = dict(causal=True, dropout_p=0.25, dropout_keep=keep)
        refs = R.attention_backward_ref(dout[sq_][None], q[sq_][None], k[sk_][None], v[sk_][None], **opts)
        naives = R.naive_attention_backward(dout[sq_][None], q[sq_][None], k[sk_][None], v[sk_][None], **opts)
        for name, g, r, n, rows in zip(("dq", "dk", "dv"), grads, refs, naives, (sq_, sk_, sk_)):
            R.assert_exact(g[rows][None], r, n, f"{name} of sequence {b}")


def test_dbias_deterministic_and_dlse_on_rows_with_no_key(rng):
    """From a review: with deterministic=True a broadcast bias's gradient is bitwise repeatable (a
    full-size dS summed afterwards, no atomics on shared addresses); a non-finite dlse on a row that
    sees no key leaves the gradients finite (that row's P is 0: the reference's 0, not 0 x inf)."""
    cp = _cp()
    b, sq, sk, h = 2, 65, 300, 4
    q, k, v = make_qkv(rng, np.float16, b, sq, sk, h, h, 64)
    bias = np.where(rng.random((b, 1, 1, sk)) < 0.3, -np.inf, 0.0).astype(np.float32)  # key padding
    mask = np.ones((b, 1, sq, sk), bool)
    mask[0, 0, 7] = False  # row 7 of batch entry 0 sees no key
    gpu = dict(bias=cp.asarray(bias), mask=cp.asarray(mask))
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, **gpu)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    dlse_bad = dlse.copy()
    dlse_bad[0, :, 7] = np.inf
    runs = [cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, dlse=cp.asarray(dlse_bad),
                                       return_dbias=True, deterministic=True, **gpu) for _ in range(3)]
    for again in runs[1:]:
        for g, h_ in zip(runs[0], again):
            assert np.array_equal(g.get().view(np.uint8), h_.get().view(np.uint8))
    refs = R.attention_backward_ref(dout, q, k, v, dlse=dlse, bias=bias, mask=mask)
    naives = R.naive_attention_backward(dout, q, k, v, dlse=dlse, bias=bias, mask=mask)
    for name, g, r, n in zip(("dq", "dk", "dv", "dbias"), runs[0], refs, naives):
        R.assert_exact(_arrays.to_numpy(g).astype(np.float64), r, n.astype(g.dtype) if name == "dbias" else n, name)
