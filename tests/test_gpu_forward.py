"""GPU forward kernel against the float64 reference (exactness rule), on NaN-poisoned outputs.

Skipped without a CUDA GPU; scripts/gpu_check.sh runs these on the device machine.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _arrays
from cuflash.reference import assert_exact, attention_ref, naive_attention

from .conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

DTYPES = [np.float16, ml_dtypes.bfloat16]
HEADDIMS = [32, 40, 59, 64, 72, 80, 96, 111, 128, 160, 192, 224, 256]


def _cp():
    return _arrays.cupy_module()


def _rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _check(q, k, v, *, layout="bshd", **opts):
    """Run cuflash on the GPU with a NaN-poisoned out=, compare out and lse with the reference."""
    cp = _cp()
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    shape = list(q.shape)
    shape[-1] = v.shape[-1]
    out = cp.full(tuple(shape), np.nan, dtype=q.dtype)
    res, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, layout=layout, **opts)
    assert res is out
    ref_out, ref_lse = attention_ref(q, k, v, layout=layout, **opts)
    naive_out, naive_lse = naive_attention(q, k, v, layout=layout, return_lse=True, **opts)
    assert_exact(out.get(), ref_out, naive_out, "out")
    assert_exact(lse.get(), ref_lse, naive_lse, "lse")
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlens", [(1, 1), (7, 63), (65, 129), (130, 1000)])
@pytest.mark.parametrize("causal", [False, True])
def test_headdims_and_lengths(rng, dtype, headdim, seqlens, causal):
    sq, sk = seqlens
    q = _rand(rng, (2, sq, 3, headdim), dtype, 5.0)  # x5 so errors show
    k = _rand(rng, (2, sk, 3, headdim), dtype)
    v = _rand(rng, (2, sk, 3, headdim), dtype)
    _check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("dims", [(64, 32), (32, 128), (128, 64), (96, 256), (256, 8), (20, 36)])
def test_value_headdim_differs(rng, dtype, dims):
    d, dv = dims
    q, k = _rand(rng, (1, 65, 4, d), dtype), _rand(rng, (1, 129, 4, d), dtype)
    v = _rand(rng, (1, 129, 4, dv), dtype)
    _check(q, k, v, causal=True)
    _check(q, k, v)


OPTIONS = [
    dict(causal="top_left"),
    dict(window_size=(0, 0)),
    dict(window_size=(1, 0)),
    dict(window_size=(0, 1)),
    dict(window_size=(31, 0)),
    dict(window_size=(17, 40)),
    dict(window_size=(100, -1)),
    dict(window_size=(-1, 5)),
    dict(window_size=(20, 3), causal=True),
    dict(window_size=(20, 3), causal="top_left"),
    dict(softcap=50.0),
    dict(softcap=1.0, causal=True),
    dict(softcap=0.1),
    dict(softmax_scale=0.0),
    dict(softmax_scale=0.5, causal=True),
    dict(alibi=True),
    dict(alibi=True, causal=True),
    dict(alibi="batch", softcap=5.0, causal=True),
    dict(seqlens_k=True),
    dict(seqlens_k=True, causal=True),
    dict(seqlens_k=True, window_size=(8, 8), alibi=True),
]


def _materialise(opts, rng, batch, nheads):
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    if alibi:
        slopes = 2.0 ** (-8.0 * (np.arange(nheads) + 1) / nheads)
        if alibi == "batch":
            slopes = slopes[None, :] * rng.uniform(0.5, 2.0, (batch, 1))
        opts["alibi_slopes"] = slopes.astype(np.float32)
    return opts


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("seqlens", [(63, 65), (129, 63), (200, 1000), (1, 147)])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_options(rng, dtype, headdim, seqlens, opts):
    sq, sk = seqlens
    batch, nheads = 3, 4
    opts = _materialise(opts, rng, batch, nheads)
    if opts.get("seqlens_k") is True:
        opts["seqlens_k"] = np.array([sk, 0, max(sk // 3, 1)], dtype=np.int64)
    q = _rand(rng, (batch, sq, nheads, headdim), dtype, 5.0)
    k, v = _rand(rng, (batch, sk, nheads, headdim), dtype), _rand(rng, (batch, sk, nheads, headdim), dtype)
    gpu_opts = dict(opts)
    for name in ("alibi_slopes", "seqlens_k"):
        if name in gpu_opts:
            gpu_opts[name] = _cp().asarray(gpu_opts[name])
    cp = _cp()
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **gpu_opts)
    ref_out, ref_lse = attention_ref(q, k, v, **opts)
    naive_out, naive_lse = naive_attention(q, k, v, return_lse=True, **opts)
    assert_exact(out.get(), ref_out, naive_out, "out")
    assert_exact(lse.get(), ref_lse, naive_lse, "lse")


@pytest.mark.parametrize("hq_hkv", [(8, 1), (8, 2), (12, 4), (6, 6)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(rng, hq_hkv, causal):
    hq, hkv = hq_hkv
    q = _rand(rng, (2, 77, hq, 64), np.float16, 5.0)
    k, v = _rand(rng, (2, 93, hkv, 64), np.float16), _rand(rng, (2, 93, hkv, 64), np.float16)
    _check(q, k, v, causal=causal)


@pytest.mark.parametrize("window", [(2**32, 0), (2**31, 2**32 + 3), (2**40, 2**40), (1000, 2**32)])
@pytest.mark.parametrize("backward", [False, True])
def test_window_bounds_past_32_bits_are_unbounded(rng, window, backward):
    """A window bound past any sequence's length hides nothing, also where it does not fit the
    kernels' 32-bit ints (2**32 used to reach them as 0: a window of one key)."""
    q, k, v = (_rand(rng, (2, n, 4, 64), np.float16) for n in (70, 150, 150))
    unbounded = tuple(-1 if w >= 150 else w for w in window)
    if not backward:
        _check(q, k, v, window_size=window)
        _check(q, k, v, window_size=window, causal=True)
        return
    cp = _cp()
    qd, kd, vd, dout = (cp.asarray(x) for x in (q, k, v, _rand(rng, (2, 70, 4, 64), np.float16)))
    grads = []
    for w in (window, unbounded):  # (deterministic: bitwise repeatable; the default's atomic dQ adds the
        # three key blocks of a row in whatever order they arrive)
        out, lse = cuflash.attention(qd, kd, vd, window_size=w, return_lse=True)
        grads.append(cuflash.attention_backward(dout, qd, kd, vd, out, lse, window_size=w, deterministic=True))
    for got, want in zip(*grads):
        assert cp.array_equal(got.view(cp.uint16), want.view(cp.uint16))


def _bias_mask_forms(rng, b, h, sq, sk):
    """Bias and mask in the broadcast forms users pass (issue 23), built as CuPy arrays so that the
    strided, reversed and stride-0 views reach the kernels as such."""
    cp = _cp()
    full = cp.asarray(rng.standard_normal((b, h, sq, 2 * sk)).astype(np.float32))
    mask = rng.random((b, 1, sq, sk)) < 0.7
    mask[0, 0, min(3, sq - 1)] = False  # a row that sees no key
    mask = cp.asarray(mask)
    return {
        "bias 1-1-sq-sk": dict(bias=cp.asarray(rng.standard_normal((1, 1, sq, sk)).astype(np.float32))),
        "bias key-padding": dict(bias=cp.asarray(np.where(rng.random((b, 1, 1, sk)) < 0.2, -np.inf, 0.0).astype(np.float32))),
        "bias 1-h-sq-sk fp16": dict(bias=cp.asarray((rng.standard_normal((1, h, sq, sk)) * 3).astype(np.float16))),
        "bias sq-sk bf16": dict(bias=cp.asarray(rng.standard_normal((sq, sk)).astype(ml_dtypes.bfloat16))),
        "bias float64": dict(bias=cp.asarray(rng.standard_normal((b, 1, sq, sk)))),
        "bias float64 stride-0": dict(bias=cp.broadcast_to(cp.asarray(rng.standard_normal((1, h, 1, sk))), (b, h, sq, sk))),
        "bias strided": dict(bias=full[..., ::2]),
        "bias reversed": dict(bias=full[..., ::-2]),
        "bias stride-0": dict(bias=cp.broadcast_to(full[:1, :, :1, :sk], (b, h, sq, sk))),
        "mask": dict(mask=mask),
        "mask key-padding": dict(mask=cp.asarray(np.arange(sk)[None, None, None, :] < np.array([sk, sk // 3])[:b, None, None, None])),
        "mask stride-0 reversed": dict(mask=cp.broadcast_to(mask[:, :, ::-1], (b, h, sq, sk))),
        "bias and mask": dict(bias=full[..., :sk], mask=mask),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [32, 64, 128, 200, 256])  # 32: the sm_80 kernel; the others Hopper's
@pytest.mark.parametrize("seqlens", [(7, 63), (130, 129), (257, 700), (9, 1000)])  # (9, 1000): split-KV decode
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(40, 5), softcap=5.0)],
                         ids=["plain", "causal", "window-softcap"])
def test_bias_and_mask(rng, dtype, headdim, seqlens, opts):
    """Additive bias and boolean mask (issue 23) in every broadcast form, with the other options,
    against the reference; GQA (4 query heads on 2 K/V heads); rows that see no key give 0 and
    an LSE of -inf; NaN-poisoned out."""
    sq, sk = seqlens
    q = _rand(rng, (2, sq, 4, headdim), dtype, 3.0)
    k, v = _rand(rng, (2, sk, 2, headdim), dtype), _rand(rng, (2, sk, 2, headdim), dtype)
    for form, mods in _bias_mask_forms(rng, 2, 4, sq, sk).items():
        _check_mods(q, k, v, mods, form, **opts)


def _check_mods(q, k, v, mods, what, layout="bshd", **opts):
    """cuflash on the GPU with bias/mask (CuPy arrays, any strides) into a NaN-poisoned out=,
    against the reference on NumPy copies of them."""
    cp = _cp()
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    shape = list(q.shape)
    shape[-1] = v.shape[-1]
    out = cp.full(tuple(shape), np.nan, dtype=q.dtype)
    _, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, layout=layout, **opts, **mods)
    host = {n: cp.asnumpy(x) for n, x in mods.items()}
    ref_out, ref_lse = attention_ref(q, k, v, layout=layout, **opts, **host)
    naive_out, naive_lse = naive_attention(q, k, v, return_lse=True, layout=layout, **opts, **host)
    assert_exact(out.get(), ref_out, naive_out, f"out ({what})")
    assert_exact(lse.get(), ref_lse, naive_lse, f"lse ({what})")


def test_bias_and_mask_bhsd_layout_and_huge_bias(rng):
    """bhsd inputs take the same (batch, heads, seqlen_q, seqlen_k) bias; a bias of float32's
    lowest (the Hugging Face mask value) hides keys without NaN."""
    q = _rand(rng, (2, 4, 70, 64), np.float16, 3.0)
    k, v = _rand(rng, (2, 4, 90, 64), np.float16), _rand(rng, (2, 4, 90, 64), np.float16)
    lowest = np.finfo(np.float32).min
    bias = np.where(rng.random((2, 1, 70, 90)) < 0.3, lowest, 0.0).astype(np.float32)
    bias[0, 0, 3] = lowest  # a row whose every key carries it: the mean of V, lse = lowest + ln 90
    bias[1, 0, 5, :] = 3e38  # near float32's largest (times log2 e it would overflow)
    _check_mods(q, k, v, dict(bias=_cp().asarray(bias)), "lowest-float bias", layout="bhsd")
    for opts in (dict(alibi_slopes=True, causal=True), dict(seqlens_k=True, causal="top_left")):
        qs, ks, vs = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        gpu_opts = dict(opts)
        if opts.get("alibi_slopes"):
            gpu_opts["alibi_slopes"] = opts["alibi_slopes"] = rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32)
            gpu_opts["alibi_slopes"] = _cp().asarray(opts["alibi_slopes"])
        if opts.get("seqlens_k"):
            opts["seqlens_k"] = np.array([90, 33], dtype=np.int32)
            gpu_opts["seqlens_k"] = _cp().asarray(opts["seqlens_k"])
        mods = dict(bias=_cp().asarray(rng.standard_normal((1, 4, 70, 90)).astype(np.float32)),
                    mask=_cp().asarray(rng.random((70, 90)) < 0.6))
        _check_mods_opts(qs, ks, vs, mods, opts, gpu_opts)


def _check_mods_opts(q, k, v, mods, opts, gpu_opts):
    """_check_mods where options differ between the GPU call and the reference (index arrays)."""
    cp = _cp()
    out, lse = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), return_lse=True, **gpu_opts, **mods)
    host = {n: cp.asnumpy(x) for n, x in mods.items()}
    ref_out, ref_lse = attention_ref(q, k, v, **opts, **host)
    naive_out, naive_lse = naive_attention(q, k, v, return_lse=True, **opts, **host)
    assert_exact(out.get(), ref_out, naive_out, f"out ({sorted(opts)})")
    assert_exact(lse.get(), ref_lse, naive_lse, f"lse ({sorted(opts)})")


@pytest.mark.parametrize("headdim", [32, 64, 128, 256])  # 32: the sm_80 kernel; the others Hopper's
@pytest.mark.parametrize("seqlens", [(7, 63), (130, 257), (9, 1000)])  # (9, 1000): split-KV decode
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(40, 5), softcap=5.0)],
                         ids=["plain", "causal", "window-softcap"])
def test_dropout(rng, headdim, seqlens, opts):
    """Dropout (issue 23) against the reference given cuflash.dropout_mask's keep-mask: the kernels
    draw the same mask (philox.cuh); the LSE ignores dropout; the same seed gives the same bits,
    another offset another mask; a bias and a mask with it."""
    cp = _cp()
    sq, sk = seqlens
    q = _rand(rng, (2, sq, 4, headdim), np.float16, 3.0)
    k, v = _rand(rng, (2, sk, 2, headdim), np.float16), _rand(rng, (2, sk, 2, headdim), np.float16)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    for seed, rate in (((2**64 - 5, 2**40 + 3), 0.3), (7, 0.9)):
        keep = cuflash.dropout_mask(seed, (2, 4, sq, sk), rate)
        out = cp.full((2, sq, 4, headdim), np.nan, dtype=np.float16)
        _, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, dropout_p=rate, dropout_seed=seed, **opts)
        ref_out, ref_lse = attention_ref(q, k, v, dropout_p=rate, dropout_keep=keep, **opts)
        naive_out, naive_lse = naive_attention(q, k, v, return_lse=True, dropout_p=rate, dropout_keep=keep, **opts)
        assert_exact(out.get(), ref_out, naive_out, f"out (seed {seed})")
        assert_exact(lse.get(), ref_lse, naive_lse, f"lse (seed {seed})")
        again = cuflash.attention(qd, kd, vd, dropout_p=rate, dropout_seed=seed, **opts)
        assert cp.array_equal(again.view(cp.uint16), out.view(cp.uint16))
        other = cuflash.attention(qd, kd, vd, dropout_p=rate, dropout_seed=(7, 1), **opts)  # another offset
        assert not cp.array_equal(other.view(cp.uint16), out.view(cp.uint16))
    plain = cuflash.attention(qd, kd, vd, **opts)
    assert cp.array_equal(cuflash.attention(qd, kd, vd, dropout_p=0.0, dropout_seed=3, **opts).view(cp.uint16),
                          plain.view(cp.uint16))
    bias = rng.standard_normal((1, 4, sq, sk)).astype(np.float32)
    mask = rng.random((sq, sk)) < 0.8
    keep = cuflash.dropout_mask((11, 2), (2, 4, sq, sk), 0.2)
    got = cuflash.attention(qd, kd, vd, dropout_p=0.2, dropout_seed=(11, 2), bias=cp.asarray(bias), mask=cp.asarray(mask),
                            **opts)
    mods = dict(dropout_p=0.2, dropout_keep=keep, bias=bias, mask=mask, **opts)
    assert_exact(got.get(), attention_ref(q, k, v, **mods)[0], naive_attention(q, k, v, **mods), "out (with bias, mask)")


def test_dropout_varlen_numbers_each_sequence_from_zero(rng):
    """attention_varlen's dropout: the keep-mask of (sequence, head, position within it), each
    sequence as a batch of one of attention() with dropout_seed's first batch entry b."""
    cp = _cp()
    lengths = [1, 70, 0, 129]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (_rand(rng, (int(cu[-1]), 4, 64), np.float16, 3.0 if n == 0 else 1.0) for n in range(3))
    out = cuflash.attention_varlen(*(cp.asarray(x) for x in (q, k, v)), cp.asarray(cu), cp.asarray(cu),
                                   max_seqlen_q=129, max_seqlen_k=129, causal=True, dropout_p=0.25, dropout_seed=5).get()
    want = cuflash.attention_varlen(q, k, v, cu, cu, causal=True, dropout_p=0.25, dropout_seed=5)  # the NumPy path
    for b, n in enumerate(lengths):
        if n:
            rows = slice(cu[b], cu[b + 1])
            keep = cuflash.dropout_mask(5, (b + 1, 4, n, n), 0.25)[b:]
            ref = attention_ref(q[None, rows], k[None, rows], v[None, rows], causal=True, dropout_p=0.25, dropout_keep=keep)[0][0]
            naive = naive_attention(q[None, rows], k[None, rows], v[None, rows], causal=True, dropout_p=0.25,
                                    dropout_keep=keep)[0]
            assert_exact(out[rows], ref, naive, f"out of sequence {b}")
            assert_exact(want[rows], ref, naive, f"the NumPy path's out of sequence {b}")  # (the same mask there)


def test_bhsd_layout(rng):
    q = _rand(rng, (2, 4, 70, 64), ml_dtypes.bfloat16, 5.0)
    k, v = _rand(rng, (2, 4, 90, 64), ml_dtypes.bfloat16), _rand(rng, (2, 4, 90, 64), ml_dtypes.bfloat16)
    _check(q, k, v, layout="bhsd", causal=True)


def test_strided_inputs_are_read_correctly(rng):
    cp = _cp()
    qkv = _rand(rng, (2, 100, 3, 4, 64), np.float16, 2.0)  # packed (B, S, 3, H, D)
    d = cp.asarray(qkv)
    out = cuflash.attention(d[:, :, 0], d[:, :, 1], d[:, :, 2], causal=True)
    ref, _ = attention_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    naive = naive_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert_exact(out.get(), ref, naive, "packed qkv")

    # Broadcast heads (stride 0), a transposed head axis, and a last axis that is not contiguous.
    base_k = _rand(rng, (2, 50, 1, 64), np.float16)
    k_b = cp.broadcast_to(cp.asarray(base_k), (2, 50, 4, 64))
    q = _rand(rng, (2, 4, 30, 64), np.float16)
    q_t = cp.asarray(q).transpose(0, 2, 1, 3)  # (B, S, H, D) view of a bhsd array
    v_nc = cp.asarray(_rand(rng, (2, 50, 4, 128), np.float16))[..., ::2]  # stride 2 on the last axis
    out = cuflash.attention(q_t, k_b, v_nc)
    qn, kn, vn = q.transpose(0, 2, 1, 3), np.broadcast_to(base_k, (2, 50, 4, 64)), v_nc.get()
    ref, _ = attention_ref(qn, kn, vn)
    assert_exact(out.get(), ref, naive_attention(qn, kn, vn), "strided")

    # A misaligned slice (offset by one element) must be copied, not misread.
    big = cp.asarray(_rand(rng, (1, 40, 2, 65), np.float16))
    qm = big[..., 1:]
    out = cuflash.attention(qm, qm, qm)
    qh = qm.get()
    ref, _ = attention_ref(qh, qh, qh)
    assert_exact(out.get(), ref, naive_attention(qh, qh, qh), "misaligned")


def test_out_buffer_with_strides(rng):
    cp = _cp()
    q = _rand(rng, (1, 33, 2, 64), np.float16)
    big = cp.full((1, 33, 2, 128), np.nan, dtype=np.float16)
    out_view = big[..., :64]
    cuflash.attention(cp.asarray(q), cp.asarray(q), cp.asarray(q), out=out_view)
    ref, _ = attention_ref(q, q, q)
    assert_exact(out_view.get(), ref, naive_attention(q, q, q), "out view")
    assert cp.isnan(big[..., 64:]).all()  # nothing written outside the output


def test_repeated_calls_are_bitwise_identical(rng):
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, (2, 300, 4, 128), ml_dtypes.bfloat16)) for _ in range(3))
    a = cuflash.attention(q, k, v, causal=True)
    b = cuflash.attention(q, k, v, causal=True)
    assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))


def test_long_sequence_4097(rng):
    q = _rand(rng, (1, 4097, 2, 128), np.float16)
    k, v = _rand(rng, (1, 4097, 2, 128), np.float16), _rand(rng, (1, 4097, 2, 128), np.float16)
    _check(q, k, v, causal=True)


def test_128k_tokens_without_score_matrix(rng):
    """128k x 128k scores would take 32 GiB in fp16 x 2 (fwd); check rows against the reference."""
    cp = _cp()
    n, d = 131072, 64
    q = _rand(rng, (1, n, 1, d), np.float16)
    k, v = _rand(rng, (1, n, 1, d), np.float16), _rand(rng, (1, n, 1, d), np.float16)
    free_before = cp.cuda.Device().mem_info[0]
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True)
    cp.cuda.Device().synchronize()
    assert free_before - cp.cuda.Device().mem_info[0] < 1 << 30
    rows = np.r_[0:16, n // 2: n // 2 + 16, n - 16:n]
    ref, ref_lse = attention_ref(q[:, rows], k, v)
    naive, naive_lse = naive_attention(q[:, rows], k, v, return_lse=True)
    assert_exact(out.get()[:, rows], ref, naive, "out rows")
    assert_exact(lse.get()[:, :, rows], ref_lse, naive_lse, "lse rows")


def test_grid_folds_many_batch_heads(rng):
    q = _rand(rng, (70000, 2, 1, 32), np.float16)
    k, v = _rand(rng, (70000, 3, 1, 32), np.float16), _rand(rng, (70000, 3, 1, 32), np.float16)
    _check(q, k, v)


def test_runs_on_current_stream(rng):
    cp = _cp()
    q = _rand(rng, (1, 257, 2, 64), np.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cuflash.attention(cp.asarray(q), cp.asarray(q), cp.asarray(q), causal=True)
    stream.synchronize()
    ref, _ = attention_ref(q, q, q, causal=True)
    assert_exact(out.get(), ref, naive_attention(q, q, q, causal=True), "stream")


def test_dlpack_inputs_from_torch(rng):
    torch = pytest.importorskip("torch")
    q = _rand(rng, (1, 40, 2, 64), np.float16)
    t = torch.from_numpy(q).cuda()
    out = cuflash.attention(t, t, t)
    assert isinstance(out, _cp().ndarray)
    ref, _ = attention_ref(q, q, q)
    assert_exact(out.get(), ref, naive_attention(q, q, q), "torch input")


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("shape_axis", [((3, 1000), -1), ((5, 7, 33), 1), ((2, 70000), 1), ((4, 1), 0),
                                        ((5, 7, 33), None), ((5, 7, 33), (2, 0))])
def test_softmax_kernel(rng, dtype, shape_axis):
    shape, axis = shape_axis
    x = (rng.standard_normal(shape) * 5).astype(dtype)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    ref = e / e.sum(axis=axis, keepdims=True)
    got = cuflash.softmax(_cp().asarray(x), axis=axis).get().astype(np.float64)
    naive = ref.astype(dtype).astype(np.float64)
    assert np.abs(got - ref).max() <= 2 * np.abs(naive - ref).max() + 1e-5


def test_softmax_kernel_all_masked_row_is_zero():
    cp = _cp()
    x = cp.full((2, 9), -np.inf, dtype=cp.float32)
    x[1, 3] = 0.0
    y = cuflash.softmax(x).get()
    assert (y[0] == 0).all() and y[1, 3] == 1.0 and not np.isnan(y).any()


@pytest.mark.parametrize("headdim", [64, 59, 128])  # 59: out is written through a padded copy
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("max_given", [False, True])
def test_varlen_rows_of_no_sequence_are_cleared(rng, headdim, index_dtype, max_given):
    """attention_varlen writes every row of a NaN-poisoned out=: each sequence exact (empty ones,
    Sq > Sk, one key), rows past cu_seqlens_q[-1] out = 0 and lse = -inf, on repeated calls."""
    cp = _cp()
    cu_q = np.array([0, 0, 40, 41, 140, 150], dtype=index_dtype)
    cu_k = np.array([0, 7, 7, 8, 300, 301], dtype=index_dtype)
    total_q, total_k = 171, 310  # 21 rows past cu_q[-1], 9 keys past cu_k[-1]
    for _ in range(2):
        q = _rand(rng, (total_q, 4, headdim), ml_dtypes.bfloat16, 3.0)
        k, v = (_rand(rng, (total_k, 2, headdim), ml_dtypes.bfloat16) for _ in range(2))
        out = cp.full((total_q, 4, headdim), np.nan, dtype=q.dtype)
        extra = dict(max_seqlen_q=100, max_seqlen_k=292) if max_given else {}
        res, lse = cuflash.attention_varlen(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu_q),
                                            cp.asarray(cu_k), causal=True, out=out, return_lse=True, **extra)
        assert res is out
        got, lse = out.get(), lse.get()
        for b in range(len(cu_q) - 1):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if cu_q[b + 1] == cu_q[b]:
                continue
            args = [x[None, s] for x, s in ((q, qs), (k, ks), (v, ks))]
            ref = attention_ref(*args, causal=True)
            naive = naive_attention(*args, causal=True, return_lse=True)
            assert_exact(got[None, qs], ref[0], naive[0], f"out of sequence {b}")
            assert_exact(lse[None, :, qs], ref[1], naive[1], f"lse of sequence {b}")
        assert not got[cu_q[-1]:].astype(np.float32).any()
        assert np.all(lse[:, cu_q[-1]:] == -np.inf)


@pytest.mark.parametrize("headdim", [32, 64])  # 32: the sm_80 forward and its tail kernel; 64: the Hopper forward's blocks
def test_varlen_long_tail_with_one_tile(rng, headdim):
    """One 10-token sequence in a 20000-row packed buffer: one query tile, so most blocks of the
    Hopper forward have no tile and only write rows past cu_seqlens_q[-1] (varlen_tail.cuh); every
    row of a NaN-poisoned out= is written, the sequence exact."""
    cp = _cp()
    total_q, total_k = 20000, 16
    q = _rand(rng, (total_q, 1, headdim), ml_dtypes.bfloat16)
    k, v = (_rand(rng, (total_k, 1, headdim), ml_dtypes.bfloat16) for _ in range(2))
    cu_q, cu_k = np.array([0, 10], np.int32), np.array([0, 12], np.int32)
    out = cp.full((total_q, 1, headdim), np.nan, dtype=q.dtype)
    cuflash.attention_varlen(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu_q), cp.asarray(cu_k),
                             max_seqlen_q=10, max_seqlen_k=12, out=out, return_lse=True)
    got = out.get()
    args = [x[None, :n] for x, n in ((q, 10), (k, 12), (v, 12))]
    assert_exact(got[None, :10], attention_ref(*args)[0], naive_attention(*args), "out of the sequence")
    assert not got[10:].astype(np.float32).any()


def _gpu_attention(q, k, v, **opts):
    cp = _cp()
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **opts)
    return out.get(), lse.get()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 70])  # 1, 3: the split-KV decode kernel (8 splits here); 70: the prefill kernel
def test_nan_score_rows_have_nan_out_and_lse(rng, dtype, seqlen_q):
    """A NaN score is not an empty row (conventions): that row's out and LSE are NaN, not 0 and
    -inf (which merge_states would read as "no key"), as on the NumPy path; other rows exact."""
    q = _rand(rng, (2, seqlen_q, 4, 64), dtype, 3.0)
    k, v = _rand(rng, (2, 2000, 4, 64), dtype), _rand(rng, (2, 2000, 4, 64), dtype)
    ref_out, ref_lse = attention_ref(q, k, v)
    naive_out, naive_lse = naive_attention(q, k, v, return_lse=True)
    q[1, -1, 2, 5] = np.nan
    out, lse = _gpu_attention(q, k, v)
    assert np.isnan(out[1, -1, 2].astype(np.float32)).all() and np.isnan(lse[1, 2, -1])
    out[1, -1, 2], lse[1, 2, -1] = ref_out[1, -1, 2], ref_lse[1, 2, -1]
    assert_exact(out, ref_out, naive_out, "out")
    assert_exact(lse, ref_lse, naive_lse, "lse")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("shape", [(3, 1), (70, 60), (200, 100)], ids=lambda s: f"{s[0]}x{s[1]}")  # decode, prefill kernels
def test_empty_rows_stay_zero_next_to_non_finite_values(rng, bad, shape):
    """Causal (bottom-right) with Sq > Sk: the first Sq - Sk rows see no key and give exactly 0
    and -inf (conventions), even with a non-finite V or K at the keys they cannot see, whose
    products reach their accumulators as 0 * inf."""
    sq, sk = shape
    q = _rand(rng, (1, sq, 2, 64), np.float16, 3.0)
    k, v = _rand(rng, (1, sk, 2, 64), np.float16), _rand(rng, (1, sk, 2, 64), np.float16)
    empty = sq - sk
    for name in ("v", "k"):
        kb, vb = k.copy(), v.copy()
        (vb if name == "v" else kb)[0, sk // 2, 1, :3] = bad
        with np.errstate(invalid="ignore"):
            out, lse = _gpu_attention(q, kb, vb, causal=True)
        assert (out[0, :empty].astype(np.float32) == 0).all(), name
        assert np.isneginf(lse[0, :, :empty]).all(), name


def test_unbatched_and_array_like_inputs_on_the_gpu(rng):
    """3-D CuPy inputs run as a batch of one on the GPU too (issue 20), forward and backward."""
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, s, np.float16, 2.0)) for s in ((70, 4, 64), (90, 2, 64), (90, 2, 64)))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = cuflash.attention(q[None], k[None], v[None], causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 70)
    assert bool((out == ref[0]).all()) and bool((lse == ref_lse[0]).all())
    grads = cuflash.attention_backward(out, q, k, v, out, lse, causal=True, deterministic=True)
    ref_grads = cuflash.attention_backward(ref, q[None], k[None], v[None], ref, ref_lse, causal=True, deterministic=True)
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape[1:] and bool((g == r[0]).all())
