"""The Hopper (wgmma) kernels and the sm_80 kernels they replace there.

On a compute-capability-9.0 GPU, cuflash.attention runs kernels/flash_fwd_sm90.cu (warp-specialised,
issue 21) for head-dim buckets 64, 128, 192 and 256, and attention_backward runs kernels/flash_bwd_sm90.cu for head dims
33-256 (its 64, 128 and 256 kernels), so test_gpu_forward.py's and test_gpu_backward.py's sweeps test them; this file checks that
the dispatch really picks them, tests their tiling edges (many tiles, both stages, tails, causal
and window bands crossing tiles, GQA groups), and keeps the sm_80 kernels tested on Hopper
through the CUFLASH_DISABLE_SM90 switch.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _arrays, _fastpath, _gpu, _kernels
from cuflash import reference as R

from .conftest import HAS_GPU, requires_gpu
from .test_cpu import check_backward, check_varlen, make_qkv, varlen_inputs
from .test_gpu_backward import _check_varlen_grads
from .test_gpu_forward import _check, _rand

pytestmark = [pytest.mark.gpu, requires_gpu]

DTYPES = [np.float16, ml_dtypes.bfloat16]


def _on_hopper() -> bool:
    return HAS_GPU and _gpu._is_hopper(_arrays.cupy_module().cuda.Device().id)


requires_hopper = pytest.mark.skipif(
    "not _on_hopper()", reason="the wgmma kernel needs a compute-capability-9.0 GPU and NVRTC >= 12.9"
)


@pytest.fixture(params=["sm90", "sm80"])
def kernel(request, monkeypatch):
    """Run the test on the default (Hopper) kernel and with the Hopper kernels switched off."""
    if request.param == "sm80":
        monkeypatch.setenv("CUFLASH_DISABLE_SM90", "1")
    _fastpath.PLANS.clear()  # warm-call plans remember the kernel of their first call
    yield request.param
    _fastpath.PLANS.clear()


@requires_hopper
@pytest.mark.parametrize("headdim", [40, 64, 96, 111, 128, 160, 192, 224, 256])
def test_dispatch_picks_the_wgmma_kernel(headdim, monkeypatch):
    device = _arrays.cupy_module().cuda.Device().id
    features = dict(softcap=False, alibi=False)
    v = _gpu._hopper_variant(device, "bfloat16", _kernels.headdim_bucket(headdim), features)
    assert v is not None and v.name.startswith("cuflash_fwd_sm90_") and v.filename == "flash_fwd_sm90.cu"
    assert dict(v.defines)["CUFLASH_HEADDIM"] == -(-headdim // 64) * 64  # the next 64-column panel count
    consumers = dict(v.defines)["CUFLASH_CONSUMERS"]
    assert v.threads == 128 * (1 + consumers) and "nooverlap" not in v.name  # producer + consumer warpgroups
    v = _gpu._hopper_variant(device, "bfloat16", _kernels.headdim_bucket(headdim), features, _kernels.sm90_bwd_variant)
    bucket = _kernels.headdim_bucket(headdim)
    assert v is not None  # 64; 128 for the buckets 96 and 128; 256 for every bucket above 128
    assert dict(v.defines)["CUFLASH_HEADDIM"] == (64 if bucket == 64 else 128 if bucket <= 128 else 256)
    monkeypatch.setenv("CUFLASH_DISABLE_SM90", "1")
    assert _gpu._hopper_variant(device, "bfloat16", 128, dict(softcap=False, alibi=False)) is None


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [40, 64, 111, 128, 256])
@pytest.mark.parametrize("seqlens", [(17, 17), (127, 129), (257, 1000), (1000, 300), (600, 2049)])
@pytest.mark.parametrize("causal", [False, True])
def test_both_kernels_many_tiles(rng, kernel, dtype, headdim, seqlens, causal):
    sq, sk = seqlens
    q = _rand(rng, (1, sq, 2, headdim), dtype, 5.0)
    k = _rand(rng, (1, sk, 2, headdim), dtype)
    v = _rand(rng, (1, sk, 2, headdim), dtype)
    _check(q, k, v, causal=causal)


OPTIONS = [
    dict(window_size=(70, 0)),
    dict(window_size=(200, 130), causal="top_left"),
    dict(softcap=5.0, causal=True),
    dict(alibi_slopes=True, causal=True),
    dict(seqlens_k=True),
    dict(softmax_scale=-0.3),
]


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 160, 192, 224, 256])  # 96, 160, 224: zero-filled columns
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_both_kernels_options(rng, kernel, dtype, headdim, opts):
    b, sq, sk, h, hk = 2, 333, 517, 4, 2  # GQA, tails in both lengths
    opts = dict(opts)
    if opts.get("alibi_slopes"):
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, (b, h)).astype(np.float32)
    if opts.get("seqlens_k"):
        opts["seqlens_k"] = np.array([sk, 129], dtype=np.int32)
    q = _rand(rng, (b, sq, h, headdim), dtype, 3.0)
    k, v = _rand(rng, (b, sk, hk, headdim), dtype), _rand(rng, (b, sk, hk, headdim), dtype)
    _check(q, k, v, **opts)


@requires_hopper
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_keys_past_seqlens_k_are_never_read_into_the_output(rng, kernel, headdim):
    """Rows of k and v past seqlens_k are padding and may hold NaN: the copy engine of the
    warp-specialised kernel reads them with the tile, which must still give exact rows."""
    b, sq, sk = 2, 200, 300
    q = _rand(rng, (b, sq, 2, headdim), ml_dtypes.bfloat16, 3.0)
    k, v = _rand(rng, (b, sk, 2, headdim), ml_dtypes.bfloat16), _rand(rng, (b, sk, 2, headdim), ml_dtypes.bfloat16)
    lengths = np.array([77, 300], dtype=np.int32)
    _check(q, k, v, seqlens_k=lengths)  # exact with finite padding
    cp = _arrays.cupy_module()
    import cuflash

    clean = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), seqlens_k=cp.asarray(lengths))
    k[0, 77:], v[0, 77:] = np.nan, np.inf
    poisoned = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), seqlens_k=cp.asarray(lengths))
    assert cp.array_equal(poisoned.view(cp.uint16), clean.view(cp.uint16))  # the padding is never read into it


@requires_hopper
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_without_the_overlap(rng, headdim, causal, monkeypatch):
    """The ablation variant (each product waited for at once) stays exact too."""
    monkeypatch.setenv("CUFLASH_SM90_OVERLAP", "0")
    _fastpath.PLANS.clear()
    q = _rand(rng, (2, 333, 4, headdim), ml_dtypes.bfloat16, 3.0)
    k, v = _rand(rng, (2, 517, 2, headdim), ml_dtypes.bfloat16), _rand(rng, (2, 517, 2, headdim), ml_dtypes.bfloat16)
    _check(q, k, v, causal=causal, softcap=5.0 if causal else 0.0)


@requires_hopper
@pytest.mark.parametrize("headdim", [64, 96, 128, 160, 192, 256])
def test_packed_sequences_on_every_forward(rng, kernel, headdim):
    """Varlen through each Hopper forward: tiles that run into the next sequence's rows."""
    lens_q, lens_k = [1, 130, 7, 257], [65, 300, 1, 129]
    q, k, v, cu_q, cu_k = varlen_inputs(rng, ml_dtypes.bfloat16, lens_q, lens_k, 4, 2, headdim)
    check_varlen(_arrays.cupy_module(), q, k, v, cu_q, cu_k, rng=rng, causal=True)


@requires_hopper
@pytest.mark.parametrize("headdim", [64, 128, 192, 256])
def test_persistent_grid_computes_the_same_bits(rng, headdim, monkeypatch):
    """The persistent grid (the default: one block per SM, each taking its next tile from a counter, the
    tile's loads chained to the current one's last product through the Q and K/V barriers) computes every
    tile as one block per tile (CUFLASH_SM90_PERSISTENT=0) does: bitwise-equal out and LSE, with more tiles than SMs (each
    block takes several), tiles without keys (seqlens_k 0), GQA, windows, and packed sequences;
    and exact against the reference."""
    import cuflash

    cp = _arrays.cupy_module()
    bf16 = ml_dtypes.bfloat16
    q = cp.asarray(_rand(rng, (4, 1000, 8, headdim), bf16, 3.0))  # 4 * 8 pairs x 8 query tiles
    k, v = (cp.asarray(_rand(rng, (4, 1200, 2, headdim), bf16)) for _ in range(2))
    lengths = cp.asarray(np.array([1200, 0, 77, 1000], dtype=np.int32))
    packed = varlen_inputs(rng, bf16, [1, 300, 0, 129, 1000], [65, 0, 7, 600, 1000], 4, 2, headdim)
    cases = [dict(causal=True), dict(seqlens_k=lengths), dict(window_size=(100, 0), softcap=5.0)]
    for opts in cases:
        runs = []
        for mode in ("0", ""):
            monkeypatch.setenv("CUFLASH_SM90_PERSISTENT", mode)
            _fastpath.PLANS.clear()
            runs.append(cuflash.attention(q, k, v, return_lse=True, **opts))
        (out_a, lse_a), (out_b, lse_b) = runs
        assert cp.array_equal(out_a.view(cp.uint16), out_b.view(cp.uint16)), opts
        assert cp.array_equal(lse_a.view(cp.uint32), lse_b.view(cp.uint32)), opts
    monkeypatch.setenv("CUFLASH_SM90_PERSISTENT", "1")
    _fastpath.PLANS.clear()
    _check(q[:2, :300].get(), k[:2, :500].get(), v[:2, :500].get(), causal=True)
    check_varlen(cp, *packed, rng=rng, causal=True)
    # The tile counter resets itself: calls one after another on a stream (warm, the same plan),
    # and on a second stream, each take every tile once (into a NaN-filled out: a tile left out
    # would show).
    with cp.cuda.Stream(non_blocking=True):
        out_c = cp.empty_like(out_b)
        for _ in range(3):
            out_c.view(cp.uint16).fill(0x7FFF)
            _, lse_c = cuflash.attention(q, k, v, return_lse=True, out=out_c, **cases[-1])
            assert cp.array_equal(out_c.view(cp.uint16), out_b.view(cp.uint16))
            assert cp.array_equal(lse_c.view(cp.uint32), lse_b.view(cp.uint32))
    _fastpath.PLANS.clear()


@requires_hopper
@pytest.mark.parametrize("tile", [(96, 2, 3), (128, 2, 3)], ids=["192x96", "192x128"])
def test_three_consumer_warpgroups(rng, tile, monkeypatch):
    """The Hopper forward with three consumer warpgroups (192 query rows: FA3's shape at d64, an
    SM90_FWD_TILES entry under measurement) stays exact: several key tiles, causal, windows,
    softcap, seqlens_k, packed sequences, and on a persistent grid."""
    cp = _arrays.cupy_module()
    bf16 = ml_dtypes.bfloat16
    monkeypatch.setitem(_kernels.SM90_FWD_TILES, 64, tile)
    _kernels.sm90_fwd_variant.cache_clear()
    _fastpath.PLANS.clear()
    try:
        q = _rand(rng, (2, 333, 4, 64), bf16, 3.0)
        k, v = _rand(rng, (2, 517, 2, 64), bf16), _rand(rng, (2, 517, 2, 64), bf16)
        _check(q, k, v, causal=True)
        _check(q, k, v, window_size=(70, 0), softcap=5.0)
        monkeypatch.setenv("CUFLASH_SM90_PERSISTENT", "1")
        _fastpath.PLANS.clear()
        _check(q, k, v, seqlens_k=np.array([517, 3], dtype=np.int32))
        check_varlen(cp, *varlen_inputs(rng, bf16, [1, 300, 7], [65, 517, 0], 4, 2, 64), rng=rng, causal=True)
    finally:
        _kernels.sm90_fwd_variant.cache_clear()
        _fastpath.PLANS.clear()


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_long_rows_take_the_long_tile(rng, dtype, kernels_run):
    """Rows of SM90_FWD_LONG_ROWS queries or more run d64's three-consumer tile (192 x 96), shorter
    rows and modified scores the 128-row one; both exact, causal (bottom-right, Sq > Sk) and not,
    the last query block partial, and packed sequences whose longest row is long."""
    cp = _arrays.cupy_module()
    seen = kernels_run
    long_q = _kernels.SM90_FWD_LONG_ROWS + 7
    q = _rand(rng, (1, long_q, 2, 64), dtype, 3.0)
    k, v = _rand(rng, (1, 300, 1, 64), dtype), _rand(rng, (1, 300, 1, 64), dtype)
    for causal in (False, True):
        _check(q, k, v, causal=causal)
    assert any("_d64_bm192_bn96" in n for n in seen), seen
    seen.clear()
    _check(q[:, :1000], k, v, causal=True)
    _check(q, k, v, softcap=4.0)
    assert seen and not any("bm192" in n for n in seen), seen
    seen.clear()
    check_varlen(cp, *varlen_inputs(rng, dtype, [long_q, 5], [129, 300], 2, 1, 64), rng=rng, causal=True)
    assert any("_d64_bm192_bn96" in n for n in seen), seen


@requires_hopper
@pytest.mark.parametrize("dims", [(64, 40), (128, 64), (40, 128), (256, 128)])
def test_wgmma_value_headdim_differs(rng, dims):
    d, dv = dims
    q, k = _rand(rng, (2, 200, 2, d), ml_dtypes.bfloat16, 4.0), _rand(rng, (2, 300, 2, d), ml_dtypes.bfloat16)
    v = _rand(rng, (2, 300, 2, dv), ml_dtypes.bfloat16)
    _check(q, k, v, causal=True)


@requires_hopper
def test_wgmma_repeated_calls_are_bitwise_identical(rng):
    cp = _arrays.cupy_module()
    q, k, v = (cp.asarray(_rand(rng, (2, 1500, 4, 128), ml_dtypes.bfloat16)) for _ in range(3))
    import cuflash

    first = cuflash.attention(q, k, v, causal=True)
    for _ in range(3):
        assert bool((cuflash.attention(q, k, v, causal=True) == first).all())


@pytest.fixture(params=["sm90", "sm90-deterministic", "sm90-ordered", "sm80"])
def backward_kernels(request, monkeypatch):
    """The Hopper backward in its forms (dQ added in any order by default; with deterministic=True
    the one-pass kernel with ordered dQ additions above head dim 64 and _dq + _dkdv up to it, or
    the ordered form at every head dim under CUFLASH_SM90_ORDERED_DQ=1) and the sm_80 kernels;
    yields the deterministic flag to pass."""
    if request.param == "sm80":
        monkeypatch.setenv("CUFLASH_DISABLE_SM90", "1")
    if request.param == "sm90-ordered":
        monkeypatch.setenv("CUFLASH_SM90_ORDERED_DQ", "1")
    _fastpath.PLANS.clear()
    yield request.param in ("sm90-deterministic", "sm90-ordered")
    _fastpath.PLANS.clear()


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [40, 64, 72, 96, 111, 128, 200, 256])  # 72, 96: the 128 kernel; 200, 256: column split
@pytest.mark.parametrize("seqlens", [(17, 17), (127, 129), (257, 700), (700, 130)])
@pytest.mark.parametrize("causal", [False, True])
def test_both_backward_kernels_many_tiles(rng, backward_kernels, dtype, headdim, seqlens, causal):
    q, k, v = make_qkv(rng, dtype, 1, *seqlens, 4, 2, headdim)  # GQA: dK, dV sum two heads
    check_backward(_arrays.cupy_module(), q, k, v, rng=rng, causal=causal, deterministic=backward_kernels)


BACKWARD_OPTIONS = [
    dict(window_size=(70, 3)),
    dict(softcap=5.0, causal=True),
    dict(alibi_slopes=True),
    dict(seqlens_k=True, causal=True),
    dict(softmax_scale=-0.3),
]


@requires_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 256])
@pytest.mark.parametrize("opts", BACKWARD_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_both_backward_kernels_options(rng, backward_kernels, dtype, headdim, opts):
    b, sq, sk = 2, 200, 333
    cp = _arrays.cupy_module()
    opts = dict(opts)
    if opts.get("alibi_slopes"):
        opts["alibi_slopes"] = cp.asarray(rng.uniform(0.01, 0.5, (b, 6)).astype(np.float32))
    if opts.get("seqlens_k"):
        opts["seqlens_k"] = cp.asarray(np.array([sk, 70], dtype=np.int32))
    q, k, v = make_qkv(rng, dtype, b, sq, sk, 6, 2, headdim)
    check_backward(cp, q, k, v, rng=rng, deterministic=backward_kernels, **opts)


@requires_hopper
@pytest.mark.parametrize("headdim", [64, 128, 200])
@pytest.mark.parametrize("case", ["bias+mask", "dropout+bias", "softcap+bias"])
def test_both_backward_kernels_with_bias_mask_dropout(rng, backward_kernels, headdim, case):
    """Bias (with its gradient), mask and dropout in the Hopper backward (CUFLASH_MODS of
    flash_bwd_sm90.cu, every dQ scheme; d200: the column-split kernel, whose deterministic form adds
    dQ in order) and in the sm_80 one, against the float64 reference: GQA,
    causal, tails."""
    cp = _arrays.cupy_module()
    b, sq, sk, hq, hk = 2, 130, 257, 4, 2
    q, k, v = make_qkv(rng, np.float16, b, sq, sk, hq, hk, headdim)
    opts = dict(causal=True, bias=rng.standard_normal((b, 1, sq, sk)).astype(np.float32))
    ref_opts = dict(opts)
    if "mask" in case:
        opts["mask"] = ref_opts["mask"] = rng.random((1, hq, sq, sk)) < 0.7
    if "softcap" in case:  # dbias is dS before the softcap derivative, dQ and dK after it
        opts["softcap"] = ref_opts["softcap"] = 5.0
    run = dict(opts)
    if "dropout" in case:
        run.update(dropout_p=0.15, dropout_seed=(9, 1))
        ref_opts.update(dropout_p=0.15, dropout_keep=cuflash.dropout_mask((9, 1), (b, hq, sq, sk), 0.15))
    gpu = {key: cp.asarray(x) if isinstance(x, np.ndarray) else x for key, x in run.items()}
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuflash.attention(qd, kd, vd, return_lse=True, **gpu)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    grads = cuflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, return_dbias=True,
                                       deterministic=backward_kernels, **gpu)
    refs = R.attention_backward_ref(dout, q, k, v, **ref_opts)
    naives = R.naive_attention_backward(dout, q, k, v, **ref_opts)
    for name, g, r, n in zip(("dq", "dk", "dv", "dbias"), grads, refs, naives):
        R.assert_exact(_arrays.to_numpy(g).astype(np.float64), r, n.astype(g.dtype) if name == "dbias" else n, name)


@requires_hopper
@pytest.mark.parametrize("headdim, dv", [(64, 64), (96, 96), (128, 40), (192, 192), (256, 256), (64, 128)])
@pytest.mark.parametrize("seqlen_q", [17, 65, 129, 200])
def test_o_stored_by_the_copy_engine_stays_inside_its_view(rng, headdim, dv, seqlen_q):
    """The Hopper forward stores O with TMA boxes of 64 rows x 64 columns through a map of the
    output (sm90_fwd_epilogue.cuh): rows past seqlen_q, columns past headdim_v and the rows of other
    heads and batch entries around a strided out= view must stay as they were (NaN here), at every
    head dim, including boxes that start past the last row (the second warpgroup's at 17 rows; 16 or
    fewer run the split-KV kernel)."""
    cp = _arrays.cupy_module()
    batch, heads = 2, 3
    q = _rand(rng, (batch, seqlen_q, heads, headdim), ml_dtypes.bfloat16)
    k, v = _rand(rng, (batch, 90, heads, headdim), ml_dtypes.bfloat16), _rand(rng, (batch, 90, heads, dv), ml_dtypes.bfloat16)
    dv_pad = -(-dv // 8) * 8
    big = cp.full((batch + 1, seqlen_q + 70, heads + 2, dv_pad + 64), np.nan, dtype=q.dtype)
    out = big[1:, 3: 3 + seqlen_q, 1: 1 + heads, :dv]
    mask = cp.zeros(big.shape, dtype=bool)
    mask[1:, 3: 3 + seqlen_q, 1: 1 + heads, :dv] = True
    for causal in (False, True):
        big[...] = np.nan
        res = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), out=out, causal=causal)
        assert res is out
        ref = R.attention_ref(q, k, v, causal=causal)[0]
        naive = R.naive_attention(q, k, v, causal=causal)
        R.assert_exact(out.get(), ref, naive, f"out causal={causal}")
        assert bool(cp.isnan(big[~mask]).all()), "written outside the out= view"


@requires_hopper
def test_warm_calls_store_o_into_each_calls_own_output(rng):
    """A warm call re-points the map of O (cuflash/_fastpath.py): each call's result lands in its
    own output, earlier results stay as they were."""
    cp = _arrays.cupy_module()
    _fastpath.PLANS.clear()
    q, k, v = (cp.asarray(_rand(rng, (2, 300, 4, 128), ml_dtypes.bfloat16)) for _ in range(3))
    outs = [cuflash.attention(q * (i + 1), k, v) for i in range(3)]
    bufs = [cp.full(q.shape, np.nan, dtype=q.dtype) for _ in range(3)]
    for i, b in enumerate(bufs):
        assert cuflash.attention(q * (i + 1), k, v, out=b) is b
    assert len(_fastpath.PLANS) >= 2  # (the calls with and without out= took plans)
    for a, b in zip(outs, bufs):
        assert cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))
    assert not any(cp.array_equal(outs[0], o) for o in outs[1:])


@requires_hopper
@pytest.mark.parametrize("case", ["bhsd-batch1", "three-consumers"])
def test_o_stored_by_the_copy_engine_other_layouts(rng, case):
    """The map of O for a layout="bhsd" view of one batch entry (tile_map makes up the batch
    stride) and for the three-consumer tiles of d64's long rows (192-row panels): every element
    outside the out= view stays NaN."""
    cp = _arrays.cupy_module()
    if case == "bhsd-batch1":
        layout, shape, kshape = "bhsd", (1, 3, 200, 64), (1, 3, 90, 64)
        big = cp.full((1, 5, 260, 128), np.nan, dtype=ml_dtypes.bfloat16)
        view = (slice(None), slice(1, 4), slice(10, 210), slice(0, 64))
    else:
        layout, shape, kshape = "bshd", (1, _kernels.SM90_FWD_LONG_ROWS + 70, 1, 64), (1, 300, 1, 64)
        big = cp.full((1, shape[1] + 9, 2, 64), np.nan, dtype=ml_dtypes.bfloat16)
        view = (slice(None), slice(5, 5 + shape[1]), slice(1, 2), slice(None))
    q = _rand(rng, shape, ml_dtypes.bfloat16)
    k, v = _rand(rng, kshape, ml_dtypes.bfloat16), _rand(rng, kshape, ml_dtypes.bfloat16)
    out = big[view]
    mask = cp.zeros(big.shape, dtype=bool)
    mask[view] = True
    assert cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), out=out, causal=True, layout=layout) is out
    ref = R.attention_ref(q, k, v, causal=True, layout=layout)[0]
    R.assert_exact(out.get(), ref, R.naive_attention(q, k, v, causal=True, layout=layout), f"out ({case})")
    assert bool(cp.isnan(big[~mask]).all()), "written outside the out= view"


ORDERED_CASES = ["full", "causal", "window", "sections", "mask-tiles", "varlen"]


@requires_hopper
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", ORDERED_CASES)
def test_ordered_dq_backward_exact_and_bitwise_repeatable(rng, monkeypatch, headdim, case):
    """deterministic=True on the Hopper one-pass kernel with dQ's additions in a fixed order
    (CUFLASH_SM90_ORDERED_DQ=1: flash_bwd_sm90.cu's kDqOrdered, the key blocks that reach a query
    tile adding to it from the last to the first): exact against the float64 reference, and 20 calls
    give the same bits of dq, dk and dv (GQA: dK, dV sum 4 query heads).  "sections": more (batch,
    head) pairs than one section of the block order holds (sm90_scheduler.cuh's bwd_block);
    "mask-tiles": a mask that hides whole tiles, which pass their turn on without adding;
    "varlen": packed sequences with NaN rows past the last one and an empty one.  A counting error
    would hang a block (the wait traps after a minute) or change bits between calls."""
    monkeypatch.setenv("CUFLASH_SM90_ORDERED_DQ", "1")
    _fastpath.PLANS.clear()
    cp = _arrays.cupy_module()
    hq, hk = 8, 2
    if case == "varlen":
        cu_q = np.array([0, 300, 300, 877, 1000], dtype=np.int32)
        cu_k = np.array([0, 450, 470, 1100, 1330], dtype=np.int32)
        q = _rand(rng, (1030, hq, headdim), ml_dtypes.bfloat16)
        k, v = (_rand(rng, (1330, hk, headdim), ml_dtypes.bfloat16) for _ in range(2))
        dout = _rand(rng, (1030, hq, headdim), ml_dtypes.bfloat16)
        q[1000:], dout[1000:] = np.nan, np.nan  # rows no sequence owns
        args = [cp.asarray(x) for x in (q, k, v)]
        cu = [cp.asarray(cu_q), cp.asarray(cu_k)]
        out, lse = cuflash.attention_varlen(*args, *cu, causal=True, return_lse=True)

        def run():
            return cuflash.attention_varlen_backward(cp.asarray(dout), *args, out, lse, *cu, causal=True,
                                                     deterministic=True)
    else:
        batch, sq, sk = {"sections": (5, 300, 700)}.get(case, (2, 1000, 1300))
        heads = {"sections": (32, 8)}.get(case, (hq, hk))
        q, k, v = make_qkv(rng, ml_dtypes.bfloat16, batch, sq, sk, *heads, headdim)
        opts = {"full": {}, "causal": dict(causal=True), "window": dict(window_size=(300, 40)),
                "sections": dict(causal=True), "mask-tiles": {}}[case]
        ref_opts = dict(opts)
        if case == "mask-tiles":  # key blocks of 64 and 128 rows, query tiles of 64: whole hidden tiles
            mask = np.ones((batch, 1, sq, sk), dtype=bool)
            mask[:, :, 64:320, 128:640] = False
            mask[:, :, 700:, :256] = False
            mask[:, :, :, 1280:] = rng.random((batch, 1, sq, sk - 1280)) < 0.5
            opts["mask"], ref_opts["mask"] = cp.asarray(mask), mask
        args = [cp.asarray(x) for x in (q, k, v)]
        out, lse = cuflash.attention(*args, return_lse=True, **opts)
        dout = _rand(rng, tuple(out.shape), ml_dtypes.bfloat16)

        def run():
            return cuflash.attention_backward(cp.asarray(dout), *args, out, lse, deterministic=True, **opts)
    first = run()
    for _ in range(19):
        for name, x, y in zip(("dq", "dk", "dv"), first, run()):
            assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16)), f"{name} changed between calls"
    grads = [g.get() for g in first]
    if case == "varlen":
        _check_varlen_grads(grads, dout, q, k, v, cu_q, cu_k, causal=True)
        return
    refs = R.attention_backward_ref(dout, q, k, v, **ref_opts)
    naives = R.naive_attention_backward(dout, q, k, v, **ref_opts)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        R.assert_exact(g, r, n, name)


@requires_hopper
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_ordered_dq_backward_key_sequence_longer_than_max_seqlen_k(rng, monkeypatch, headdim):
    """A packed key sequence longer than max_seqlen_k (an error the kernels report; the grid holds
    only max_seqlen_k's key blocks): the ordered dQ form gives no turn to a block never launched, so
    the call ends (no hang, no trap), raises InvalidIndexError at the next synchronize, and the
    well-formed sequence's gradients are exact."""
    monkeypatch.setenv("CUFLASH_SM90_ORDERED_DQ", "1")
    _fastpath.PLANS.clear()
    cp = _arrays.cupy_module()
    cu_q, cu_k = np.array([0, 200, 400], dtype=np.int32), np.array([0, 150, 600], dtype=np.int32)
    q = _rand(rng, (400, 4, headdim), np.float16)
    k, v = (_rand(rng, (600, 2, headdim), np.float16) for _ in range(2))
    dout = _rand(rng, (400, 4, headdim), np.float16)
    args = [cp.asarray(x) for x in (q, k, v)]
    cu = [cp.asarray(cu_q), cp.asarray(cu_k)]
    for causal in (False, True):
        out, lse = cuflash.attention_varlen(*args, *cu, max_seqlen_q=200, max_seqlen_k=450, causal=causal,
                                            return_lse=True)
        cuflash.synchronize()  # (well formed for the forward: 450 keys)
        grads = cuflash.attention_varlen_backward(cp.asarray(dout), *args, out, lse, *cu, max_seqlen_q=200,
                                                  max_seqlen_k=300, causal=causal, deterministic=True)
        with pytest.raises(cuflash.InvalidIndexError, match="max_seqlen_k"):
            cuflash.synchronize()
        grads = [g.get() for g in grads]
        _check_varlen_grads([g[:200] if i == 0 else g[:150] for i, g in enumerate(grads)], dout[:200], q[:200],
                            k[:150], v[:150], cu_q[:2], cu_k[:2], causal=causal)
