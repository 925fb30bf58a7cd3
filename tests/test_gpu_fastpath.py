"""Warm calls replay an earlier launch (cuflash._fastpath): same answers, same errors.

Each test makes a plan with a first call, then checks that later calls with the same signature
(new data, new pointers) give the reference answer and that anything the signature does not fix
(misaligned pointers, an out that overlaps an input) still takes the full path.  Skipped without
a CUDA GPU.
"""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _fastpath

from .conftest import requires_gpu
from .test_gpu_forward import _check, _cp, _rand

pytestmark = [pytest.mark.gpu, requires_gpu]

CASES = {
    "plain": dict(shape=(2, 130, 4, 64), kv_heads=4, opts={}),
    "causal-gqa": dict(shape=(2, 70, 8, 128), kv_heads=2, opts=dict(causal=True)),
    "decode-split": dict(shape=(1, 1, 32, 128), kv_heads=8, sk=5000, opts={}),
    "window-softcap": dict(shape=(1, 65, 2, 96), kv_heads=1, opts=dict(window_size=(9, 3), softcap=4.0)),
}


@pytest.mark.parametrize("name", CASES)
def test_replay_matches_reference_on_new_data(rng, name):
    c = CASES[name]
    b, sq, h, d = c["shape"]
    sk = c.get("sk", sq + 17)
    for _ in range(3):  # first call records, the others replay with new arrays
        q = _rand(rng, (b, sq, h, d), ml_dtypes.bfloat16, 3.0)
        k, v = _rand(rng, (b, sk, c["kv_heads"], d), ml_dtypes.bfloat16), _rand(rng, (b, sk, c["kv_heads"], d), ml_dtypes.bfloat16)
        _check(q, k, v, **c["opts"])  # out= and return_lse=True
        cp = _cp()
        qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
        fresh = cuflash.attention(qd, kd, vd, **c["opts"])  # out allocated by cuflash
        again = cuflash.attention(qd, kd, vd, **c["opts"])
        assert np.array_equal(fresh.get().view(np.uint16), again.get().view(np.uint16))
    assert any(key[0] == "attention" and key[1][0][0] == (b, sq, h, d) for key in _fastpath.PLANS), "no plan was recorded"


@pytest.mark.parametrize("name", ["plain", "causal-gqa"])
def test_replay_of_the_hopper_forward_repoints_its_tensor_maps(rng, name):
    """Issue 21: the warp-specialised Hopper forward takes tensor maps of q, k, v; a replay must
    point them at the new arrays (cuTensorMapReplaceAddress), not read the first call's."""
    from cuflash import _gpu, _kernels

    if not _gpu._is_hopper(_cp().cuda.Device().id) or _kernels.sm90_disabled():
        pytest.skip("the Hopper forward needs a compute-capability-9.0 GPU")
    _fastpath.PLANS.clear()
    test_replay_matches_reference_on_new_data(rng, name)
    assert any(len(launch) > 4 for plan in _fastpath.PLANS.values() for launch in plan.launches), "no map replay"
    _fastpath.PLANS.clear()


def test_seqlens_k_and_bhsd_layout(rng):
    cp = _cp()
    q = cp.asarray(_rand(rng, (3, 4, 40, 64), np.float16, 3.0))  # bhsd
    k, v = (cp.asarray(_rand(rng, (3, 4, 90, 64), np.float16)) for _ in range(2))
    for lengths in ([90, 1, 45], [0, 90, 7], [3, 3, 3]):
        sk = cp.asarray(np.array(lengths, dtype=np.int32))
        out, lse = cuflash.attention(q, k, v, seqlens_k=sk, layout="bhsd", return_lse=True)
        for b, n in enumerate(lengths):
            ref, ref_lse = cuflash.attention(q[b:b + 1, :, :, :].get(), k[b:b + 1, :, :n].get(), v[b:b + 1, :, :n].get(),
                                             layout="bhsd", return_lse=True)
            np.testing.assert_allclose(out[b:b + 1].get().astype(np.float32), ref.astype(np.float32), atol=2e-3)
            np.testing.assert_allclose(lse[b:b + 1].get(), ref_lse, atol=1e-4)


def test_misaligned_pointer_with_a_known_signature_is_copied(rng):
    """q[..., 1:65] has the strides of q[..., 0:64] but a pointer 2 bytes off: full path, right answer."""
    cp = _cp()
    big = cp.asarray(_rand(rng, (1, 50, 2, 72), np.float16, 3.0))
    k, v = (cp.asarray(_rand(rng, (1, 60, 2, 64), np.float16)) for _ in range(2))
    aligned = cuflash.attention(big[..., 0:64], k, v)  # records a plan for these strides
    shifted = cuflash.attention(big[..., 1:65], k, v)
    ref = cuflash.attention(big[..., 1:65].get(), k.get(), v.get())
    np.testing.assert_allclose(shifted.get().astype(np.float32), ref.astype(np.float32), atol=2e-3)
    assert aligned.shape == shifted.shape


def test_overlapping_out_still_raises_after_warm_calls(rng):
    cp = _cp()
    qkv = cp.asarray(_rand(rng, (1, 33, 3, 2, 64), np.float16))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = cp.empty((1, 33, 3, 2, 64), np.float16)[:, :, 0]  # the strides of the q, k, v views
    for _ in range(2):
        cuflash.attention(q, k, v, out=out)
    with pytest.raises(ValueError, match="out overlaps"):
        cuflash.attention(q, k, v, out=qkv[:, :, 2])  # same signature as the plan, but it is v's memory


def test_out_overlapping_seqlens_k_still_raises_after_warm_calls(rng):
    """Session 38's review: the replay compared out with q, k and v only, so an out over
    seqlens_k (refused by the full path) was launched once a plan existed."""
    cp = _cp()
    q, k, v = (cp.asarray(_rand(rng, (1, 4, 1, 64), np.float16)) for _ in range(3))
    for _ in range(2):
        cuflash.attention(q, k, v, seqlens_k=cp.array([3], cp.int32), out=cp.empty((1, 4, 1, 64), np.float16))
    buf = cp.zeros(256, np.float16)
    out, lens = buf.reshape(1, 4, 1, 64), buf[254:].view(cp.int32)  # lens: the last 4 bytes of out
    lens[...] = 3
    with pytest.raises(ValueError, match="out overlaps seqlens_k"):
        cuflash.attention(q, k, v, seqlens_k=lens, out=out)


def test_option_types_are_part_of_the_signature(rng):
    cp = _cp()
    q = cp.asarray(_rand(rng, (1, 9, 2, 64), np.float16))
    cuflash.attention(q, q, q, causal=True, return_lse=True)
    cuflash.attention(q, q, q, causal=True, return_lse=True)
    with pytest.raises(TypeError, match="return_lse"):
        cuflash.attention(q, q, q, causal=True, return_lse=1)


def test_returned_lse_is_never_the_scratch_buffer(rng):
    """Calls without return_lse write a per-plan scratch LSE; a returned LSE is always fresh."""
    cp = _cp()
    q = cp.asarray(_rand(rng, (1, 20, 2, 64), np.float16, 3.0))
    for _ in range(3):
        cuflash.attention(q, q, q)
    _, lse1 = cuflash.attention(q, q, q, return_lse=True)
    _, lse2 = cuflash.attention(q, q, q, return_lse=np.True_)
    cuflash.attention(q, q, q)  # writes the scratch again
    assert lse1.data.ptr != lse2.data.ptr
    _, ref = cuflash.attention(q.get(), q.get(), q.get(), return_lse=True)
    np.testing.assert_allclose(lse1.get(), ref, atol=1e-4)
    np.testing.assert_allclose(lse2.get(), ref, atol=1e-4)


@pytest.mark.parametrize("return_lse", [True, False])
def test_varlen_replay_with_new_offsets_zeroes_rows_of_no_sequence(rng, return_lse):
    """Replays keep attention_varlen's contract: each sequence exact, rows past cu_seqlens_q[-1]
    0 (and LSE -inf) even in a NaN-poisoned out=, for new data and new offsets of the same shape."""
    from cuflash.reference import assert_exact, attention_ref, naive_attention

    cp = _cp()
    total, h, d = 300, 4, 64
    offsets = ([0, 100, 100, 250], [0, 3, 150, 290], [0, 0, 299, 299], [0, 120, 200, 260])
    for cu in offsets:  # the first call records; the others replay
        q, k, v = (_rand(rng, (total, h, d), ml_dtypes.bfloat16, s) for s in (3.0, 1.0, 1.0))
        cu_d = cp.asarray(np.array(cu, dtype=np.int32))
        out = cp.full((total, h, d), np.nan, dtype=ml_dtypes.bfloat16)
        res = cuflash.attention_varlen(cp.asarray(q), cp.asarray(k), cp.asarray(v), cu_d, cu_d, max_seqlen_q=299,
                                       max_seqlen_k=299, causal=True, out=out, return_lse=return_lse)
        got, lse = res if return_lse else (res, None)
        assert got is out
        got = got.get()
        for s, e in zip(cu[:-1], cu[1:]):
            if e > s:
                seq = (x[None, s:e] for x in (q, k, v))
                ref = attention_ref(*seq, causal=True)
                naive = naive_attention(*(x[None, s:e] for x in (q, k, v)), causal=True, return_lse=True)
                assert_exact(got[None, s:e], ref[0], naive[0], "out")
                if return_lse:
                    assert_exact(lse.get()[None, :, s:e], ref[1], naive[1], "lse")
        assert not got[cu[-1]:].astype(np.float32).any()
        if return_lse:
            assert np.all(lse.get()[:, cu[-1]:] == -np.inf)
    assert any(key[0] == "varlen" for key in _fastpath.PLANS), "no plan was recorded"
