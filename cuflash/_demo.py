"""The main job in one command (``cuflash demo``): exact, fast, and small in memory.

Runs a default problem through :func:`cuflash.attention` and :func:`cuflash.attention_backward`,
checks the output against the float64 reference on a slice of query rows (and the gradients on
a small problem), and times it against plain attention (matmul, softmax, matmul) on the same
device, reporting TF/s (4·B·H·S²·D, halved for causal; ×2.5 for the backward) and the memory the
score matrix would have needed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import _arrays, reference
from ._io_model import attention_flops
from .api import attention, attention_backward


@dataclass(frozen=True)
class DemoConfig:
    batch: int
    seqlen: int
    heads: int
    headdim: int
    dtype: str
    causal: bool = True


GPU_DEFAULT = DemoConfig(batch=4, seqlen=4096, heads=16, headdim=128, dtype="bfloat16")
CPU_DEFAULT = DemoConfig(batch=1, seqlen=1024, heads=4, headdim=64, dtype="float32")


def _flops(cfg: DemoConfig, backward: bool = False) -> float:
    return attention_flops(cfg.batch, cfg.heads, cfg.seqlen, cfg.seqlen, cfg.headdim, cfg.causal, backward)


def _matmul_dtype(xp, q, k, v):
    """CuPy has no bfloat16 matmul: plain attention then runs in float16 (same size and speed)."""
    if xp is not np and np.dtype(q.dtype) == ml_dtypes.bfloat16:
        return tuple(x.astype(np.float16) for x in (q, k, v))
    return q, k, v


def plain_attention(xp, q, k, v, causal: bool):
    """softmax(q kᵀ / sqrt(d)) v with the full score matrix, (B, S, H, D) in, the softmax in fp32
    (float64 inputs: in float64)."""
    q, k, v = _matmul_dtype(xp, q, k, v)
    acc = np.promote_types(q.dtype, np.float32)
    qh, kh, vh = (x.swapaxes(1, 2) for x in (q, k, v))
    s = xp.matmul(qh, kh.swapaxes(-1, -2)).astype(acc) * acc.type(1 / math.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = xp.where(xp.tri(n, dtype=bool), s, acc.type(-np.inf))
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return xp.matmul(p.astype(q.dtype), vh).swapaxes(1, 2)


def plain_attention_backward(xp, q, k, v, dout, causal: bool):
    """Gradients of :func:`plain_attention` the standard way: P recomputed in full, fp32 softmax
    (float64 inputs: float64).

    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P)), dQ = dS K / sqrt(d), dK = dSᵀ Q / sqrt(d).
    """
    acc = np.promote_types(q.dtype, np.float32)
    scale = acc.type(1 / math.sqrt(q.shape[-1]))
    (q, k, v), dout = _matmul_dtype(xp, q, k, v), _matmul_dtype(xp, dout, dout, dout)[0]
    qh, kh, vh, doh = (x.swapaxes(1, 2) for x in (q, k, v, dout))
    s = xp.matmul(qh, kh.swapaxes(-1, -2)).astype(acc) * scale
    if causal:
        n = s.shape[-1]
        s = xp.where(xp.tri(n, dtype=bool), s, acc.type(-np.inf))
    p = xp.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dv = xp.matmul(p.astype(q.dtype).swapaxes(-1, -2), doh)
    dp = xp.matmul(doh, vh.swapaxes(-1, -2)).astype(acc)
    ds = (p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale).astype(q.dtype)
    dq, dk = xp.matmul(ds, kh), xp.matmul(ds.swapaxes(-1, -2), qh)
    return tuple(x.swapaxes(1, 2) for x in (dq, dk, dv))


REPEATS = 5  # timed runs per side; the median is reported (one run swings by 30 % on a busy CPU)


def _timer(xp):
    """Median seconds of ``repeat`` calls of fn(), synchronising the GPU around each."""
    def run(fn, repeat=REPEATS):
        times = []
        for _ in range(repeat):
            if xp is not np:
                xp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            if xp is not np:
                xp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))
    return run


def _rows_reference(q, k, v, rows, causal):
    """Float64 attention for query rows ``rows`` of batch 0, head 0 (bottom-right causal, Sq == Sk)."""
    q0, k0, v0 = (np.asarray(x[0, :, 0], dtype=np.float64) for x in (q, k, v))
    s = q0[rows] @ k0.T / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.arange(k0.shape[0])[None, :] <= rows[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v0


def run(cfg: DemoConfig, xp, step=lambda label: None) -> dict:
    """Run the demo problem on ``xp`` (numpy or cupy) and return the numbers to print."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    rng = np.random.default_rng(0)
    shape = (cfg.batch, cfg.seqlen, cfg.heads, cfg.headdim)
    host = [rng.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(3)]
    q, k, v = (xp.asarray(x) for x in host)
    timer = _timer(xp)
    step("forward")
    out, lse = attention(q, k, v, causal=cfg.causal, return_lse=True)
    t_fwd = timer(lambda: attention(q, k, v, causal=cfg.causal))
    rows = np.arange(cfg.seqlen - 64, cfg.seqlen)
    ref = _rows_reference(*host, rows, cfg.causal)
    fwd_err = float(np.abs(_arrays.to_numpy(out)[0, rows, 0].astype(np.float64) - ref).max())

    step("backward")
    dout = xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dt))
    attention_backward(dout, q, k, v, out, lse, causal=cfg.causal)
    t_bwd = timer(lambda: attention_backward(dout, q, k, v, out, lse, causal=cfg.causal), repeat=3)
    small = [x[:1, :256, :2] for x in host]  # gradients checked in full on a small problem
    sq, sk, sv = (xp.asarray(np.ascontiguousarray(x)) for x in small)
    so, slse = attention(sq, sk, sv, causal=cfg.causal, return_lse=True)
    sdo = rng.standard_normal(tuple(so.shape), dtype=np.float32).astype(dt)
    grads = attention_backward(xp.asarray(sdo), sq, sk, sv, so, slse, causal=cfg.causal)
    refs = reference.attention_backward_ref(sdo, *small, causal=cfg.causal)
    naives = reference.naive_attention_backward(sdo, *small, causal=cfg.causal)
    bwd_ratio = max(reference.max_error_ratio(_arrays.to_numpy(g), r, n) for g, r, n in zip(grads, refs, naives))

    step("plain attention")
    try:
        t_plain = timer(lambda: plain_attention(xp, q, k, v, cfg.causal))
    except Exception as exc:  # out of memory is the point of the comparison
        t_plain = None
        plain_error = f"{type(exc).__name__}: {exc}"
    else:
        plain_error = None
    return {
        "forward_error": fwd_err, "backward_ratio": bwd_ratio,
        "forward_s": t_fwd, "backward_s": t_bwd, "plain_s": t_plain, "plain_error": plain_error,
        "forward_tflops": _flops(cfg) / t_fwd / 1e12,
        "backward_tflops": _flops(cfg, backward=True) / t_bwd / 1e12,
        "score_bytes": cfg.batch * cfg.heads * cfg.seqlen**2 * np.dtype(np.float32).itemsize,
    }
