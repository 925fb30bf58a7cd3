"""The warm-call fast path's bookkeeping (cuflash._fastpath) with a stand-in for CuPy: no GPU.

What a replay may skip rests on the signature: these tests pin which calls share one, when a
recorded launch may be kept, and what a replay still checks (alignment, device, overlap).
The GPU behaviour itself is in tests/test_gpu_fastpath.py.
"""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _arrays, _fastpath, _gpu
from cuflash._params import FlashParams

_pointers = itertools.count(1 << 20, 1 << 16)  # 64 KiB apart: fresh allocations never overlap


class FakeArray:
    """Just what the fast path reads from a CuPy array."""

    def __init__(self, shape, strides=None, ptr=None, dtype=np.float16, device=0):
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.shape = tuple(shape)
        self.strides = strides or tuple(int(s) * self.itemsize for s in np.cumprod((1,) + self.shape[:0:-1])[::-1])
        self.size = int(np.prod(self.shape))
        self.data = SimpleNamespace(ptr=next(_pointers) if ptr is None else ptr, device_id=device)


@pytest.fixture
def fake_cupy(monkeypatch):
    launched = []
    cp = SimpleNamespace(
        ndarray=FakeArray,
        float32=np.float32,
        empty=lambda shape, dtype: FakeArray(shape, dtype=dtype),
        cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 0)),
    )
    monkeypatch.setattr(_arrays, "cupy_module", lambda: cp)
    monkeypatch.setattr(_gpu, "execute", lambda prm, launches, accum: launched.append(FlashParams.from_buffer_copy(prm)))
    monkeypatch.setattr(_fastpath, "PLANS", {})
    monkeypatch.delenv("CUFLASH_DEBUG", raising=False)
    return launched


def _qkv():
    return FakeArray((2, 64, 4, 64)), FakeArray((2, 64, 4, 64)), FakeArray((2, 64, 4, 64))


def _record(q, k, v, out, seqlens_k=None):
    prm = FlashParams()
    prm.q, prm.k, prm.v, prm.out = q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr
    prm.seqlens_k = None if seqlens_k is None else seqlens_k.data.ptr
    return dict(device=0, template=bytes(prm), launches=[], accum=None)


OPTIONS = (None, True, (-1, -1), 0.0, False, "bshd")


def test_signature_keeps_option_types_apart(fake_cupy):
    q, k, v = _qkv()
    key = _fastpath.signature("attention", (q, k, v, None, None), OPTIONS)
    assert key == _fastpath.signature("attention", (q, k, v, None, None), OPTIONS)
    for changed in ((None, 1, (-1, -1), 0.0, False, "bshd"),          # causal=1, not True
                    (None, True, (-1.0, -1), 0.0, False, "bshd"),     # a float in the window
                    (None, True, (-1, -1), 0, False, "bshd"),         # softcap=0, not 0.0
                    (None, True, (-1, -1), 0.0, np.False_, "bshd")):  # numpy bool
        assert _fastpath.signature("attention", (q, k, v, None, None), changed) != key
    other = FakeArray(q.shape, strides=q.strides)  # another array with the same layout
    assert _fastpath.signature("attention", (other, k, v, None, None), OPTIONS) == key
    moved = FakeArray(q.shape, device=1)
    assert _fastpath.signature("attention", (moved, k, v, None, None), OPTIONS) != key


def test_calls_that_never_take_the_fast_path(fake_cupy, monkeypatch):
    q, k, v = _qkv()
    assert _fastpath.signature("attention", (q, k, np.zeros(3), None, None), OPTIONS) is None  # NumPy array
    listed = _fastpath.signature("attention", (q, k, v, None, None), (None, True, [-1, -1], 0.0, False, "bshd"))
    assert _fastpath.lookup(listed) is None  # unhashable list: no error, no plan
    monkeypatch.setenv("CUFLASH_DEBUG", "1")
    assert _fastpath.signature("attention", (q, k, v, None, None), OPTIONS) is None


def test_plan_kept_only_for_launches_that_read_the_inputs_in_place(fake_cupy):
    q, k, v = _qkv()
    out = FakeArray((2, 64, 4, 64))
    key = _fastpath.signature("attention", (q, k, v, None, None), OPTIONS)
    copy = FakeArray(q.shape)  # the full path padded or realigned q
    _fastpath.remember(key, _record(copy, k, v, out), ("q", "k", "v", "seqlens_k"), (q, k, v, None), out, False, (2, 4, 64))
    assert _fastpath.lookup(key) is None
    reversed_view = FakeArray(q.shape, strides=(q.strides[0], -q.strides[1], *q.strides[2:]), ptr=q.data.ptr)
    _fastpath.remember(key, _record(reversed_view, k, v, out), ("q", "k", "v", "seqlens_k"), (reversed_view, k, v, None),
                       out, False, (2, 4, 64))
    assert _fastpath.lookup(key) is None  # negative strides: spans would be wrong
    _fastpath.remember(key, _record(q, k, v, out), ("q", "k", "v", "seqlens_k"), (q, k, v, None), out, False, (2, 4, 64))
    assert _fastpath.lookup(key) is not None


def test_replay_writes_new_pointers_and_checks_what_the_signature_does_not_fix(fake_cupy):
    q, k, v = _qkv()
    out = FakeArray((2, 64, 4, 64))
    key = _fastpath.signature("attention", (q, k, v, None, out), OPTIONS)
    _fastpath.remember(key, _record(q, k, v, out), ("q", "k", "v", "seqlens_k"), (q, k, v, None), out, True, (2, 4, 64))
    plan = _fastpath.lookup(key)

    q2, k2, v2 = _qkv()
    out2 = FakeArray(out.shape)
    res_out, lse = plan.run((q2, k2, v2, None), out2)
    assert res_out is out2 and lse.shape == (2, 4, 64)
    prm = fake_cupy[-1]
    assert (prm.q, prm.k, prm.v, prm.out, prm.lse) == (q2.data.ptr, k2.data.ptr, v2.data.ptr, out2.data.ptr, lse.data.ptr)

    misaligned = FakeArray(q.shape, ptr=q2.data.ptr + 2)
    assert plan.run((misaligned, k2, v2, None), out2) is None
    overlapping = FakeArray(out.shape, ptr=v2.data.ptr + 128)
    assert plan.run((q2, k2, v2, None), overlapping) is None
    assert len(fake_cupy) == 1  # neither refused call launched anything


def test_scratch_lse_is_reused_but_never_returned_when_asked_for(fake_cupy):
    q, k, v = _qkv()
    out = FakeArray((2, 64, 4, 64))
    key = _fastpath.signature("attention", (q, k, v, None, None), OPTIONS)
    _fastpath.remember(key, _record(q, k, v, out), ("q", "k", "v", "seqlens_k"), (q, k, v, None), out, False, (2, 4, 64))
    plan = _fastpath.lookup(key)
    _, scratch_a = plan.run((q, k, v, None), need_lse=False)
    _, scratch_b = plan.run((q, k, v, None), need_lse=False)
    _, fresh = plan.run((q, k, v, None), need_lse=True)
    assert scratch_a is scratch_b and fresh is not scratch_a
