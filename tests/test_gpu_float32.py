"""float32 attention on the GPU (issue 24; kernels/flash_fwd.cu's and flash_bwd.cu's TF32 tensor-core forms).

precision=None/"ieee" (3xTF32 products) must meet the exactness rule against naive float32
attention; precision="tf32" (single TF32 products) against naive attention on TF32-rounded
operands (cuflash.reference.naive_attention(precision="tf32")); both against the float64 oracle,
on NaN-poisoned outputs.
"""

import re

import numpy as np
import pytest

import cuflash
from cuflash import _arrays, _gpu
from cuflash.reference import assert_exact, attention_backward_ref, attention_ref, naive_attention, naive_attention_backward

from .conftest import modifier_arguments, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

HEADDIMS = [1, 8, 32, 40, 59, 64, 96, 100, 128, 160, 256]


def _cp():
    return _arrays.cupy_module()


def _rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _check(q, k, v, *, layout="bshd", precision=None, **opts):
    cp = _cp()
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    shape = list(q.shape)
    shape[-1] = v.shape[-1]
    out = cp.full(tuple(shape), np.nan, dtype=np.float32)
    res, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, layout=layout, precision=precision, **opts)
    assert res is out and lse.dtype == np.float32
    ref_out, ref_lse = attention_ref(q, k, v, layout=layout, **opts)
    naive_out, naive_lse = naive_attention(q, k, v, layout=layout, return_lse=True, precision=precision, **opts)
    assert_exact(out.get(), ref_out, naive_out, "out")
    assert_exact(lse.get(), ref_lse, naive_lse, "lse")
    return out, lse


@pytest.mark.parametrize("precision", [None, "tf32"])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlens", [(1, 1), (7, 63), (65, 129), (129, 65), (63, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_headdims_and_lengths(rng, precision, headdim, seqlens, causal, kernels_run):
    sq, sk = seqlens
    q = _rand(rng, (2, sq, 3, headdim), 3.0)
    k, v = _rand(rng, (2, sk, 3, headdim)), _rand(rng, (2, sk, 3, headdim))
    _check(q, k, v, causal=causal, precision=precision)
    suffix = "_tf32" if precision == "tf32" else "_qsmem"
    assert kernels_run and all(n.startswith("cuflash_fwd_fp32_") and re.sub(r"(_cs2)?(_ch\d\d)?(_sh)?$", "", n).endswith(suffix) for n in kernels_run), kernels_run


@pytest.mark.parametrize("headdim", [128, 256])
def test_tiles_of_small_shared_memory_gpus(rng, headdim, kernels_run, monkeypatch):
    """The tiles that GPUs with 99 KB of shared memory a block (sm_86/89) take: d128's as the H200's,
    d256's too since its column split (session 28; 32 x 32 with 2 warps before)."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: 99 * 1024)
    q = _rand(rng, (2, 70, 2, headdim), 3.0)
    k, v = _rand(rng, (2, 129, 2, headdim)), _rand(rng, (2, 129, 2, headdim))
    _check(q, k, v, causal=True)
    _check(q, k, v, window_size=(9, 4), softcap=3.0, precision="tf32")
    assert all(("_bm64_bn32_w4_" if headdim == 128 else "_bm64_bn16_w8_") in n for n in kernels_run), kernels_run
    assert all(("_cs2" in n) == (headdim == 256) for n in kernels_run), kernels_run


@pytest.mark.parametrize("precision", [None, "tf32"])
@pytest.mark.parametrize("causal", [False, True])
def test_long_rows(rng, precision, causal, kernels_run):
    q, k, v = (_rand(rng, (1, 1000, 2, 128), 2.0 if i == 0 else 1.0) for i in range(3))
    _check(q, k, v, causal=causal, precision=precision)


# ALiBi slopes as float32 holds them (the float32 kernels read float32 slopes, as the 16-bit ones)
SLOPES = np.array([0.3, 0.7, 1.1, 0.05], dtype=np.float32)
SLOPES_2D = np.array([[0.3, 0.7, 1.1, 0.05], [0.01, 0.9, 0.45, 2.3]], dtype=np.float32)


@pytest.mark.parametrize("opts", [
    dict(window_size=(5, 3)), dict(window_size=(0, 0), causal=True), dict(softcap=4.0), dict(softcap=2.0, causal=True),
    dict(softmax_scale=-0.3), dict(softmax_scale=0.0), dict(causal=True, window_size=(20, -1)),
    dict(alibi_slopes=SLOPES, causal=True), dict(alibi_slopes=SLOPES_2D, softcap=3.0, window_size=(30, 5)),
], ids=lambda o: "-".join(f"{k}={'array' if isinstance(v, np.ndarray) else v}" for k, v in o.items()))
def test_options(rng, opts, kernels_run):
    q = _rand(rng, (2, 70, 4, 64), 4.0)
    k, v = _rand(rng, (2, 90, 2, 64)), _rand(rng, (2, 90, 2, 64))  # GQA: 2 query heads per K/V head
    _check(q, k, v, **opts)
    _check(q, k, v, precision="tf32", **opts)


def test_seqlens_k_value_headdim_and_empty_rows(rng, kernels_run):
    q = _rand(rng, (3, 33, 2, 64), 3.0)
    k, v = _rand(rng, (3, 77, 2, 64)), _rand(rng, (3, 77, 2, 40))  # Dv != Dqk
    k[1, 50:] = np.nan  # past seqlens_k: never read
    _, lse = _check(q, k, v, seqlens_k=np.array([77, 50, 0], dtype=np.int32))
    assert bool((lse[2] == -np.inf).all())  # no key: empty rows


def test_layout_bhsd_and_strided_inputs(rng, kernels_run):
    q, k, v = (_rand(rng, (2, 3, 100, 64)) for _ in range(3))
    _check(q, k, v, layout="bhsd", causal=True)
    cp = _cp()
    big = _rand(rng, (2, 57, 4, 96))
    qd = cp.asarray(big)[:, :, ::2, :64]
    kd, vd = cp.asarray(big[:, :, 1::2, :64]), cp.asarray(big[:, :, 1::2, 32:])
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, causal=True)
    ref, ref_lse = attention_ref(qd.get(), kd.get(), vd.get(), causal=True)
    naive, naive_lse = naive_attention(qd.get(), kd.get(), vd.get(), return_lse=True, causal=True)
    assert_exact(out.get(), ref, naive, "out")
    assert_exact(lse.get(), ref_lse, naive_lse, "lse")


def test_repeated_calls_are_bitwise_identical(rng, kernels_run):
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, (2, 300, 2, 128))) for _ in range(3))
    first = cuflash.attention(q, k, v, causal=True)
    for _ in range(3):
        assert bool((cuflash.attention(q, k, v, causal=True).view(cp.uint32) == first.view(cp.uint32)).all())


def test_varlen_dropout_runs_each_sequences_padded_mask(rng, kernels_run):
    """attention_varlen's dropout in float32: sequence b's keep-mask is that of a padded batch
    entry b (cuflash.dropout_mask), checked per sequence against the reference."""
    cp = _cp()
    lens = [9, 11]
    cu = np.array([0, 9, 20], dtype=np.int32)
    q, k, v = (_rand(rng, (20, 2, 64)) for _ in range(3))
    out = cuflash.attention_varlen(*(cp.asarray(x) for x in (q, k, v, cu, cu)), max_seqlen_q=11, max_seqlen_k=11,
                                   dropout_p=0.3, dropout_seed=(5, 2)).get()
    keep = cuflash.dropout_mask((5, 2), (2, 2, 11, 11), 0.3)
    for b, n in enumerate(lens):
        rows = slice(cu[b], cu[b + 1])
        args = (q[None, rows], k[None, rows], v[None, rows])
        one = dict(dropout_p=0.3, dropout_keep=keep[b:b + 1, :, :n, :n])
        assert_exact(out[None, rows], attention_ref(*args, **one)[0], naive_attention(*args, **one), f"out {b}")
    assert any(n.startswith("cuflash_fwd_fp32_") and "_modsdrop" in n for n in kernels_run), kernels_run


# The backward (flash_bwd.cu's TF32 form).


def _check_backward(q, k, v, dout, precision=None, deterministic=False, **opts):
    cp = _cp()
    qd, kd, vd, dod = (cp.asarray(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, precision=precision, **opts)
    grads = [cp.full(x.shape, np.nan, dtype=np.float32) for x in (q, k, v)]
    cuflash.attention_backward(dod, qd, kd, vd, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], precision=precision,
                               deterministic=deterministic, **opts)
    ref = attention_backward_ref(dout, q, k, v, **opts)
    naive = naive_attention_backward(dout, q, k, v, precision=precision, **opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert_exact(g.get(), r, n, name)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("precision", [None, "tf32"])
@pytest.mark.parametrize("headdim", [1, 8, 32, 40, 64, 96, 128])
@pytest.mark.parametrize("seqlens", [(1, 1), (7, 63), (65, 129), (129, 65)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_headdims_and_lengths(rng, precision, headdim, seqlens, causal, deterministic, kernels_run):
    """Both dQ schemes: added atomically by the dK/dV kernel (the default) or its own kernel."""
    sq, sk = seqlens
    q = _rand(rng, (2, sq, 2, headdim), 2.0)
    k, v = _rand(rng, (2, sk, 2, headdim)), _rand(rng, (2, sk, 2, headdim))
    _check_backward(q, k, v, _rand(rng, (2, sq, 2, headdim)), precision=precision, causal=causal,
                    deterministic=deterministic)
    backward = [n for n in kernels_run if n.startswith("cuflash_bwd_fp32_")]
    assert backward and all(("_tf32" in n) == (precision == "tf32") and n.endswith("_adq") != deterministic
                            for n in backward), kernels_run
    assert "cuflash_bwd_dsum_fp32" in kernels_run, kernels_run


@pytest.mark.parametrize("opts", [
    dict(window_size=(5, 3)), dict(softcap=4.0, causal=True), dict(softmax_scale=-0.3),
    dict(seqlens_k=np.array([90, 41], dtype=np.int32), causal=True),
    dict(alibi_slopes=SLOPES, causal=True), dict(alibi_slopes=SLOPES_2D, softcap=3.0),
], ids=["window", "softcap", "negative-scale", "seqlens_k", "alibi", "alibi-2d-softcap"])
def test_backward_options_gqa_and_value_headdim(rng, opts, kernels_run):
    q = _rand(rng, (2, 70, 4, 64), 3.0)
    k, v = _rand(rng, (2, 90, 2, 64)), _rand(rng, (2, 90, 2, 40))  # GQA, Dv != Dqk
    _check_backward(q, k, v, _rand(rng, (2, 70, 4, 40)), **opts)
    _check_backward(q, k, v, _rand(rng, (2, 70, 4, 40)), precision="tf32", **opts)


def test_backward_with_dlse(rng, kernels_run):
    """The LSE's gradient joins D (dsum -= dlse) in float32 too."""
    cp = _cp()
    q, k, v, dout = (_rand(rng, (2, 50, 2, 64)) for _ in range(4))
    dlse = _rand(rng, (2, 2, 50))
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, causal=True)
    grads = cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, dlse=cp.asarray(dlse), causal=True)
    ref = attention_backward_ref(dout, q, k, v, dlse=dlse, causal=True)
    naive = naive_attention_backward(dout, q, k, v, dlse=dlse, causal=True)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert_exact(g.get(), r, n, name)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("headdim", [136, 160, 256])
@pytest.mark.parametrize("smem_kb", [227, 99])
def test_backward_past_d128_splits_columns(rng, headdim, smem_kb, deterministic, kernels_run, monkeypatch):
    """Past d128 4 warps share each 16-row slab, each with a quarter of the output's columns
    (bwd_variant's col_split), 2 slabs a block (1 on a 99 KB GPU past d192); both dQ schemes."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: smem_kb * 1024)
    q = _rand(rng, (2, 45, 2, headdim), 2.0)
    k, v = _rand(rng, (2, 70, 1, headdim)), _rand(rng, (2, 70, 1, headdim - 8))  # GQA, Dv != Dqk
    _check_backward(q, k, v, _rand(rng, (2, 45, 2, headdim - 8)), causal=True, deterministic=deterministic)
    _check_backward(q, k, v, _rand(rng, (2, 45, 2, headdim - 8)), precision="tf32", softcap=3.0, window_size=(20, 5),
                    deterministic=deterministic)
    backward = [n for n in kernels_run if n.startswith("cuflash_bwd_fp32_")]
    assert backward and all("_cs4" in n for n in backward), backward
    ordered, atomic = [n for n in backward if not n.endswith("_adq")], [n for n in backward if n.endswith("_adq")]
    assert all(("_w4_" if smem_kb == 99 and headdim > 160 else "_w8_") in n for n in ordered), ordered
    assert all("_ss_" in n for n in atomic), atomic  # (S and dP summed over the slab's warps, perf-notes f9)


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_deterministic_backward_is_bitwise_repeatable_and_matches_the_atomic_one(rng, headdim):
    """deterministic=True: dq, dk, dv bitwise the same over repeated calls (GQA: a group's query
    heads summed in order); the default's atomic dQ within the rule, and its dK, dV the same sums."""
    cp = _cp()
    q = cp.asarray(_rand(rng, (2, 150, 4, headdim), 2.0))
    k, v, dout = cp.asarray(_rand(rng, (2, 170, 2, headdim))), cp.asarray(_rand(rng, (2, 170, 2, headdim))), cp.asarray(_rand(rng, (2, 150, 4, headdim)))
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(5):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        for g, h in zip(first, again):
            assert bool((g.view(cp.uint32) == h.view(cp.uint32)).all())
    atomic = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    scale = float(cp.abs(first[0]).max())
    assert float(cp.abs(atomic[0] - first[0]).max()) <= 1e-5 * scale


# Bias, mask and dropout (flash_fwd.cu's and flash_bwd.cu's float32 modifier form, CUFLASH_MODS 2,
# whose dropout generator is skipped for calls without dropout).


def _check_modifiers(rng, q, k, v, *, precision=None, deterministic=False, dropout_p=0.0, **opts):
    """Forward and backward (NaN-poisoned out, dq, dk, dv) with bias/mask/dropout against the
    float64 reference and naive float32 attention, dbias included where there is a bias."""
    cp = _cp()
    ref_opts, run = modifier_arguments(q, k, dropout_p, (11, 3), opts)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out = cp.full(q.shape[:-1] + v.shape[-1:], np.nan, dtype=np.float32)
    cuflash.attention(qd, kd, vd, out=out, precision=precision, **run)
    out, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, precision=precision, **run)
    ref_out, ref_lse = attention_ref(q, k, v, **ref_opts)
    naive_out, naive_lse = naive_attention(q, k, v, return_lse=True, precision=precision, **ref_opts)
    assert_exact(out.get(), ref_out, naive_out, "out")
    assert_exact(lse.get(), ref_lse, naive_lse, "lse")
    dout = _rand(rng, out.shape)
    grads = [cp.full(x.shape, np.nan, dtype=np.float32) for x in (q, k, v)]
    with_bias = "bias" in opts
    res = cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                     precision=precision, deterministic=deterministic, return_dbias=with_bias, **run)
    refs = attention_backward_ref(dout, q, k, v, **ref_opts)
    naives = naive_attention_backward(dout, q, k, v, precision=precision, **ref_opts)
    for name, g, r, n in zip(("dq", "dk", "dv", "dbias"), res, refs, naives):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert_exact(g.get(), r, n, name)
    return res


def _bias_and_mask(rng, b, h, sq, sk):
    mask = rng.random((b, 1, sq, sk)) < 0.8
    mask[0, 0, 2] = False  # a row that sees no key
    return dict(bias=rng.standard_normal((1, h, sq, sk)).astype(np.float32), mask=mask)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("headdim", [32, 64, 96, 128, 160, 256])
def test_bias_mask_dropout_every_headdim(rng, headdim, deterministic, kernels_run):
    """Every head-dim bucket's modifier form (past d128 four warps share a slab: dS goes into dbias
    once a slab), both dQ schemes; GQA, Sq != Sk, causal."""
    q = _rand(rng, (2, 70, 4, headdim), 2.0)
    k, v = _rand(rng, (2, 90, 2, headdim)), _rand(rng, (2, 90, 2, headdim))
    _check_modifiers(rng, q, k, v, deterministic=deterministic, causal=True, **_bias_and_mask(rng, 2, 4, 70, 90))
    _check_modifiers(rng, q, k, v, deterministic=deterministic, dropout_p=0.2, bias=_rand(rng, (70, 90)))
    names = [n for n in kernels_run if n.startswith(("cuflash_fwd_fp32_", "cuflash_bwd_fp32_"))]
    assert names and all("_modsdrop" in n for n in names), kernels_run
    assert all(n.endswith("_adq") != deterministic for n in names if n.startswith("cuflash_bwd_")), kernels_run


@pytest.mark.parametrize("opts", [
    dict(window_size=(7, 3), softcap=4.0), dict(alibi_slopes=SLOPES, causal=True), dict(softmax_scale=-0.4),
    dict(seqlens_k=np.array([90, 41], dtype=np.int32)), dict(softcap=3.0, alibi_slopes=SLOPES),
], ids=["window-softcap", "alibi-causal", "negative-scale", "seqlens_k", "softcap-alibi"])
@pytest.mark.parametrize("precision", [None, "tf32"])
def test_bias_mask_dropout_with_every_option(rng, opts, precision, kernels_run):
    """The score pipeline's order (scale, softcap, ALiBi, bias, masks), key-padding and float64 biases
    (read as a float32 copy), a stride-0 bias; dropout with each option."""
    q = _rand(rng, (2, 65, 4, 64), 2.0)
    k, v = _rand(rng, (2, 90, 2, 64)), _rand(rng, (2, 90, 2, 40))  # GQA, Dv != Dqk
    _check_modifiers(rng, q, k, v, precision=precision, **_bias_and_mask(rng, 2, 4, 65, 90), **opts)
    padding = np.where(rng.random((2, 1, 1, 90)) < 0.3, -np.inf, 0.0)  # float64: a float32 copy
    _check_modifiers(rng, q, k, v, precision=precision, bias=padding, dropout_p=0.4, **opts)
    stride0 = np.broadcast_to(_rand(rng, (1, 4, 1, 90)), (2, 4, 65, 90))
    _check_modifiers(rng, q, k, v, precision=precision, bias=stride0, deterministic=True, **opts)
    assert all(("_tf32" in n) == (precision == "tf32") for n in kernels_run if n.startswith("cuflash_fwd_fp32")), kernels_run
    switched = bool(opts.get("softcap") or "alibi_slopes" in opts)  # (softcap and ALiBi switched at run time)
    assert all(("_switched" in n) == switched for n in kernels_run if "_modsdrop" in n), kernels_run


def test_dropout_is_bitwise_repeatable_and_zero_is_no_dropout(rng):
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, (2, 100, 2, 64))) for _ in range(3))
    bias = cp.asarray(_rand(rng, (100, 100)))
    first = cuflash.attention(q, k, v, bias=bias, dropout_p=0.3, dropout_seed=9)
    again = cuflash.attention(q, k, v, bias=bias, dropout_p=0.3, dropout_seed=9)
    assert bool((first.view(cp.uint32) == again.view(cp.uint32)).all())
    plain = cuflash.attention(q, k, v, bias=bias)  # (the same kernel, its generator skipped)
    zero = cuflash.attention(q, k, v, bias=bias, dropout_p=0.0, dropout_seed=9)
    assert bool((plain.view(cp.uint32) == zero.view(cp.uint32)).all())


@pytest.mark.parametrize("deterministic", [False, True])
def test_structured_masks_on_the_32_query_tiles(rng, deterministic, kernels_run):
    """d128's atomic-dQ kernel takes 64 keys and 32-query tiles (perf-notes f9): a key-padding mask
    (all-True and all-False (32, 64) tiles) and bands of 32 query rows that see alternate 64-key
    blocks, so that the tile map skips, reads no mask, and narrows query tiles of 32 against keys of 64."""
    q = _rand(rng, (2, 130, 2, 128), 2.0)
    k, v = _rand(rng, (2, 200, 2, 128)), _rand(rng, (2, 200, 2, 128))
    padding = np.arange(200)[None, None, None, :] < np.array([200, 70])[:, None, None, None]
    bands = (np.arange(130)[:, None] // 32 + np.arange(200)[None, :] // 64) % 2 == 0
    _check_modifiers(rng, q, k, v, deterministic=deterministic, mask=padding)
    _check_modifiers(rng, q, k, v, deterministic=deterministic, mask=bands, bias=_rand(rng, (130, 200)), causal=True)
    atomic = [n for n in kernels_run if n.endswith("_adq")]
    assert (not atomic) if deterministic else (atomic and all("_q32_" in n for n in atomic)), kernels_run


@pytest.mark.parametrize("headdim", [160, 256])
def test_modifiers_on_small_shared_memory_gpus(rng, headdim, kernels_run, monkeypatch):
    """The slab-summed S/dP forms a 99 KB GPU (sm_86/89) takes: one slab of 4 warps, dbias once a slab."""
    monkeypatch.setattr(_gpu, "_smem_limit", lambda device: 99 * 1024)
    q = _rand(rng, (2, 45, 2, headdim), 2.0)
    k, v = _rand(rng, (2, 70, 1, headdim)), _rand(rng, (2, 70, 1, headdim))
    _check_modifiers(rng, q, k, v, causal=True, dropout_p=0.2, **_bias_and_mask(rng, 2, 2, 45, 70))
    assert any("_w4_" in n and "_ss_" in n for n in kernels_run), kernels_run
