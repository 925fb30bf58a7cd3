"""float64 attention on the GPU (issue 24; kernels/flash_fwd.cu's and flash_bwd.cu's FP64 tensor-core forms).

Judged by issue 24's float64 rule: max |gpu - ref| <= 2 max |naive float64 - ref| + 1e-12 max |ref|,
for out and the LSE, where ref is attention computed in extended precision (NumPy's longdouble:
80-bit on x86, so float64's own errors are visible against it) and naive is plain float64
attention (cuflash.reference.naive_attention).  Every output is NaN-poisoned first.  What the
float64 kernel does not cover yet must raise NotAvailableOnGPU naming it, before anything runs.
"""

import numpy as np
import pytest

import cuflash
from cuflash import _arrays, _gpu, _kernels
from cuflash import reference as R

from .conftest import modifier_arguments, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

HEADDIMS = [1, 8, 32, 40, 59, 64, 72, 96, 100, 128]


def _cp():
    return _arrays.cupy_module()


def _rand(rng, shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def _ref_extended(q, k, v, layout="bshd", **opts):
    """(out, lse) of attention in np.longdouble, through the reference's own score pipeline (bias
    and masks in it; dropout given its keep-mask)."""
    q, k, v, o = R._prepare(q, k, v, layout, dict(opts), convert=lambda x: R._host(x).astype(np.longdouble))
    s, _ = R._scores(q, k, o)
    probs, lse = R._softmax_rows(s)
    return R._heads_major(o.dropped(probs) @ R._repeat_heads(v, o), layout), lse


def _assert_f64_rule(actual, ref, naive, name, magnitude=0.0):
    """The float64 rule; ``magnitude`` (the gradients: the largest |ref| of dq, dk and dv) raises the
    floor's max |ref| for an array that is 0 throughout (dq, dk of a row with one key: dS = P (dP - D)
    = 0, where a float64 D = rowsum(dO O) summed in another order than dP leaves ~1e-16, and
    1e-12 * 0 would ask for exact cancellation)."""
    actual, ref, naive = (np.asarray(x, dtype=np.longdouble) for x in (actual, ref, naive))
    same_inf = np.isinf(ref) & (actual == ref)  # empty rows: -inf LSE
    assert np.array_equal(np.isinf(actual), np.isinf(ref)) and same_inf.sum() == np.isinf(ref).sum(), f"{name}: infinities differ"
    finite = np.isfinite(ref)
    assert np.isfinite(actual[finite]).all(), f"{name}: non-finite values where the reference is finite"
    if not finite.any():
        return
    err = float(np.abs(actual[finite] - ref[finite]).max())
    naive_err = float(np.abs(naive[finite] - ref[finite]).max())
    scale = float(np.abs(ref[finite]).max())
    allowed = 2 * naive_err + 1e-12 * (scale if scale > 0 else magnitude)
    assert err <= allowed, f"{name}: max |gpu - ref| = {err:.3g} > allowed {allowed:.3g} (naive float64: {naive_err:.3g})"


def _check(q, k, v, *, layout="bshd", **opts):
    """cuflash on the GPU (float64, NaN-poisoned out=) against the extended-precision reference."""
    cp = _cp()
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    shape = list(q.shape)
    shape[-1] = v.shape[-1]
    out = cp.full(tuple(shape), np.nan, dtype=np.float64)
    res, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, layout=layout, **opts)
    assert res is out and lse.dtype == np.float64
    ref_out, ref_lse = _ref_extended(q, k, v, layout=layout, **opts)
    naive_out, naive_lse = R.naive_attention(q, k, v, layout=layout, return_lse=True, **opts)
    _assert_f64_rule(out.get(), ref_out, naive_out, "out")
    _assert_f64_rule(lse.get(), ref_lse, naive_lse, "lse")
    return out, lse


@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlens", [(1, 1), (7, 63), (65, 129), (129, 65), (63, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_headdims_and_lengths(rng, headdim, seqlens, causal, kernels_run):
    sq, sk = seqlens
    q = _rand(rng, (2, sq, 3, headdim), 3.0)
    k, v = _rand(rng, (2, sk, 3, headdim)), _rand(rng, (2, sk, 3, headdim))
    _check(q, k, v, causal=causal)
    assert kernels_run and all(n.startswith("cuflash_fwd_fp64_") for n in kernels_run), kernels_run


@pytest.mark.parametrize("smem_kb, headdim, tile", [(99, 64, "_bm64_bn32_w4_"), (99, 96, "_bm64_bn16_w4_"), (99, 128, "_bm32_bn16_w2_"),
                                                    (163, 96, "_bm128_bn16_w8_"), (163, 128, "_bm64_bn16_w4_")])
def test_tiles_of_small_shared_memory_gpus(rng, headdim, smem_kb, tile, kernels_run, monkeypatch):
    """The tiles that GPUs with less shared memory a block take (99 KB: sm_86/89; 163 KB: the A100)."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: smem_kb * 1024)
    q = _rand(rng, (2, 70, 2, headdim), 3.0)
    k, v = _rand(rng, (2, 129, 2, headdim)), _rand(rng, (2, 129, 2, headdim))
    _check(q, k, v, causal=True)
    _check(q, k, v, window_size=(9, 4), softcap=3.0)
    assert all(tile in n for n in kernels_run), kernels_run


@pytest.mark.parametrize("headdim", [129, 160, 192, 200, 256])
@pytest.mark.parametrize("smem_kb", [227, 99])
def test_head_dims_past_128_split_o_over_two_warps(rng, headdim, smem_kb, kernels_run, monkeypatch):
    """Past d128 two warps share each 16-row slab, each with half of O's columns (TileConfig.col_split),
    on the H200's shared memory and on a 99 KB GPU's tiles."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: smem_kb * 1024)
    q = _rand(rng, (2, 77, 2, headdim), 2.0)
    k, v = _rand(rng, (2, 130, 1, headdim)), _rand(rng, (2, 130, 1, headdim))
    _check(q, k, v, causal=True)
    _check(q, k, v, softcap=3.0, window_size=(40, 7))
    _check(q, k, _rand(rng, (2, 130, 1, 136)))  # Dv != Dqk
    assert kernels_run and all("_cs2" in n for n in kernels_run), kernels_run
    # 64 x 32 (8 warps) to d192, 64 x 16 past it, on 99 KB 32 x 16 (4 warps) to d192 and 16 x 16 (2 warps, one row slab) past it
    tile = ("_bm64_bn32_w8_" if headdim <= 192 else "_bm64_bn16_w8_") if smem_kb == 227 else "_bm16_bn16_w2_" if headdim > 192 else "_bm32_bn16_w4_"
    assert all(tile in n for n in kernels_run), kernels_run


@pytest.mark.parametrize("causal", [False, True])
def test_long_rows(rng, causal):
    q, k, v = (_rand(rng, (1, 1000, 2, 128), 2.0 if i == 0 else 1.0) for i in range(3))
    _check(q, k, v, causal=causal)


@pytest.mark.parametrize("headdim", [64, 128, 192])
@pytest.mark.parametrize("magnitude", [1e2, 1e3, 1e5])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(bias=True)], ids=["plain", "causal", "bias"])
def test_scores_of_any_magnitude(rng, headdim, magnitude, opts):
    """Scores far from 1: q and k scaled so that q.k reaches ~1e5, ~1e7 and ~1e11 (past 2^30 in log2 units, where
    the row's P all underflow unless the max subtracted is within a unit of the row's max: the float64
    softmax may take the max from the scores' high words only where that is so, perf-notes f17)."""
    cp = _cp()
    q = _rand(rng, (1, 65, 2, headdim), magnitude)
    k, v = _rand(rng, (1, 129, 2, headdim), magnitude), _rand(rng, (1, 129, 2, headdim))
    if not opts.get("bias"):
        _check(q, k, v, **opts)
        return
    # the modifier kernels (scores and the max in natural units), a float64 bias of the same size
    ref_opts, run = modifier_arguments(q, k, 0.0, (21, 4), dict(bias=_rand(rng, (1, 2, 65, 129), magnitude**2)))
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=cp.full(q.shape, np.nan),
                                 return_lse=True, **run)
    naive_out, naive_lse = R.naive_attention(q, k, v, return_lse=True, **ref_opts)
    ref_out, ref_lse = _ref_extended(q, k, v, **ref_opts)
    _assert_f64_rule(out.get(), ref_out, naive_out, "out")
    _assert_f64_rule(lse.get(), ref_lse, naive_lse, "lse")


# ALiBi slopes that float32 cannot hold: the float64 kernels read them in double (seqinfo.cuh's alibi_slope)
SLOPES = np.array([0.3, 0.7, 1.1, 0.05])
SLOPES_2D = np.array([[0.3, 0.7, 1.1, 0.05], [0.01, 0.9, 0.45, 2.3]])


def _ids(opts):
    return "-".join(f"{k}={'array' if isinstance(v, np.ndarray) else v}" for k, v in opts.items())


@pytest.mark.parametrize("opts", [
    dict(window_size=(5, 3)), dict(window_size=(0, 0), causal=True), dict(softcap=4.0), dict(softcap=2.0, causal=True),
    dict(softmax_scale=-0.3), dict(softmax_scale=0.0), dict(causal=True, window_size=(20, -1)),
    dict(alibi_slopes=SLOPES, causal=True), dict(alibi_slopes=SLOPES_2D, softcap=3.0, window_size=(30, 5)),
], ids=_ids)
def test_options(rng, opts):
    q = _rand(rng, (2, 70, 4, 64), 4.0)
    k, v = _rand(rng, (2, 90, 2, 64)), _rand(rng, (2, 90, 2, 64))  # GQA: 2 query heads per K/V head
    _check(q, k, v, **opts)


def test_seqlens_k_value_headdim_and_empty_rows(rng):
    q = _rand(rng, (3, 33, 2, 64), 3.0)
    k, v = _rand(rng, (3, 77, 2, 64)), _rand(rng, (3, 77, 2, 40))  # Dv != Dqk
    k[1, 50:] = np.nan  # past seqlens_k: never read
    _, lse = _check(q, k, v, seqlens_k=np.array([77, 50, 0], dtype=np.int32))
    assert bool((lse[2] == -np.inf).all())  # no key: empty rows
    _check(q, _rand(rng, (3, 77, 2, 64)), v, window_size=(0, 0))


def test_layout_bhsd_and_strided_inputs(rng):
    q, k, v = (_rand(rng, (2, 3, 100, 64)) for _ in range(3))
    _check(q, k, v, layout="bhsd", causal=True)
    big = _rand(rng, (2, 57, 4, 96))
    cp = _cp()
    qd = cp.asarray(big)[:, :, ::2, :64]  # strided heads and a head dim that is a prefix of the row
    kd, vd = cp.asarray(big[:, :, 1::2, :64]), cp.asarray(big[:, :, 1::2, 32:])
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, causal=True)
    ref_out, ref_lse = _ref_extended(qd.get(), kd.get(), vd.get(), causal=True)
    naive_out, naive_lse = R.naive_attention(qd.get(), kd.get(), vd.get(), return_lse=True, causal=True)
    _assert_f64_rule(out.get(), ref_out, naive_out, "out")
    _assert_f64_rule(lse.get(), ref_lse, naive_lse, "lse")


def test_repeated_calls_are_bitwise_identical(rng):
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, (2, 300, 2, 128))) for _ in range(3))
    first = cuflash.attention(q, k, v, causal=True)
    for _ in range(3):
        assert bool((cuflash.attention(q, k, v, causal=True).view(cp.uint64) == first.view(cp.uint64)).all())


def test_what_is_not_covered_is_refused_before_running(rng, monkeypatch):
    """What the float64 kernels lack (gradients past d192 on 99 KB GPUs) raises NotAvailableOnGPU
    naming it, before anything is written, bias/mask/dropout or not."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: 99 * 1024)
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, (1, 20, 2, 256))) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    grads = [cp.full(x.shape, 7.0) for x in (q, k, v)]
    for mods in (dict(), dict(bias=cp.zeros((20, 20)), mask=cp.ones((20, 20), dtype=bool), dropout_p=0.1, dropout_seed=1)):
        with pytest.raises(_gpu.NotAvailableOnGPU, match="float64") as info:
            cuflash.attention_backward(q, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], **mods)
        assert "head dims past 192" in str(info.value), str(info.value)
    assert all(bool((g == 7.0).all()) for g in grads)


# The backward (flash_bwd.cu's FP64 form).

BWD_HEADDIMS = [1, 8, 32, 40, 64]


def _grads_extended(monkeypatch, dout, q, k, v, **opts):
    """attention_backward_ref's gradients computed in np.longdouble (its own formulas)."""
    ld = lambda x: R._host(x).astype(np.longdouble)  # noqa: E731
    prepare = R._prepare
    with monkeypatch.context() as m:
        m.setattr(R, "_prepare", lambda q, k, v, layout, options, convert=ld: prepare(q, k, v, layout, options, convert=ld))
        m.setattr(R, "_f64", ld)
        return R.attention_backward_ref(dout, q, k, v, **opts)


def _check_backward(monkeypatch, q, k, v, dout, deterministic=False, **opts):
    """Gradients on the GPU (NaN-poisoned dq, dk, dv) against the extended-precision reference."""
    cp = _cp()
    qd, kd, vd, dod = (cp.asarray(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, **opts)
    grads = [cp.full(x.shape, np.nan) for x in (q, k, v)]
    res = cuflash.attention_backward(dod, qd, kd, vd, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                     deterministic=deterministic, **opts)
    assert all(a is b for a, b in zip(res, grads))
    ref = _grads_extended(monkeypatch, dout, q, k, v, **opts)
    naive = R.naive_attention_backward(dout, q, k, v, **opts)
    magnitude = max(float(np.nanmax(np.abs(np.asarray(r, dtype=np.float64)), initial=0.0)) for r in ref)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        _assert_f64_rule(g.get(), r, n, name, magnitude)
    return grads


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
@pytest.mark.parametrize("seqlens", [(1, 1), (7, 63), (65, 129), (129, 65)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_headdims_and_lengths(rng, headdim, seqlens, causal, deterministic, kernels_run, monkeypatch):
    """Both dQ schemes: added atomically (in float64) by the dK/dV kernel, the default, or its own kernel."""
    sq, sk = seqlens
    q = _rand(rng, (2, sq, 2, headdim), 2.0)
    k, v = _rand(rng, (2, sk, 2, headdim)), _rand(rng, (2, sk, 2, headdim))
    _check_backward(monkeypatch, q, k, v, _rand(rng, (2, sq, 2, headdim)), causal=causal, deterministic=deterministic)
    backward = [n for n in kernels_run if n.startswith("cuflash_bwd_fp64_")]
    assert backward and all(n.endswith("_adq") != deterministic for n in backward), kernels_run
    assert any(n.startswith("cuflash_bwd_dsum_fp64") for n in kernels_run), kernels_run


@pytest.mark.parametrize("opts", [
    dict(window_size=(5, 3)), dict(softcap=4.0, causal=True), dict(softmax_scale=-0.3),
    dict(seqlens_k=np.array([90, 41], dtype=np.int32), causal=True),
    dict(alibi_slopes=SLOPES, causal=True), dict(alibi_slopes=SLOPES_2D, softcap=3.0),
], ids=["window", "softcap", "negative-scale", "seqlens_k", "alibi", "alibi-2d-softcap"])
def test_backward_options_gqa_and_value_headdim(rng, opts, kernels_run, monkeypatch):
    q = _rand(rng, (2, 70, 4, 64), 3.0)
    k, v = _rand(rng, (2, 90, 2, 64)), _rand(rng, (2, 90, 2, 40))  # GQA, Dv != Dqk
    _check_backward(monkeypatch, q, k, v, _rand(rng, (2, 70, 4, 40)), **opts)


@pytest.mark.parametrize("headdim", [72, 96, 128, 160, 192, 200, 256])
@pytest.mark.parametrize("smem_kb", [227, 99])
def test_backward_past_d64_splits_columns(rng, headdim, smem_kb, kernels_run, monkeypatch):
    """Past d64 several warps share each 16-row slab of the dQ and dK/dV kernels, each with its
    share of the output's columns (bwd_variant's col_split: 2 to d128, 4 at d160/d224, 8 at d192/d256; 4 in
    float64 d192's atomic-dQ kernel, whose 16-query form has 2 slabs of 4 warps), with
    2 slabs a block where shared memory holds them; a 99 KB GPU stops at d192 (a slab of d224 takes
    116 KB).  d160 and d224 once took 8 warps of 20 and 28 columns: dq was wrong."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: smem_kb * 1024)
    q = _rand(rng, (2, 45, 2, headdim), 2.0)
    k, v = _rand(rng, (2, 70, 1, headdim)), _rand(rng, (2, 70, 1, headdim - 8))  # GQA, Dv != Dqk
    if smem_kb == 99 and headdim > 192:
        qd = _cp().asarray(q)
        with pytest.raises(_gpu.NotAvailableOnGPU, match="head dims past 192"):
            cuflash.attention_backward(qd, qd, qd, qd, qd, _cp().zeros((2, 2, 45)))
        return
    _check_backward(monkeypatch, q, k, v, _rand(rng, (2, 45, 2, headdim - 8)), causal=True)
    _check_backward(monkeypatch, q, k, v, _rand(rng, (2, 45, 2, headdim - 8)), softcap=3.0, window_size=(20, 5),
                    deterministic=True)
    backward = [n for n in kernels_run if n.startswith("cuflash_bwd_fp64_")]
    split, warps = {(99, 72): (2, 2), (99, 96): (2, 2), (99, 128): (2, 2), (99, 160): (4, 4), (99, 192): (8, 8),
                    (227, 72): (2, 4), (227, 96): (2, 4), (227, 128): (2, 4), (227, 160): (4, 8), (227, 192): (8, 8), (227, 200): (4, 4),
                    (227, 256): (8, 8)}[smem_kb, headdim]
    atomic_split = 4 if (smem_kb, headdim) == (227, 192) else split  # (the 16-query form's split, f14)
    assert backward and all(f"_cs{atomic_split if n.endswith('_adq') else split}" in n for n in backward), backward
    assert all(f"_w{warps}" in n for n in backward if not n.endswith("_adq")), backward  # (the ordered kernels)
    atomic = [n for n in backward if n.endswith("_adq")]  # S and dP summed over the slab's warps where that buffer fits (f9)
    assert all(("_ss_" in n) == (_kernels.bwd_variant("float64", headdim, softcap=False, alibi=False, deterministic=False,
                                                      smem_limit=smem_kb * 1024).name.find("_ss_") > 0) for n in atomic), atomic
    schemes = {True, False} if False in _kernels.wide_bwd_schemes("float64", _kernels.headdim_bucket(headdim), smem_kb * 1024) else {False}
    assert {n.endswith("_adq") for n in backward} == schemes, backward  # (both dQ schemes where the atomic one fits)


def test_backward_through_vjp_and_bitwise_repeatable(rng, kernels_run):
    cp = _cp()
    q, k, v, dout = (cp.asarray(_rand(rng, (2, 200, 2, 64))) for _ in range(4))
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True, deterministic=True)
    first = vjp(dout)
    for g, h in zip(first, cuflash.attention_backward(dout, q, k, v, out, cuflash.attention(q, k, v, causal=True,
                                                                                          return_lse=True)[1],
                                                      causal=True, deterministic=True)):
        assert bool((g.view(cp.uint64) == h.view(cp.uint64)).all())


def test_backward_with_dlse(rng, kernels_run, monkeypatch):
    """The LSE's gradient joins D (dsum -= dlse) in float64."""
    cp = _cp()
    q, k, v, dout = (_rand(rng, (2, 50, 2, 64)) for _ in range(4))
    dlse = _rand(rng, (2, 2, 50))
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, causal=True)
    grads = cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, dlse=cp.asarray(dlse), causal=True)
    ref = _grads_extended(monkeypatch, dout, q, k, v, dlse=dlse, causal=True)
    naive = R.naive_attention_backward(dout, q, k, v, dlse=dlse, causal=True)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        _assert_f64_rule(g.get(), r, n, name)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(6, 2), softcap=3.0, alibi_slopes=SLOPES)],
                         ids=["causal", "window-softcap-alibi"])
def test_varlen_forward_and_backward(rng, opts, kernels_run, monkeypatch):
    """Packed sequences (lengths 0, 1, 37, 64, 90; 3 rows past the last one) against each sequence's
    extended-precision reference with the float64 rule; rows past the last sequence get out 0 and
    LSE -inf, their gradients 0."""
    cp = _cp()
    lens_q, lens_k = [0, 1, 37, 64, 90], [5, 1, 50, 64, 70]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    total_q, total_k = int(cu_q[-1]) + 3, int(cu_k[-1])
    q = _rand(rng, (total_q, 4, 64), 2.0)
    k, v = _rand(rng, (total_k, 2, 64)), _rand(rng, (total_k, 2, 48))  # GQA, Dv != Dqk
    dout = _rand(rng, (total_q, 4, 48))
    dev = {n: cp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    qd, kd, vd, cqd, ckd = (cp.asarray(x) for x in (q, k, v, cu_q, cu_k))
    out = cp.full((total_q, 4, 48), np.nan)
    cuflash.attention_varlen(qd, kd, vd, cqd, ckd, out=out, **dev)
    out, lse = cuflash.attention_varlen(qd, kd, vd, cqd, ckd, out=out, return_lse=True, **dev)
    assert lse.dtype == np.float64
    dq, dk, dv = cuflash.attention_varlen_backward(cp.asarray(dout), qd, kd, vd, out, lse, cqd, ckd, **dev)
    assert any(n.startswith("cuflash_fwd_fp64_") for n in kernels_run) and any(n.startswith("cuflash_bwd_fp64_") for n in kernels_run)
    got = {n: x.get() for n, x in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}
    assert (got["out"][cu_q[-1]:] == 0).all() and np.isneginf(got["lse"][:, cu_q[-1]:]).all()
    assert (got["dq"][cu_q[-1]:] == 0).all()
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:  # no query rows: its keys' gradients stay 0
            assert (got["dk"][ks] == 0).all() and (got["dv"][ks] == 0).all()
            continue
        one = {n: (x[b:b + 1] if n == "alibi_slopes" and x.ndim == 2 else x) for n, x in opts.items()}
        args = (q[None, qs], k[None, ks], v[None, ks])
        ref, ref_lse = _ref_extended(*args, **one)
        naive, naive_lse = R.naive_attention(*args, return_lse=True, **one)
        _assert_f64_rule(got["out"][None, qs], ref, naive, f"out {b}")
        _assert_f64_rule(got["lse"][None, :, qs], ref_lse, naive_lse, f"lse {b}")
        refs = _grads_extended(monkeypatch, dout[None, qs], *args, **one)
        naives = R.naive_attention_backward(dout[None, qs], *args, **one)
        magnitude = max(float(np.abs(np.asarray(r, dtype=np.float64)).max(initial=0.0)) for r in refs)
        for name, g, r, n in zip(("dq", "dk", "dv"), (got["dq"][None, qs], got["dk"][None, ks], got["dv"][None, ks]), refs, naives):
            _assert_f64_rule(g, r, n, f"{name} {b}", magnitude)


# Bias, mask and dropout (the float64 modifier form, CUFLASH_MODS 2: a float64 bias read as double,
# dbias accumulated in float64, the dropout generator skipped for calls without dropout).


def _check_modifiers(rng, monkeypatch, q, k, v, *, deterministic=False, dropout_p=0.0, **opts):
    """Forward and backward (NaN-poisoned out, dq, dk, dv) with bias/mask/dropout against the
    extended-precision reference with the float64 rule, dbias included where there is a bias."""
    cp = _cp()
    ref_opts, run = modifier_arguments(q, k, dropout_p, (21, 4), opts)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out = cp.full(q.shape[:-1] + v.shape[-1:], np.nan)
    out, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, **run)
    assert lse.dtype == np.float64
    ref_out, ref_lse = _ref_extended(q, k, v, **ref_opts)
    naive_out, naive_lse = R.naive_attention(q, k, v, return_lse=True, **ref_opts)
    _assert_f64_rule(out.get(), ref_out, naive_out, "out")
    _assert_f64_rule(lse.get(), ref_lse, naive_lse, "lse")
    dout = _rand(rng, out.shape)
    grads = [cp.full(x.shape, np.nan) for x in (q, k, v)]
    with_bias = "bias" in opts
    res = cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                     deterministic=deterministic, return_dbias=with_bias, **run)
    refs = _grads_extended(monkeypatch, dout, q, k, v, **ref_opts)
    naives = R.naive_attention_backward(dout, q, k, v, **ref_opts)
    magnitude = max(float(np.nanmax(np.abs(np.asarray(r, dtype=np.float64)), initial=0.0)) for r in refs)
    for name, g, r, n in zip(("dq", "dk", "dv", "dbias"), res, refs, naives):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        if name == "dbias":
            assert g.dtype == opts["bias"].dtype, g.dtype
            if g.dtype != np.float64:  # (a 16-bit or float32 bias gets its gradient rounded to its dtype)
                R.assert_exact(g.get(), r, np.asarray(n, dtype=np.float64).astype(g.dtype), name)
                continue
        _assert_f64_rule(g.get(), r, n, name, magnitude)
    return res


def _bias_and_mask(rng, b, h, sq, sk):
    mask = rng.random((b, 1, sq, sk)) < 0.8
    mask[0, 0, 2] = False  # a row that sees no key
    return dict(bias=_rand(rng, (1, h, sq, sk)), mask=mask)  # (a float64 bias: read as double)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("headdim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_bias_mask_dropout_every_headdim(rng, headdim, deterministic, kernels_run, monkeypatch):
    """Every head-dim bucket's modifier form (past d64 2-8 warps share a slab: dS goes into dbias
    once a slab), both dQ schemes; GQA, Sq != Sk, causal.  A float32 cast of the float64 bias
    would miss the float64 rule by orders of magnitude."""
    q = _rand(rng, (2, 70, 4, headdim), 2.0)
    k, v = _rand(rng, (2, 90, 2, headdim)), _rand(rng, (2, 90, 2, headdim))
    _check_modifiers(rng, monkeypatch, q, k, v, deterministic=deterministic, causal=True, **_bias_and_mask(rng, 2, 4, 70, 90))
    _check_modifiers(rng, monkeypatch, q, k, v, deterministic=deterministic, dropout_p=0.2, bias=_rand(rng, (70, 90)))
    names = [n for n in kernels_run if n.startswith(("cuflash_fwd_fp64_", "cuflash_bwd_fp64_"))]
    assert names and all("_modsdrop" in n for n in names), kernels_run


@pytest.mark.parametrize("opts", [
    dict(window_size=(7, 3), softcap=4.0), dict(alibi_slopes=SLOPES, causal=True), dict(softmax_scale=-0.4),
    dict(seqlens_k=np.array([90, 41], dtype=np.int32)), dict(softcap=3.0, alibi_slopes=SLOPES),
], ids=["window-softcap", "alibi-causal", "negative-scale", "seqlens_k", "softcap-alibi"])
def test_bias_mask_dropout_with_every_option(rng, opts, kernels_run, monkeypatch):
    """The score pipeline's order with each option; float32 and float16 biases (read as they are,
    their gradients in their dtype), a key-padding bias of -inf, a stride-0 bias, dropout."""
    q = _rand(rng, (2, 65, 4, 64), 2.0)
    k, v = _rand(rng, (2, 90, 2, 64)), _rand(rng, (2, 90, 2, 40))  # GQA, Dv != Dqk
    _check_modifiers(rng, monkeypatch, q, k, v, **_bias_and_mask(rng, 2, 4, 65, 90), **opts)
    padding = np.where(rng.random((2, 1, 1, 90)) < 0.3, -np.inf, 0.0).astype(np.float32)
    _check_modifiers(rng, monkeypatch, q, k, v, bias=padding, dropout_p=0.4, **opts)
    stride0 = np.broadcast_to(_rand(rng, (1, 4, 1, 90)), (2, 4, 65, 90))
    _check_modifiers(rng, monkeypatch, q, k, v, bias=stride0, deterministic=True, **opts)
    _check_modifiers(rng, monkeypatch, q, k, v, bias=_rand(rng, (65, 90)).astype(np.float16), **opts)
    switched = bool(opts.get("softcap") or "alibi_slopes" in opts)  # (softcap and ALiBi switched at run time)
    assert all(("_switched" in n) == switched for n in kernels_run if "_modsdrop" in n), kernels_run


@pytest.mark.parametrize("headdim", [128, 160])
def test_modifiers_on_small_shared_memory_gpus(rng, headdim, kernels_run, monkeypatch):
    """The forms a 99 KB GPU (sm_86/89) takes: d128's slab-summed S/dP in one 2-warp slab, d160's
    column split without it (its buffer does not fit there); dbias once a slab."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: 99 * 1024)
    q = _rand(rng, (2, 45, 2, headdim), 2.0)
    k, v = _rand(rng, (2, 70, 1, headdim)), _rand(rng, (2, 70, 1, headdim))
    _check_modifiers(rng, monkeypatch, q, k, v, causal=True, dropout_p=0.2, **_bias_and_mask(rng, 2, 2, 45, 70))
    atomic = [n for n in kernels_run if n.endswith("_adq")]
    assert atomic and all(("_ss_" in n) == (headdim == 128) for n in atomic), kernels_run
    # softcap with them: the _switched variant, also where the slab-summed buffer does not fit (d160)
    _check_modifiers(rng, monkeypatch, q, k, v, softcap=3.0, **_bias_and_mask(rng, 2, 2, 45, 70))
    assert any("_switched" in n and n.endswith("_adq") for n in kernels_run), kernels_run


def test_128k_tokens_without_score_matrix(rng):
    """Issue 24's long row: one head of 131072 float64 tokens, whose score matrix alone would take
    128 GiB in float64, runs in the memory of its inputs and outputs (< 1 GiB more); rows from the
    start, the middle and the end against the extended-precision reference."""
    cp = _cp()
    n, d = 131072, 64
    q, k, v = (_rand(rng, (1, n, 1, d)) for _ in range(3))
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out = cp.full((1, n, 1, d), np.nan)
    cp.cuda.Device().synchronize()
    free_before = cp.cuda.Device().mem_info[0]
    _, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True)
    cp.cuda.Device().synchronize()
    assert free_before - cp.cuda.Device().mem_info[0] < 1 << 30
    rows = np.r_[0:16, n // 2: n // 2 + 16, n - 16:n]
    ref_out, ref_lse = _ref_extended(q[:, rows], k, v)
    naive_out, naive_lse = R.naive_attention(q[:, rows], k, v, return_lse=True)
    _assert_f64_rule(out.get()[:, rows], ref_out, naive_out, "out rows")
    _assert_f64_rule(lse.get()[:, :, rows], ref_lse, naive_lse, "lse rows")


def _central_difference_check(rng, q, k, v, w, samples=10, eps=1e-5, **opts):
    """attention_backward's dq, dk, dv on the GPU against central differences of the GPU's attention
    itself: the loss sum(out * w), each of ``samples`` random entries of q, k and v moved by +-eps
    (float64 throughout, so the differences keep about 10 digits)."""
    cp = _cp()
    arrays = [cp.asarray(x) for x in (q, k, v)]
    wd = cp.asarray(w)

    def loss(qkv):
        return float((cuflash.attention(*qkv, **opts) * wd).sum())

    out, lse = cuflash.attention(*arrays, return_lse=True, **opts)
    grads = cuflash.attention_backward(wd, *arrays, out, lse, **opts)
    for name, x, g in zip(("dq", "dk", "dv"), arrays, grads):
        g = _arrays.to_numpy(g)
        scale = float(np.abs(g).max())
        for flat in rng.choice(x.size, size=min(samples, x.size), replace=False):
            idx = np.unravel_index(flat, x.shape)
            moved = []
            for sign in (1.0, -1.0):
                x2 = x.copy()
                x2[idx] += sign * eps
                qkv = [x2 if y is x else y for y in arrays]
                moved.append(loss(qkv))
            fd = (moved[0] - moved[1]) / (2 * eps)
            assert abs(fd - g[idx]) <= 1e-7 * max(scale, 1.0), f"{name}{idx}: backward {g[idx]:.12g}, central difference {fd:.12g}"


@pytest.mark.parametrize("case", ["d64-causal", "d128-gqa-softcap", "d160-window-alibi"])
def test_gradients_against_central_differences(rng, case):
    """Issue 24's check of the float64 gradients against central differences, through the GPU's own
    forward and backward (the atomic-dQ default: 16-query tiles at d128, the column split at d160)."""
    d, opts, hk = {"d64-causal": (64, dict(causal=True), 2),
                   "d128-gqa-softcap": (128, dict(softcap=3.0), 1),
                   "d160-window-alibi": (160, dict(window_size=(5, 2), alibi_slopes=SLOPES[:2]), 2)}[case]
    q = _rand(rng, (1, 19, 2, d))
    k, v = _rand(rng, (1, 23, hk, d)), _rand(rng, (1, 23, hk, d))
    _central_difference_check(rng, q, k, v, _rand(rng, (1, 19, 2, d)), **opts)
