"""The correctness sweep behind ``cuflash check``: forward and backward against the float64 reference.

Each case draws fresh random inputs, runs :func:`cuflash.attention` and
:func:`cuflash.attention_backward` on the chosen array module (NumPy: the CPU path; CuPy: the
kernels of this GPU) and reports the worst error ratio of the exactness rule,
``max|cuflash - ref64| / (2 max|naive - ref64| + 1e-5)`` over out, lse, dq, dk and dv; a case
passes when the ratio is at most 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _arrays, reference
from .api import attention, attention_backward

LENGTHS_FULL = ((1, 1), (7, 63), (129, 65), (200, 1000))
LENGTHS_QUICK = ((7, 63), (129, 65))
HEADDIMS_FULL = (32, 64, 96, 128, 256)
HEADDIMS_QUICK = (64, 128)
OPTIONS = (
    ("plain", {}),
    ("causal", {"causal": True}),
    ("top-left causal", {"causal": "top_left"}),
    ("window (16, 4)", {"window_size": (16, 4)}),
    ("softcap 5", {"softcap": 5.0, "causal": True}),
    ("alibi", {"alibi": True}),
    ("gqa 4:1", {"gqa": 4}),
    ("seqlens_k", {"seqlens_k": True, "causal": True}),
    ("bias (1, H, Sq, Sk)", {"bias": True}),
    ("key-padding mask", {"mask": True, "causal": True}),
)


@dataclass(frozen=True)
class Case:
    dtype: str
    headdim: int
    seqlen_q: int
    seqlen_k: int
    option: str
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.dtype} d{self.headdim} {self.seqlen_q}x{self.seqlen_k} {self.option}"


@dataclass(frozen=True)
class Result:
    case: Case
    forward_ratio: float
    backward_ratio: float

    @property
    def passed(self) -> bool:
        return self.forward_ratio <= 1.0 and self.backward_ratio <= 1.0


# What the GPU's float32 kernels (3xTF32) lack so far of OPTIONS (cuflash._gpu._wide_missing, issue
# 24; none since they take ALiBi): such cases are left out of a GPU sweep.  (float64 is not swept: the rule's 1e-5 floor is far above its
# errors, so a float64 case could not fail; tests/test_gpu_float64.py holds it to its own rule.)
GPU_FLOAT32_LACKS: frozenset = frozenset()


def cases(on_gpu: bool, quick: bool = False) -> list[Case]:
    """The sweep: dtypes x head dims x lengths, every option at one head dim and length."""
    dtypes = ("float16", "bfloat16", "float32")
    headdims = HEADDIMS_QUICK if quick else HEADDIMS_FULL
    lengths = LENGTHS_QUICK if quick else LENGTHS_FULL
    out = [Case(dt, d, sq, sk, "causal", {"causal": True}) for dt in dtypes for d in headdims for sq, sk in lengths]
    out += [Case(dt, 64, 129, 65, name, opts) for dt in dtypes for name, opts in OPTIONS
            if not (on_gpu and dt == "float32" and name in GPU_FLOAT32_LACKS)]
    unique = {c.label: c for c in out}  # the "causal" option case repeats one of the sweep's
    return list(unique.values())


def _dtype(name):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def run_case(case: Case, xp, rng) -> Result:
    """Forward (inputs x5 so errors show) and backward (unit scale) of one case on ``xp``."""
    opts = dict(case.options)
    batch, heads = 2, 4
    heads_k = heads // opts.pop("gqa", 1)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = (2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32)
    if opts.pop("seqlens_k", False):
        opts["seqlens_k"] = np.array([case.seqlen_k, max(case.seqlen_k // 2, 1)], dtype=np.int32)
    if opts.pop("bias", False):
        opts["bias"] = rng.standard_normal((1, heads, case.seqlen_q, case.seqlen_k)).astype(np.float32)
    if opts.pop("mask", False):  # batch entry 0 sees every key, entry 1 the first half (at least one)
        valid = np.array([case.seqlen_k, max(case.seqlen_k // 2, 1)])
        opts["mask"] = np.arange(case.seqlen_k)[None, None, None, :] < valid[:, None, None, None]
    dt = _dtype(case.dtype)

    def draw(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dt)

    dev = {k: (xp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in opts.items()}
    q = draw((batch, case.seqlen_q, heads, case.headdim), 5.0)
    k, v = (draw((batch, case.seqlen_k, heads_k, case.headdim)) for _ in range(2))
    out, lse = attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), return_lse=True, **dev)
    ref, ref_lse = reference.attention_ref(q, k, v, **opts)
    naive, naive_lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    fwd = max(reference.max_error_ratio(_arrays.to_numpy(out), ref, naive),
              reference.max_error_ratio(_arrays.to_numpy(lse), ref_lse, naive_lse))

    q = draw(q.shape)
    qd, kd, vd = xp.asarray(q), xp.asarray(k), xp.asarray(v)
    out, lse = attention(qd, kd, vd, return_lse=True, **dev)
    dout = draw(tuple(out.shape))
    grads = attention_backward(xp.asarray(dout), qd, kd, vd, out, lse, **dev)
    refs = reference.attention_backward_ref(dout, q, k, v, **opts)
    naives = reference.naive_attention_backward(dout, q, k, v, **opts)
    bwd = max(reference.max_error_ratio(_arrays.to_numpy(g), r, n) for g, r, n in zip(grads, refs, naives))
    return Result(case, fwd, bwd)
