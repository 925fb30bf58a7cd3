"""The dropout generator (cuflash/dropout.py) and the oracle's dropout and LSE gradient
(cuflash/reference.py), on the CPU; the GPU draws the same mask (test at the end)."""

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.dropout import keep_threshold, philox4x32_10

from .conftest import requires_gpu


@pytest.mark.parametrize("counter, key, expect", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expect):
    """Random123's known-answer vectors for Philox4x32-10 (Salmon et al. 2011)."""
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == expect


def test_mask_is_a_function_of_seed_and_position():
    shape = (2, 3, 33, 70)
    a = cuflash.dropout_mask(7, shape, 0.3)
    assert np.array_equal(a, cuflash.dropout_mask((7, 0), shape, 0.3))
    # Longer sequences keep the mask of the shorter ones: the position alone decides.
    assert np.array_equal(a, cuflash.dropout_mask(7, (2, 3, 40, 90), 0.3)[:, :, :33, :70])
    assert not np.array_equal(a, cuflash.dropout_mask(8, shape, 0.3))
    assert not np.array_equal(a, cuflash.dropout_mask((7, 1), shape, 0.3))
    assert cuflash.dropout_mask(7, shape, 0.0).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_within_binomial_bounds(p):
    keep = cuflash.dropout_mask((123, 456), (4, 8, 128, 128), p)
    n = keep[0, 0].size
    for rate in (1 - keep).reshape(32, -1).mean(axis=1):  # per (batch, head)
        assert abs(rate - p) < 5 * np.sqrt(p * (1 - p) / n)
    # Different offsets give independent masks: agreement as for two independent draws.
    other = cuflash.dropout_mask((123, 457), (4, 8, 128, 128), p)
    agree = (keep == other).mean()
    expect = p * p + (1 - p) * (1 - p)
    assert abs(agree - expect) < 5 * np.sqrt(expect * (1 - expect) / keep.size)


def test_threshold_and_bad_arguments():
    assert keep_threshold(0.0) == 2**16 and keep_threshold(0.5) == 2**15 and keep_threshold(1 - 2**-17) in (0, 1)
    for bad, exc in ((-0.1, ValueError), (1.0, ValueError), ("0.1", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="dropout_p"):
            cuflash.dropout_mask(1, (1, 1, 2, 2), bad)
    for seed, exc in ((1.5, TypeError), ((1, 2, 3), TypeError), (-1, ValueError), ((1, 2**64), ValueError),
                      (True, TypeError)):
        with pytest.raises(exc, match="dropout_seed"):
            cuflash.dropout_mask(seed, (1, 1, 2, 2), 0.1)
    with pytest.raises(ValueError, match="shape must be 4 non-negative ints"):
        cuflash.dropout_mask(1, (1, 2, 2), 0.1)
    for seed, exc in ((np.zeros(3, np.int64), ValueError), (np.zeros(2, np.float64), TypeError),
                      (np.zeros((1, 2), np.int64), ValueError)):
        with pytest.raises(exc, match="dropout_seed as an array must"):
            cuflash.dropout_mask(seed, (1, 1, 2, 2), 0.1)


def test_a_numpy_seed_array_is_the_pair():
    """dropout_seed as a NumPy (2,) integer array means (seed, offset), as the GPU's (2,) int64 array will."""
    pair = cuflash.dropout_mask((7, 3), (1, 2, 5, 6), 0.4)
    for dtype in (np.int64, np.uint64, np.int32):
        assert np.array_equal(cuflash.dropout_mask(np.array([7, 3], dtype), (1, 2, 5, 6), 0.4), pair)
    assert np.array_equal(cuflash.dropout_mask(np.array(7), (1, 2, 5, 6), 0.4), cuflash.dropout_mask(7, (1, 2, 5, 6), 0.4))


def test_mask_is_drawn_in_pieces_with_the_same_bits(monkeypatch):
    """dropout_mask draws a few rows (or part of a row) at a time into its output: the same bits
    as one draw over every position (keep_mask_block on the whole index grid), and at a 4096 x
    4096 mask the mask's own memory and one piece's temporaries (~80 bytes an element: 100 MB;
    was 80 bytes for every element of the mask, 1.3 GB)."""
    import tracemalloc

    from cuflash import dropout

    shape = (2, 3, 37, 70)
    whole = dropout.keep_mask_block(9, 4, 0.3, np.arange(6, dtype=np.uint64).reshape(2, 3, 1, 1),
                                    np.arange(37, dtype=np.uint64)[:, None], np.arange(70, dtype=np.uint64), np)
    for chunk in (1 << 20, 1000, 70, 33, 1):  # whole, rows, one row, part of a row, one element
        monkeypatch.setattr(dropout, "_DRAW_CHUNK", chunk)
        assert np.array_equal(cuflash.dropout_mask((9, 4), shape, 0.3), whole), chunk
    monkeypatch.undo()
    tracemalloc.start()
    keep = cuflash.dropout_mask(1, (1, 1, 4096, 4096), 0.5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert keep.nbytes == 2**24 and peak < keep.nbytes + 120 * dropout._DRAW_CHUNK


def test_masks_past_memory_are_refused_naming_the_shape():
    """A mask larger than the machine's memory (or than an array can hold) is a ValueError naming
    the shape, at once (was NumPy's own allocation error from a temporary 80 times the mask)."""
    for shape in ((1, 1, 2**40, 2**20), (2**40,) * 4):
        with pytest.raises(ValueError, match=r"shape \(.*\) (asks for a keep-mask of|has \d+ elements)"):
            cuflash.dropout_mask(1, shape, 0.5)


def test_empty_masks_build_no_index_ranges():
    """A mask with no element is returned at once, whatever the other axes' lengths (the index
    ranges of a (1, 1, 0, 2**40) shape would take terabytes)."""
    for shape in ((1, 1, 0, 2**40), (2**40, 1, 1, 0)):
        keep = cuflash.dropout_mask(1, shape, 0.5)
        assert keep.shape == shape and keep.dtype == bool


def test_vjp_takes_every_seed_form_attention_takes():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 5, 2, 4)) for _ in range(3))
    for seed in (np.array(5), np.array([5, 0]), 5, (5, 0), [5, 0], np.int64(5)):
        out, vjp = cuflash.attention_vjp(q, k, v, dropout_p=0.3, dropout_seed=seed)
        assert np.array_equal(out, cuflash.attention(q, k, v, dropout_p=0.3, dropout_seed=5))
        assert len(vjp(np.ones_like(out))) == 3


def _problem(rng, b=2, sq=9, sk=13, hq=4, hk=2, d=8):
    return (rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hk, d)),
            rng.standard_normal((b, sk, hk, d)))


def test_reference_dropout_forward():
    rng = np.random.default_rng(0)
    q, k, v = _problem(rng)
    keep = cuflash.dropout_mask(5, (2, 4, 9, 13), 0.25)
    out, lse, probs = reference.attention_ref(q, k, v, causal=True, dropout_p=0.25, dropout_keep=keep,
                                              return_probs=True)
    plain, plain_lse = reference.attention_ref(q, k, v, causal=True)
    assert np.array_equal(lse, plain_lse)  # the LSE ignores dropout
    vv = np.repeat(v, 2, axis=2).swapaxes(1, 2)
    expect = (np.where(keep, probs / 0.75, 0) @ vv).swapaxes(1, 2)
    assert np.allclose(out, expect)
    with pytest.raises(ValueError, match="dropout_keep"):
        reference.attention_ref(q, k, v, dropout_p=0.25)


@pytest.mark.parametrize("dropout", [False, True])
def test_reference_gradients_by_central_differences(dropout):
    """dq, dk, dv, dbias and the LSE gradient of the oracle against central differences of the
    loss sum(dout * out) + sum(dlse * lse) (the keep-mask held fixed)."""
    rng = np.random.default_rng(1)
    q, k, v = _problem(rng, b=1, sq=5, sk=6, hq=2, hk=1, d=4)
    bias = rng.standard_normal((1, 2, 5, 1))  # broadcast over keys: dbias sums over them
    mask = rng.random((1, 1, 5, 6)) > 0.2
    mask[..., 0] = True
    opts = dict(causal=True, softcap=3.0, bias=bias, mask=mask)
    if dropout:
        opts.update(dropout_p=0.3, dropout_keep=cuflash.dropout_mask(11, (1, 2, 5, 6), 0.3))
    dout, dlse = rng.standard_normal((1, 5, 2, 4)), rng.standard_normal((1, 2, 5))

    def loss(q_, k_, v_, bias_):
        out, lse = reference.attention_ref(q_, k_, v_, **dict(opts, bias=bias_))
        return float((out * dout).sum() + (np.where(np.isinf(lse), 0, lse) * dlse).sum())

    grads = reference.attention_backward_ref(dout, q, k, v, dlse=dlse, **opts)
    eps = 1e-6
    for idx, x in enumerate((q, k, v, bias)):
        num = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            args = [q, k, v, bias]
            hi, lo = x.copy(), x.copy()
            hi[pos] += eps
            lo[pos] -= eps
            args[idx] = hi
            f_hi = loss(*args)
            args[idx] = lo
            num[pos] = (f_hi - loss(*args)) / (2 * eps)
        assert np.allclose(grads[idx], num, atol=1e-6, rtol=1e-5), idx


@requires_gpu
@pytest.mark.gpu
def test_gpu_mask_equals_cpu_mask():
    from cuflash import _arrays

    cp = _arrays.cupy_module()
    shape = (2, 3, 77, 130)
    gpu = cuflash.dropout_mask((99, 3), shape, 0.2, like=cp.zeros(1))
    assert isinstance(gpu, cp.ndarray)
    assert np.array_equal(gpu.get(), cuflash.dropout_mask((99, 3), shape, 0.2))
