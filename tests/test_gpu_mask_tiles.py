"""Boolean masks at the scale of the kernels' tiles (kernels/mask_tiles.cu, issue 23): tiles whose
mask is all False are skipped, all-True tiles read no mask, the key span of each query tile is
narrowed to where the mask is not all False.  Every form below makes the Hopper and sm_80 forward
kernels and the split-KV decode kernel take those paths (1000 rows: 8 query tiles of 128, 16 of 64;
holes inside a tile row, whole rows of tiles with nothing, batch entries and heads that differ),
checked against the float64 reference with the exactness rule into a NaN-poisoned ``out``, and
the backward after them (the Hopper dK/dV kernels narrow their query tiles to the union over a GQA
group's heads, skip all-False tiles, and in deterministic mode the dQ kernel, whose tiles are not
the map's, reads the mask everywhere; the sm_80 dQ and dK/dV kernels share one map).  Skipped
without a CUDA GPU."""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _arrays
from cuflash import reference as R

from .conftest import requires_gpu
from .test_cpu import make_qkv

pytestmark = [pytest.mark.gpu, requires_gpu]

B, H, HK, S = 2, 4, 2, 1000  # GQA: the dK/dV kernel's key block serves two query heads


def _mask(form: str, sq: int = S, sk: int = S) -> np.ndarray:
    keys = np.arange(sk)
    if form == "key-padding":  # (B, 1, 1, Sk): entry 1 keeps a stretch of keys that ends inside a tile
        return (keys < np.array([sk, sk // 2 + 3])[:, None])[:, None, None, :]
    if form == "documents":  # (1, 1, Sq, Sk) block diagonal: all-False tiles inside each row of tiles
        doc_q = np.searchsorted([300, 305, 700], np.arange(sq), side="right")
        doc_k = np.searchsorted([300, 305, 700], keys, side="right")
        return (doc_q[:, None] == doc_k[None, :])[None, None]
    if form == "heads":  # (1, H, 1, Sk): every key, one stretch, stripes of 128 keys, none
        return np.stack([keys >= 0, (keys >= 200) & (keys < 600), (keys // 128) % 2 == 0, keys < 0])[None, :, None, :]
    if form == "rows":  # (B, 1, Sq, 1): query rows that see no key at all, tiles of them
        rows = np.arange(sq)[:, None]
        return np.stack([(rows < 250) | (rows >= 520), rows % 3 != 0])[:, None]
    raise ValueError(form)


FORMS = ["key-padding", "documents", "heads", "rows"]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_map_forward_and_backward(rng, dtype, headdim, form, causal):
    cp = _arrays.cupy_module()
    q, k, v = make_qkv(rng, dtype, B, S, S, H, HK, headdim)
    mask = _mask(form)
    out = cp.full((B, S, H, headdim), np.nan, dtype=dtype)
    got, lse = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), mask=cp.asarray(mask), causal=causal,
                                 out=out, return_lse=True)
    ref, ref_lse = R.attention_ref(q, k, v, mask=mask, causal=causal)
    naive, naive_lse = R.naive_attention(q, k, v, mask=mask, causal=causal, return_lse=True)
    R.assert_exact(_arrays.to_numpy(got).astype(np.float64), ref, naive, "out")
    R.assert_exact(_arrays.to_numpy(lse).astype(np.float64), ref_lse, naive_lse, "lse")
    if headdim != 256 or form == "documents":  # the backward: both dQ schemes of the Hopper kernels
        _check_backward(rng, q, k, v, got, lse, mask, causal, deterministic=form in ("heads", "rows"))


def _check_backward(rng, q, k, v, out, lse, mask, causal, deterministic=False):
    """The backward into NaN-poisoned gradients, against the float64 reference."""
    cp = _arrays.cupy_module()
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    bufs = [cp.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v)]
    grads = cuflash.attention_backward(cp.asarray(dout), *(cp.asarray(x) for x in (q, k, v)), out, lse, dq=bufs[0],
                                       dk=bufs[1], dv=bufs[2], mask=cp.asarray(mask), causal=causal,
                                       deterministic=deterministic)
    refs = R.attention_backward_ref(dout, q, k, v, mask=mask, causal=causal)
    naives = R.naive_attention_backward(dout, q, k, v, mask=mask, causal=causal)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(_arrays.to_numpy(g).astype(np.float64), r, n, name)


@pytest.mark.parametrize("form", ["key-padding", "documents", "heads"])
@pytest.mark.parametrize("sq", [1, 3])
def test_tile_map_in_the_split_kernel(rng, form, sq):
    """A few query rows run the split-KV kernel (with a mask: no GQA packing); its splits see
    all-False tiles, all-True ones and none."""
    cp = _arrays.cupy_module()
    q, k, v = make_qkv(rng, np.float16, B, sq, 4000, H, HK, 128)
    mask = _mask(form, sq, 4000)
    out = cp.full((B, sq, H, 128), np.nan, dtype=np.float16)
    got, lse = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), mask=cp.asarray(mask), out=out, return_lse=True)
    ref, ref_lse = R.attention_ref(q, k, v, mask=mask)
    naive, naive_lse = R.naive_attention(q, k, v, mask=mask, return_lse=True)
    R.assert_exact(_arrays.to_numpy(got).astype(np.float64), ref, naive, "out")
    R.assert_exact(_arrays.to_numpy(lse).astype(np.float64), ref_lse, naive_lse, "lse")


def test_sm80_kernels_with_the_tile_map(rng, monkeypatch):
    """CUFLASH_DISABLE_SM90=1: the sm_80 forward (64 x 128 tiles at head dim 128) and backward (64 x 64)
    with the map."""
    monkeypatch.setenv("CUFLASH_DISABLE_SM90", "1")
    cp = _arrays.cupy_module()
    q, k, v = make_qkv(rng, ml_dtypes.bfloat16, B, S, S, H, HK, 128)
    for form in FORMS:
        mask = _mask(form)
        got, lse = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), mask=cp.asarray(mask), causal=True,
                                     return_lse=True)
        ref, ref_lse = R.attention_ref(q, k, v, mask=mask, causal=True)
        naive, naive_lse = R.naive_attention(q, k, v, mask=mask, causal=True, return_lse=True)
        R.assert_exact(_arrays.to_numpy(got).astype(np.float64), ref, naive, f"out {form}")
        R.assert_exact(_arrays.to_numpy(lse).astype(np.float64), ref_lse, naive_lse, f"lse {form}")
        _check_backward(rng, q, k, v, got, lse, mask, True)


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_all_false_tiles_are_never_read(rng, headdim):
    """The skip itself, seen from outside: K and V rows that only all-False tiles cover (keys from
    512 on, hidden from batch entry 1 by its key padding; 512 is a multiple of every tile width of
    these head dims' kernels) are NaN there.  A kernel that read them would give NaN (0 x NaN in
    P V, NaN in dS K); skipped, the results equal the reference's on finite values (masked keys
    contribute nothing), and those keys' dK, dV are 0."""
    cp = _arrays.cupy_module()
    q, k, v = make_qkv(rng, ml_dtypes.bfloat16, B, S, S, H, HK, headdim)
    mask = (np.arange(S) < np.array([S, 500])[:, None])[:, None, None, :]
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[1, 512:], v_nan[1, 512:] = np.nan, np.nan
    k_ref, v_ref = k.copy(), v.copy()
    k_ref[1, 512:], v_ref[1, 512:] = 0, 0
    qd, kd, vd, md = cp.asarray(q), cp.asarray(k_nan), cp.asarray(v_nan), cp.asarray(mask)
    out, lse = cuflash.attention(qd, kd, vd, mask=md, return_lse=True)
    ref, ref_lse = R.attention_ref(q, k_ref, v_ref, mask=mask)
    naive, naive_lse = R.naive_attention(q, k_ref, v_ref, mask=mask, return_lse=True)
    R.assert_exact(_arrays.to_numpy(out).astype(np.float64), ref, naive, "out")
    R.assert_exact(_arrays.to_numpy(lse).astype(np.float64), ref_lse, naive_lse, "lse")
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    grads = cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, mask=md)
    refs = R.attention_backward_ref(dout, q, k_ref, v_ref, mask=mask)
    naives = R.naive_attention_backward(dout, q, k_ref, v_ref, mask=mask)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(_arrays.to_numpy(g).astype(np.float64), r, n, name)
    assert not _arrays.to_numpy(grads[1])[1, 512:].any() and not _arrays.to_numpy(grads[2])[1, 512:].any()
