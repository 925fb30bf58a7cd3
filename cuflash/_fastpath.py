"""Warm calls on CuPy arrays: replay the launch of an earlier call with the same signature.

A call's *signature* is everything validation and kernel choice depend on: the shapes, strides,
dtypes and devices of its arrays, and its options with their types (so that ``causal=1`` never
reuses a plan made for ``causal=True``).  The first call with a signature takes the full path;
``cuflash._gpu`` records its parameters and launches, and :func:`remember` keeps them as a
:class:`Plan` when every input was read in place (no padded, rewritten or realigned copy).  A
later call with the same signature checks only what the signature does not fix (pointer
alignment, the current device, ``out`` overlapping an input), writes the new pointers into a
copy of the recorded parameters and launches: a few microseconds instead of a hundred.  Calls
that do not return the LSE let the kernel write it to one scratch buffer per plan.  Anything else
(ALiBi slopes, NumPy index arrays, ``CUFLASH_DEBUG=1``, varlen calls without both max_seqlen
values) always takes the full path.
"""

from __future__ import annotations

import numpy as np

from . import _arrays, _gpu, _guard, _validate
from ._params import FlashParams

PLANS: dict = {}
_MAX_PLANS = 256


def signature(kind: str, arrays: tuple, options: tuple):
    """A key for a call of ``kind`` with these arrays (CuPy arrays or None) and options, or None
    when the call cannot take the fast path.  Options enter with their types (and the types of a
    tuple's items), so that a value the full path would reject never matches one it accepted."""
    nd = _arrays.cupy_module().ndarray
    layouts = []
    for a in arrays:
        if a is None:
            layouts.append(None)
        elif type(a) is nd:
            layouts.append((a.shape, a.strides, a.dtype, a.data.device_id))
        else:
            return None
    if _validate.debug_checks_enabled():
        return None
    item_types = tuple(tuple(map(type, o)) for o in options if type(o) is tuple)
    return kind, tuple(layouts), options, tuple(map(type, options)), item_types


def lookup(key):
    """The plan for ``key``, or None (also for keys holding an unhashable option, e.g. a list)."""
    try:
        return PLANS.get(key) if key is not None else None
    except TypeError:
        return None


def _span(a) -> int:
    """Bytes from a's first element to past its last (non-negative strides)."""
    return sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize if a.size else 0


class Plan:
    """One recorded forward call: its parameters, launches, and the outputs a replay allocates.

    ``fields`` names the FlashParams pointer of each input, q, k, v first.
    """

    def __init__(self, record, fields, inputs, out, out_given, lse_shape):
        self.device = record["device"]
        self.template = record["template"]
        self.launches = [(*launch[:4], *(m.detached() for m in launch[4:])) for launch in record["launches"]]
        self.accum = record["accum"]
        self.fields = fields
        self.out_shape, self.lse_shape, self.dtype = out.shape, lse_shape, out.dtype
        self.lse_dtype = np.float64 if out.dtype == np.float64 else np.float32  # (api.lse_dtype)
        self.spans = tuple(0 if a is None else _span(a) for a in inputs)  # (index arrays too: out must miss them)
        self.out_span = _span(out) if out_given else None
        self.scratch_lse = None  # written, never read, by calls that do not return the LSE
        self.has_maps = any(len(launch) > 4 for launch in self.launches)

    def run(self, inputs, out=None, need_lse=True):
        """(out, lse), or None when this call must take the full path after all."""
        cp = _arrays.cupy_module()
        q, k, v = inputs[:3]
        qp, kp, vp = q.data.ptr, k.data.ptr, v.data.ptr
        if (qp | kp | vp) % 16 or cp.cuda.runtime.getDevice() != self.device:
            return None
        if out is None:
            out = cp.empty(self.out_shape, dtype=self.dtype)
        else:
            op = out.data.ptr
            end = op + self.out_span
            if op % 16 or any(a is not None and op < a.data.ptr + n and a.data.ptr < end
                              for a, n in zip(inputs, self.spans)):
                return None  # the full path explains the problem
        if need_lse or _guard.capturing():  # a captured call keeps its own LSE buffer for the graph
            lse = cp.empty(self.lse_shape, dtype=self.lse_dtype)
        else:
            if self.scratch_lse is None:
                self.scratch_lse = cp.empty(self.lse_shape, dtype=self.lse_dtype)
            lse = self.scratch_lse
        prm = FlashParams.from_buffer_copy(self.template)
        for field, a in zip(self.fields, inputs):
            setattr(prm, field, None if a is None else a.data.ptr)
        prm.out, prm.lse = out.data.ptr, lse.data.ptr
        launches = self.launches
        if self.has_maps:  # tensor maps re-pointed at this call's q, k, v and out
            pointers = dict(q=qp, k=kp, v=vp, out=out.data.ptr)
            try:
                launches = [(fn, grid, block, smem, *(m.repointed(pointers) for m in extra))
                            for fn, grid, block, smem, *extra in launches]
            except RuntimeError:  # the driver refused: the full path encodes new maps
                return None
        _gpu.execute(prm, launches, self.accum)
        return out, lse


def remember(key, record, fields, inputs, out, out_given, lse_shape):
    """Keep a plan for ``key`` if the recorded launch read every input and wrote ``out`` in place."""
    prm = FlashParams.from_buffer_copy(record["template"])
    used = tuple(getattr(prm, f) for f in (*fields, "out"))
    given = tuple(None if a is None else a.data.ptr for a in (*inputs, out))
    if used != given or any(s < 0 for a in (*inputs[:3], out) for s in a.strides):
        return
    by_name = dict(zip((*fields, "out"), given))
    for launch in record["launches"]:  # tensor maps must read the given arrays too (not copies)
        if any(m.pointers != tuple(by_name.get(n) for n in m.names) for m in launch[4:]):
            return
    if len(PLANS) >= _MAX_PLANS:
        PLANS.clear()
    try:
        PLANS[key] = Plan(record, fields, inputs, out, out_given, lse_shape)
    except TypeError:  # an unhashable option
        pass
