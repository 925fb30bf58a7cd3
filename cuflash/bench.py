"""Attention throughput of cuflash and of the peers present on this machine, in one run.

TF/s = FLOPs / time with the FlashAttention benchmark convention: forward FLOPs = 4·B·H·Sq·Sk·D,
halved when causal; backward = 2.5 × forward.  Standard sweep (FlashAttention-2/3 papers):
batch·seqlen = 16k tokens, nheads·headdim = 2048, head dims 64/128/256, seqlen 512 … 16k.
Every cuflash configuration is checked against plain attention on a slice before it is timed.
Peers: plain CuPy attention (matmul, softmax, matmul) always; torch SDPA (flash and cuDNN
backends), JAX's cuDNN attention and FlashAttention-3 (the ``flash-attn3-jax`` wheel, head dim
128) when importable.  cuflash never imports them.

Usage: cuflash bench [--suite standard|paper|decode|varlen|host] [--backward] [--json FILE] [--plot FILE.png] ...
(or python scripts/bench.py with the same options).  Needs a GPU with CuPy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash

from . import _demo
from ._io_model import attention_flops

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32, "fp64": np.float64}


def _plain_progress(items, label):
    """Without click's progress bar: each finished row is printed as JSON instead."""
    return contextlib.nullcontext(items)


def _echo(row, progress):
    if progress is _plain_progress:
        print(json.dumps(row), flush=True)


def time_gpu(fn, *, warmup=3, reps=20, max_seconds=2.0, batch_ms=5.0):
    """Median milliseconds per fn() call, measured with CUDA events on the current stream.

    Calls shorter than ``batch_ms`` are timed in back-to-back batches between one pair of events
    (as a program calling them in a loop runs them): the host work of a call then overlaps the
    kernels queued before it, and is only counted where it is longer than they are.  A callable
    with a ``wait`` attribute (JAX's, _jitted_call) queues work on a stream of its own: its batches
    are timed by the wall clock from the first call to the end of ``wait()``.
    """
    wait = getattr(fn, "wait", None)  # work on a stream of its own (JAX): timed by the wall clock
    for _ in range(warmup):
        fn()
    if wait:
        wait()
    cp.cuda.Device().synchronize()
    times, inner = [], 1
    start_wall = time.perf_counter()
    for _ in range(reps):
        if wait:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            wait()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
        else:
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / inner)
        inner = min(50, max(1, int(batch_ms / max(times[-1], 1e-3))))
        if time.perf_counter() - start_wall > max_seconds and len(times) >= 3:
            break
    return float(np.median(times[1:] if len(times) > 1 else times))


def _torch_sdpa():
    """(torch, SDPBackend, sdpa_kernel, sdpa) when torch with CUDA is importable, else None."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
    except Exception:
        return None
    return (torch, SDPBackend, sdpa_kernel, sdpa) if torch.cuda.is_available() else None


def _torch_backends(make):
    """``{"torch-flash": make(FLASH_ATTENTION, ...), "torch-cudnn": make(CUDNN_ATTENTION, ...)}``,
    with ``make(backend, torch, sdpa_kernel, sdpa)``; ``{}`` without torch and CUDA."""
    found = _torch_sdpa()
    if found is None:
        return {}
    torch, SDPBackend, sdpa_kernel, sdpa = found
    return {name: make(backend, torch, sdpa_kernel, sdpa)
            for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("torch-efficient", SDPBackend.EFFICIENT_ATTENTION))}  # (float32's fused peer)


def _torch_peers():
    """torch SDPA forward pinned to one backend."""
    def make(backend, torch, sdpa_kernel, sdpa):
        def run(q, k, v, causal):
            tq, tk, tv = (torch.from_dlpack(x.swapaxes(1, 2)) for x in (q, k, v))  # (B, H, S, D) views

            def call():
                with sdpa_kernel([backend]):  # the backend choice must be in force at call time
                    return sdpa(tq, tk, tv, is_causal=causal)
            return call
        return run

    return _torch_backends(make)


def _gpu_jax():
    """(jax, jax.numpy) when JAX is importable and sees a GPU, else None.  JAX is told not to take
    75 % of GPU memory up front (XLA's default), which the peers sharing the GPU would miss."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
    except Exception:
        return None
    return (jax, jnp) if any(d.platform == "gpu" for d in jax.devices()) else None


def _jitted_call(jax, fn, *args):
    """``fn(*args)`` under ``jax.jit``, compiled and run once: the callable a timing loop repeats.

    Each call only queues its work (as a JAX program calling it in a loop would); its ``wait``
    attribute blocks until the last call's result is ready.  JAX runs on its own stream, which
    CuPy's events do not see: time_gpu times such callables by the wall clock around a batch of
    calls and one wait (blocking after every call had added JAX's dispatch and a host round
    trip to each call: FA3's d128 1k forward measured 323 instead of ~570 TF/s)."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    last = []

    def call():
        last[:] = [f(*args)]

    call.wait = lambda: jax.block_until_ready(last)
    return call


def _jax_peer():
    found = _gpu_jax()
    if found is None:
        return {}
    jax, jnp = found

    def run(q, k, v, causal):
        jq, jk, jv = (jnp.from_dlpack(x) for x in (q, k, v))  # (B, S, H, D), JAX's own layout
        return _jitted_call(jax, lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal,
                                                                              implementation="cudnn"), jq, jk, jv)

    return {"jax-cudnn": run}


def _fa3_peer(backward: bool = False):
    """FlashAttention-3's Hopper kernels through the ``flash-attn3-jax`` wheel (a JAX FFI
    binding, built for head dim 128), when it and a GPU JAX are importable: the forward under
    ``jax.jit``, or the backward alone (the VJP's residuals computed once, then only the
    backward jitted).  Never a dependency: scripts/gpu_check.sh installs a carried wheel."""
    try:
        import flash_attn3_jax
    except Exception:
        return {}
    found = _gpu_jax()
    if found is None:
        return {}
    jax, jnp = found

    def run(q, k, v, causal):
        jq, jk, jv = (jnp.from_dlpack(x) for x in (q, k, v))  # (B, S, H, D), FA3's layout too

        def fwd(a, b, c):
            return flash_attn3_jax.flash_mha(a, b, c, is_causal=causal)

        if not backward:
            return _jitted_call(jax, fwd, jq, jk, jv)
        out, vjp = jax.vjp(fwd, jq, jk, jv)
        return _jitted_call(jax, lambda fn, d: fn(d), vjp, jnp.ones_like(out))

    return {"fa3-jax": run}


def _error_text(exc) -> str:
    """A row's note on a system that could not run (out of memory, unsupported shape or dtype)."""
    return f"{type(exc).__name__}: {str(exc)[:80]}"


def check_against_plain(q, k, v, causal, out):
    """Compare the last 64 query rows of one head with plain float32 attention (catches garbage)."""
    qs, ks, vs = (x[:1, :, :1].astype(cp.float32) for x in (q, k, v))
    ref = _demo.plain_attention(cp, qs, ks, vs, causal)
    err = float(cp.abs(out[:1, -64:, :1].astype(cp.float32) - ref[:, -64:]).max())
    if not err < 2e-2 * max(1.0, float(cp.abs(ref).max())):
        raise RuntimeError(f"cuflash output differs from plain attention by {err}")


def _plain_peer(q, k, v, causal):
    """Plain CuPy attention (matmul, softmax, matmul; _demo.plain_attention) as a timed peer."""
    return lambda: _demo.plain_attention(cp, q, k, v, causal)


def _plain_bwd_peer(q, k, v, causal):
    """Its standard backward, P recomputed in full (_demo.plain_attention_backward); dO of ones
    (the time does not depend on its values)."""
    dout = cp.ones_like(q)
    return lambda: _demo.plain_attention_backward(cp, q, k, v, dout, causal)


def _torch_bwd_peers():
    """torch SDPA backward through autograd, pinned to one backend (timed: backward only)."""
    def make(backend, torch, sdpa_kernel, sdpa):
        def run(q, k, v, causal):
            tq, tk, tv = (torch.from_dlpack(x.swapaxes(1, 2)).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel([backend]):
                o = sdpa(tq, tk, tv, is_causal=causal)
            do = torch.randn_like(o)
            return lambda: torch.autograd.grad(o, (tq, tk, tv), do, retain_graph=True)
        return run

    return _torch_backends(make)


def bench_backward(dtype_name, headdim, seqlen, causal, peers, tokens=16384, hidden=2048, deterministic=False):
    """One backward row; with ``deterministic`` also cuflash's ``deterministic=True`` (column
    "cuflash-det": dQ summed in a fixed order, bitwise repeatable)."""
    batch, nheads = max(1, tokens // seqlen), hidden // headdim
    rng = np.random.default_rng(0)
    shape = (batch, seqlen, nheads, headdim)
    q, k, v, dout = (cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(DTYPES[dtype_name]) for _ in range(4))
    flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, backward=True)
    row = dict(dtype=dtype_name, headdim=headdim, seqlen=seqlen, batch=batch, nheads=nheads, causal=causal)
    try:
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    except NotImplementedError as exc:  # NotAvailableOnGPU: what the float32/float64 kernels lack (issue 24)
        row["cuflash"], row["cuflash_error"] = None, _error_text(exc)
    else:
        for g in grads:
            if not bool(cp.isfinite(g.astype(cp.float32)).all()):
                raise RuntimeError("non-finite gradient")
        def tflops(**opts):
            return flops / time_gpu(lambda: cuflash.attention_backward(
                dout, q, k, v, out, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2], **opts)) / 1e9

        row["cuflash"] = tflops()
        if deterministic:
            row["cuflash-det"] = tflops(deterministic=True)
    for name, make in peers.items():
        try:
            row[name] = flops / time_gpu(make(q, k, v, causal), reps=10) / 1e9
        except Exception as exc:  # out of memory, unsupported shape: report, keep going
            row[name] = None
            row[f"{name}_error"] = _error_text(exc)
        cp.get_default_memory_pool().free_all_blocks()
    return row


def bench_config(dtype_name, headdim, seqlen, causal, peers, tokens=16384, hidden=2048):
    batch, nheads = max(1, tokens // seqlen), hidden // headdim
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(0)
    shape = (batch, seqlen, nheads, headdim)
    q, k, v = (cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype) for _ in range(3))
    flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal)
    row = dict(dtype=dtype_name, headdim=headdim, seqlen=seqlen, batch=batch, nheads=nheads, causal=causal)
    try:
        out = cuflash.attention(q, k, v, causal=causal)
    except NotImplementedError as exc:  # NotAvailableOnGPU: what the float32/float64 kernels lack (issue 24)
        row["cuflash"], row["cuflash_error"] = None, _error_text(exc)
    else:
        check_against_plain(q, k, v, causal, out)
        ms = time_gpu(lambda: cuflash.attention(q, k, v, causal=causal, out=out))
        row["cuflash"] = flops / ms / 1e9
    for name, make in peers.items():
        try:
            row[name] = flops / time_gpu(make(q, k, v, causal), reps=10) / 1e9
        except Exception as exc:  # out of memory, unsupported shape: report, keep going
            row[name] = None
            row[f"{name}_error"] = _error_text(exc)
        cp.get_default_memory_pool().free_all_blocks()
    return row


def environment():
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "cc": dev.compute_capability,
        "cuflash": cuflash.__version__,
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "nvrtc": ".".join(map(str, cp.cuda.nvrtc.getVersion())),
        "python": platform.python_version(),
    }
    for mod in ("torch", "jax", "flash_attn3_jax"):
        try:
            module = __import__(mod)
            env[mod] = getattr(module, "__version__", None) or _dist_version(mod)
        except Exception:
            pass
    return env


def matmul_tflops(dtype_name: str, n: int = 8192) -> float:
    """TF/s of an (n x n) @ (n x n) ``cupy.matmul`` in this dtype (cuBLAS; CuPy's TF32 setting for
    float32, CUPY_TF32): the ceiling a sweep's rows are read against (fp16 for the 16-bit rows)."""
    a = cp.ones((n, n), dtype=DTYPES[dtype_name])
    out = cp.empty_like(a)
    return 2 * n**3 / time_gpu(lambda: cp.matmul(a, a, out=out), reps=5) / 1e9


def _dist_version(module: str) -> str:
    from importlib import metadata

    return metadata.version(module.replace("_", "-"))


def _systems(rows, fixed, names=()):
    """Column names of the timed systems, in order of first appearance (JAX runs on a subset only)."""
    names = list(names)
    for r in rows:
        names += [k for k in r if k not in fixed and not k.endswith("_error") and k not in names]
    return names


def to_markdown(rows, env):
    fixed = ("dtype", "headdim", "seqlen", "batch", "nheads", "causal", "cuflash")
    names = _systems(rows, fixed, ["cuflash"])
    lines = [
        f"GPU {env['gpu']} (sm_{env['cc']}), {env['date']}, cuflash {env['cuflash']}, CuPy {env['cupy']}, "
        f"NVRTC {env['nvrtc']}" + "".join(f", {m} {env[m]}" for m in ("torch", "jax", "flash_attn3_jax") if m in env),
        *([f"cupy.matmul 8192³: " + ", ".join(f"{d} {t:.1f} TF/s" for d, t in env["matmul"].items())] if env.get("matmul") else []),
    ]
    # Ratio columns: cuflash against each fused peer present, and its fraction of the GEMM rate of
    # the row's dtype (fp16's for the 16-bit rows; issue 24 reads float64 against float64's).
    against = [n for n in ("torch-flash", "torch-cudnn", "fa3-jax") if n in names]
    rates = env.get("matmul") or {}
    gemm = {d: rates.get(d if d in ("fp32", "fp64") else "fp16") for d in {r["dtype"] for r in rows}}
    gemm = gemm if any(gemm.values()) else None
    det = "cuflash-det" in names  # (the backward's deterministic=True beside the default)
    heads = [f"cuflash / {n}" for n in against] + (["det / default"] if det else []) + (["of GEMM"] if gemm else [])
    if gemm:
        lines.append("of GEMM: cuflash's rate over cupy.matmul 8192³ in the row's dtype (fp16's for fp16/bf16)")
    lines += ["", "| dtype | hdim | causal | seqlen | " + " | ".join(names + heads) + " |",
              "|---|---|---|---|" + "---|" * (len(names) + len(heads))]
    for r in rows:
        vals = [f"{r[n]:.0f}" if r.get(n) else "–" for n in names]
        vals += [f"{r['cuflash'] / r[n]:.2f}" if r.get(n) and r.get("cuflash") else "–" for n in against]
        if det:
            vals.append(f"{r['cuflash-det'] / r['cuflash']:.2f}" if r.get("cuflash-det") and r.get("cuflash") else "–")
        if gemm:
            rate = gemm.get(r["dtype"])
            vals.append(f"{r['cuflash'] / rate:.2f}" if r.get("cuflash") and rate else "–")
        lines.append(f"| {r['dtype']} | {r['headdim']} | {r['causal']} | {r['seqlen']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The paper suite: FlashAttention (Dao et al. 2022), Fig. 2 left — GPT-2 medium attention on an
# A100, forward + backward: standard attention against FlashAttention.

PAPER_SHAPE = dict(batch=64, seqlen=1024, nheads=16, headdim=64)
PAPER_A100 = {"standard": dict(gflops=66.6, hbm_gb=40.3, ms=41.7), "flash": dict(gflops=75.2, hbm_gb=4.4, ms=7.3)}


def paper_model(dtype_name="fp16"):
    """(FLOPs of forward + backward, the I/O model) of the paper's shape: no GPU needed."""
    from . import _io_model

    s = PAPER_SHAPE
    flops = 3.5 * attention_flops(s["batch"], s["nheads"], s["seqlen"], s["seqlen"], s["headdim"], False)
    io = _io_model.io_model(batch=s["batch"], nheads=s["nheads"], seqlen_q=s["seqlen"], headdim=s["headdim"],
                            dtype="float16" if dtype_name == "fp16" else "bfloat16")
    return flops, io


def paper_suite(dtype_name="fp16"):
    """Times standard attention (matmul, softmax, matmul + its backward) and cuflash, fwd + bwd."""
    s = PAPER_SHAPE
    shape = (s["batch"], s["seqlen"], s["nheads"], s["headdim"])
    rng = np.random.default_rng(0)
    q, k, v, dout = (cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(DTYPES[dtype_name]) for _ in range(4))

    def flash():
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        cuflash.attention_backward(dout, q, k, v, out, lse)

    def standard():
        _demo.plain_attention(cp, q, k, v, False)
        _demo.plain_attention_backward(cp, q, k, v, dout, False)

    check_against_plain(q, k, v, False, cuflash.attention(q, k, v))
    flops, io = paper_model(dtype_name)
    rows = {}
    for name, fn, hbm in (("standard", standard, io.standard_hbm_bytes), ("flash", flash, io.kernel_hbm_bytes)):
        rows[name] = dict(gflops=flops / 1e9, hbm_gb=hbm / 1e9, ms=time_gpu(fn, reps=10))
    return rows


def paper_markdown(rows, env):
    pub = PAPER_A100
    lines = [
        f"GPT-2 medium attention (batch 64, seqlen 1024, 16 heads, head dim 64), forward + backward; "
        f"GPU {env['gpu']}, {env['date']}",
        "",
        "| | published A100: standard | published A100: FlashAttention | ours: standard (CuPy) | ours: cuflash |",
        "|---|---|---|---|---|",
        f"| GFLOPs | {pub['standard']['gflops']} | {pub['flash']['gflops']} | {rows['standard']['gflops']:.1f} | {rows['flash']['gflops']:.1f} |",
        f"| HBM R/W (GB) | {pub['standard']['hbm_gb']} | {pub['flash']['hbm_gb']} | {rows['standard']['hbm_gb']:.2f} (fwd model) | {rows['flash']['hbm_gb']:.2f} (fwd model) |",
        f"| runtime (ms) | {pub['standard']['ms']} | {pub['flash']['ms']} | {rows['standard']['ms']:.1f} | {rows['flash']['ms']:.1f} |",
        f"| speed-up | | {pub['standard']['ms'] / pub['flash']['ms']:.1f}x | | {rows['standard']['ms'] / rows['flash']['ms']:.1f}x |",
        "",
        "Our GFLOPs use the benchmark convention (3.5 x 4·B·H·N²·D for forward + backward, matmuls only); "
        "HBM bytes are `cuflash io`'s forward model (standard: S and P written and read; cuflash: K, V "
        "re-read once per query block of the kernel's forward).",
    ]
    return "\n".join(lines)


def plot(rows, path):
    """Bar chart of TF/s per configuration, one bar per system (matplotlib, the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = ("dtype", "headdim", "seqlen", "batch", "nheads", "causal")
    systems = []
    for r in rows:
        systems += [k for k in r if k not in fixed and not k.endswith("_error") and k not in systems]
    labels = [f"{r['dtype']} d{r['headdim']}{' causal' if r['causal'] else ''}\n{r['seqlen']}" for r in rows]
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    for n, name in enumerate(systems):
        vals = [r.get(name) or 0 for r in rows]
        ax.bar([i + n * width for i in range(len(rows))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("TFLOPs/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------
# The host suite: what cuflash adds on the CPU side of a call, and the cold compile time.


# ---------------------------------------------------------------------------------------------
# The decode suite: one new token per sequence against a KV cache (bf16, head dim 128), reported
# as KV-cache bytes read per second, the quantity that bounds decoding.

DECODE_HEADS = {"mha": (32, 32), "gqa": (32, 8)}


def decode_configs(kv_lens=(4096, 16384, 65536, 131072), batches=(1, 8, 64), max_bytes=24 << 30):
    """(heads name, batch, kv length) with a cache of at most max_bytes."""
    out = []
    for name, (_, hkv) in DECODE_HEADS.items():
        for batch in batches:
            for n in kv_lens:
                if 2 * batch * n * hkv * 128 * 2 <= max_bytes:
                    out.append((name, batch, n))
    return out


def _torch_decode_peers():
    """torch SDPA with one query token, pinned to one backend (GQA through enable_gqa)."""
    def make(backend, torch, sdpa_kernel, sdpa):
        def run(q, k, v):
            tq, tk, tv = (torch.from_dlpack(x.swapaxes(1, 2)) for x in (q, k, v))
            gqa = tq.shape[1] != tk.shape[1]

            def call():
                with sdpa_kernel([backend]):
                    return sdpa(tq, tk, tv, enable_gqa=gqa)
            return call
        return run

    return _torch_backends(make)


def decode_suite(configs=None, peers=None, page_size=None, progress=_plain_progress):
    """TB/s of KV cache read by attention_with_kvcache (q length 1) and by the peers."""
    rows = []
    peers = _torch_decode_peers() if peers is None else peers
    with progress(configs or decode_configs(), "cuflash bench --suite decode") as configs:
        for name, batch, n in configs:
            rows.append(_decode_row(name, batch, n, peers, page_size))
            _echo(rows[-1], progress)
    return rows


def _decode_row(name, batch, n, peers, page_size):
    """One decode configuration: cuflash (contiguous and paged) and the peers, TB/s of KV read."""
    hq, hkv = DECODE_HEADS[name]
    rng = cp.random.default_rng(0)  # generated on the GPU: caches reach gigabytes
    k, v = (rng.standard_normal((batch, n, hkv, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
    q = rng.standard_normal((batch, 1, hq, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    lengths = cp.full(batch, n, dtype=cp.int32)
    kv_bytes = k.nbytes + v.nbytes
    row = dict(heads=name, batch=batch, kv_len=n, kv_mb=kv_bytes / 1e6)
    out = cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths)
    check_against_plain(q, k, v, False, out)  # head 0 of q uses K/V head 0 in both layouts
    row["cuflash"] = kv_bytes / time_gpu(lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths)) / 1e9
    if page_size:
        pages = batch * n // page_size
        table = cp.asarray(np.random.default_rng(0).permutation(pages).reshape(batch, -1).astype(np.int32))
        kp, vp = (x.reshape(pages, page_size, hkv, 128) for x in (k, v))
        row[f"cuflash-paged{page_size}"] = kv_bytes / time_gpu(lambda: cuflash.attention_with_kvcache(
            q, kp, vp, cache_seqlens=lengths, block_table=table)) / 1e9
    row["read-only"] = kv_bytes / time_gpu(_read_only(k, v)) / 1e9
    for peer, make in peers.items():
        try:
            row[peer] = kv_bytes / time_gpu(make(q, k, v), reps=10) / 1e9
        except Exception as exc:
            row[peer] = None
            row[f"{peer}_error"] = _error_text(exc)
    del k, v
    cp.get_default_memory_pool().free_all_blocks()
    return row


def _read_only(k, v):
    """A call that only reads the contiguous arrays k and v (kernels/read_bandwidth.cu): the
    reference for what a kernel that must read the whole cache can reach, launch included."""
    from . import _gpu, _kernels

    fn = _kernels.get_function(_kernels.read_bandwidth_variant(), k.device.id)
    sink = cp.zeros(1, dtype=cp.uint32)
    grid = (2 * _gpu._sm_resources(k.device.id)[0],)  # two 1024-thread blocks per SM
    args = (k, np.int64(k.nbytes // 16), v, np.int64(v.nbytes // 16), sink)
    return lambda: fn(grid, (1024,), args)


def decode_markdown(rows, env):
    fixed = ("heads", "batch", "kv_len", "kv_mb")
    names = _systems(rows, fixed)
    lines = [
        f"Decode, q length 1, bf16, head dim 128, TB/s of KV cache read (GPU {env['gpu']}, {env['date']})",
        "",
        "| heads (q/kv) | batch | kv len | KV MB | " + " | ".join(names) + " | cuflash / read-only | cuflash / torch-cudnn |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|",
    ]
    ratio = lambda r, peer: f"{r['cuflash'] / r[peer]:.2f}" if r.get(peer) else "–"
    for r in rows:
        vals = [f"{r[n]:.2f}" if r.get(n) else "–" for n in names]
        hq, hkv = DECODE_HEADS[r["heads"]]
        lines.append(f"| {hq}/{hkv} | {r['batch']} | {r['kv_len']} | {r['kv_mb']:.0f} | " + " | ".join(vals)
                     + f" | {ratio(r, 'read-only')} | {ratio(r, 'torch-cudnn')} |")
    return "\n".join(lines)


def varlen_suite(headdims=(64, 128), seqlens=(512, 2048, 8192), tokens=16384, hidden=2048, progress=_plain_progress):
    """attention_varlen on packed equal-length sequences against the padded batch of the same
    tokens (bf16, causal and not): TF/s of both and their ratio (issue target: within 10 %)."""
    rows = []
    with progress([(d, s) for d in headdims for s in seqlens], "cuflash bench --suite varlen") as configs:
        for d, s in configs:
            batch, heads = tokens // s, hidden // d
            rng = cp.random.default_rng(0)
            q, k, v = (rng.standard_normal((batch, s, heads, d), dtype=cp.float32).astype(ml_dtypes.bfloat16)
                       for _ in range(3))
            packed = [x.reshape(batch * s, heads, d) for x in (q, k, v)]
            cu = cp.arange(0, batch * s + 1, s, dtype=cp.int32)
            for causal in (False, True):
                flops = attention_flops(batch, heads, s, s, d, causal)
                padded = flops / time_gpu(lambda: cuflash.attention(q, k, v, causal=causal)) / 1e9
                varlen = flops / time_gpu(lambda: cuflash.attention_varlen(
                    *packed, cu, cu, max_seqlen_q=s, max_seqlen_k=s, causal=causal)) / 1e9
                rows.append(dict(headdim=d, seqlen=s, batch=batch, causal=causal, padded=padded, varlen=varlen))
                _echo(rows[-1], progress)
    return rows


def varlen_markdown(rows, env):
    lines = [f"Varlen prefill vs padded batch, bf16, 16k tokens, TF/s (GPU {env['gpu']}, {env['date']})", "",
             "| hdim | seqlen | causal | padded | varlen | varlen / padded |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['headdim']} | {r['seqlen']} | {r['causal']} | {r['padded']:.0f} | {r['varlen']:.0f} | "
                     f"{r['varlen'] / r['padded']:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The modifiers suite (issue 23): bias, key-padding mask and dropout, forward and backward, against
# cuflash without them and against the peers that take a bias or mask.

MODIFIER_CASES = ("bias", "key-padding", "dropout")


def _modifier_inputs(case, batch, nheads, seqlen, causal, rng, dtype=ml_dtypes.bfloat16):
    """cuflash's options for ``case``, the baseline's (the same call without the modifier; for key
    padding, seqlens_k of the same valid lengths), and the peers' (additive bias, boolean mask,
    dense where they need causal folded in) as CuPy arrays."""
    if case == "bias":
        bias = cp.empty((1, nheads, seqlen, seqlen), dtype=dtype)
        for hh in range(nheads):  # (head by head: a float32 copy of the whole bias takes 34 GB at d64, 16k)
            bias[0, hh] = rng.standard_normal((seqlen, seqlen), dtype=cp.float32).astype(dtype)
        dense = bias
        if causal:  # the peers take a bias or is_causal, not both; built head by head (a float32
            # copy of the whole bias would take 16 GiB at 16k)
            future = cp.triu(cp.ones((seqlen, seqlen), dtype=bool), 1)
            dense = cp.empty_like(bias)
            for hh in range(nheads):
                dense[0, hh] = cp.where(future, cp.float32(-cp.inf), bias[0, hh].astype(cp.float32)).astype(bias.dtype)
        return dict(bias=bias, causal=causal), dict(causal=causal), dict(bias=dense)
    if case == "key-padding":
        valid = cp.asarray(np.random.default_rng(1).integers(seqlen // 2, seqlen + 1, batch), dtype=cp.int32)
        mask = cp.arange(seqlen)[None, None, None, :] < valid[:, None, None, None]  # (B, 1, 1, S)
        dense = mask if not causal else mask & ~cp.triu(cp.ones((seqlen, seqlen), dtype=bool), 1)
        # (the baseline's causal mask is aligned top-left as the masked call's is: seqlens_k with the
        # default bottom-right alignment would move the diagonal by S - valid and skip that work)
        return (dict(mask=mask, causal=causal), dict(seqlens_k=valid, causal="top_left" if causal else False),
                dict(mask=dense))
    return (dict(dropout_p=0.1, dropout_seed=(1, 0), causal=causal), dict(causal=causal), None)


def _modifier_peers(backward):
    """torch SDPA (cuDNN and memory-efficient backends) with attn_mask, and JAX's cuDNN
    dot_product_attention with bias= / mask=; each ``make(q, k, v, peer_opts) -> callable``
    (backward: the gradient of q, k, v and, for a bias, of the bias)."""
    peers = {}
    found = _torch_sdpa()
    if found is not None:
        torch, SDPBackend, sdpa_kernel, sdpa = found

        def torch_make(backend):
            def make(q, k, v, opts):
                grad = backward
                tq, tk, tv = (torch.from_dlpack(x.swapaxes(1, 2)).detach().requires_grad_(grad) for x in (q, k, v))
                mask = opts.get("bias", opts.get("mask"))
                tm = torch.from_dlpack(mask).detach()
                if grad and "bias" in opts:
                    tm.requires_grad_()
                if not grad:
                    def call():
                        with sdpa_kernel([backend]):
                            return sdpa(tq, tk, tv, attn_mask=tm)
                    return call
                with sdpa_kernel([backend]):
                    o = sdpa(tq, tk, tv, attn_mask=tm)
                inputs = (tq, tk, tv) + ((tm,) if tm.requires_grad else ())
                do = torch.randn_like(o)
                return lambda: torch.autograd.grad(o, inputs, do, retain_graph=True)
            return make

        peers.update({"torch-cudnn": torch_make(SDPBackend.CUDNN_ATTENTION),
                      "torch-efficient": torch_make(SDPBackend.EFFICIENT_ATTENTION)})
    found = _gpu_jax()
    if found is not None:
        jax, jnp = found

        def jax_make(q, k, v, opts):
            jq, jk, jv = (jnp.from_dlpack(x) for x in (q, k, v))
            extra = {name: jnp.from_dlpack(x) for name, x in opts.items()}

            def fwd(a, b, c, *mod):
                return jax.nn.dot_product_attention(a, b, c, implementation="cudnn", **dict(zip(extra, mod)))

            if not backward:
                return _jitted_call(jax, fwd, jq, jk, jv, *extra.values())
            argnums = (0, 1, 2) + ((3,) if "bias" in extra else ())
            grad = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=argnums)
            return _jitted_call(jax, grad, jq, jk, jv, *extra.values())

        peers["jax-cudnn"] = jax_make
    return peers


def modifiers_suite(seqlens=(4096, 16384), headdims=(128,), dtypes=("bf16",), tokens=16384, hidden=2048, backward=False,
                    peers=None, progress=_plain_progress):
    """Issue 23's speed rows: bf16, head dim 128 (or each of ``headdims`` x ``dtypes``),
    batch·seqlen = ``tokens``, nheads·headdim = ``hidden``: a random (1, H, S, S) bias of the
    inputs' dtype, a (B, 1, 1, S) key-padding mask with valid lengths uniform in [S/2, S], and
    dropout 0.1, causal and not, forward or backward.  Each row: cuflash with the modifier,
    cuflash without it (key padding: seqlens_k of the same lengths) and the peers that take it,
    in TF/s of the full S x S problem (so that the times compare)."""
    peers = _modifier_peers(backward) if peers is None else peers
    rows = []
    configs = [(dtype_name, d, case, s, causal) for dtype_name in dtypes for d in headdims for case in MODIFIER_CASES
               for s in seqlens for causal in (False, True)]
    with progress(configs, "cuflash bench --suite modifiers") as configs:
        for dtype_name, headdim, case, s, causal in configs:
            batch, heads = max(1, tokens // s), hidden // headdim
            rng = cp.random.default_rng(0)
            row = dict(dtype=dtype_name, headdim=headdim, case=case, seqlen=s, causal=causal, batch=batch, nheads=heads)
            try:
                q, k, v, dout = (rng.standard_normal((batch, s, heads, headdim), dtype=cp.float32).astype(DTYPES[dtype_name])
                                 for _ in range(4))
                opts, base, peer_opts = _modifier_inputs(case, batch, heads, s, causal, rng, DTYPES[dtype_name])
            except cp.cuda.memory.OutOfMemoryError as exc:  # (a (1, H, S, S) bias at small head dims: H = 32)
                row.update({"cuflash": None, "cuflash-plain": None, "cuflash_error": _error_text(exc)})
                rows.append(row)
                _echo(row, progress)
                cp.get_default_memory_pool().free_all_blocks()
                continue
            flops = attention_flops(batch, heads, s, s, headdim, causal, backward=backward)
            for name, run_opts in (("cuflash", opts), ("cuflash-plain", base)):
                out, lse = cuflash.attention(q, k, v, return_lse=True, **run_opts)
                if backward:
                    fn = lambda o=run_opts, out=out, lse=lse: cuflash.attention_backward(dout, q, k, v, out, lse, **o)  # noqa: E731
                else:
                    fn = lambda o=run_opts: cuflash.attention(q, k, v, **o)  # noqa: E731
                row[name] = flops / time_gpu(fn) / 1e9
            for name, make in (peers.items() if peer_opts is not None else ()):
                try:
                    row[name] = flops / time_gpu(make(q, k, v, peer_opts), reps=10) / 1e9
                except Exception as exc:  # a backend that does not take this mask: report, keep going
                    row[name], row[f"{name}_error"] = None, _error_text(exc)
                cp.get_default_memory_pool().free_all_blocks()
            rows.append(row)
            _echo(row, progress)
    return rows


def modifiers_markdown(rows, env, backward=False):
    fixed = ("dtype", "headdim", "case", "seqlen", "causal", "batch", "nheads", "cuflash", "cuflash-plain")
    names = _systems(rows, fixed)
    title = "backward" if backward else "forward"
    lines = [f"Bias, key-padding mask, dropout ({title}), 16k tokens, TF/s of the full problem "
             f"(GPU {env['gpu']}, {env['date']})", "",
             "| dtype | hdim | case | seqlen | causal | cuflash | cuflash without it | " + " | ".join(names)
             + " | cuflash / without | cuflash / best peer |", "|---|---|---|---|---|---|---|" + "---|" * (len(names) + 2)]
    for r in rows:
        best = max((r[n] for n in names if r.get(n)), default=None)
        vals = [f"{r[n]:.0f}" if r.get(n) else "–" for n in names]
        head = f"| {r.get('dtype', 'bf16')} | {r.get('headdim', 128)} | {r['case']} | {r['seqlen']} | {r['causal']} | "
        if not r["cuflash"]:  # the inputs did not fit (cuflash_error)
            lines.append(head + "– | – | " + " | ".join(vals) + " | – | – |")
            continue
        lines.append(head + f"{r['cuflash']:.0f} | {r['cuflash-plain']:.0f} | "
                     + " | ".join(vals) + f" | {r['cuflash'] / r['cuflash-plain']:.2f} | "
                     + (f"{r['cuflash'] / best:.2f}" if best else "–") + " |")
    return "\n".join(lines)


def host_suite(calls=2000):
    """Host microseconds per warm call (no synchronisation) for cuflash.attention and for a bare
    launch of the same compiled kernel, plus NVRTC seconds per forward variant (cold, no cache)."""
    import ctypes

    from . import _kernels
    from ._params import FlashParams

    q = cp.asarray(np.random.default_rng(0).standard_normal((1, 16, 1, 64)).astype(np.float16))
    out = cp.empty_like(q)
    cuflash.attention(q, q, q, out=out)  # compile and warm up
    variant = _kernels.fwd_variant("float16", 64, softcap=False, alibi=False)
    fn = _kernels.get_function(variant, q.device.id)
    prm = FlashParams()
    arg = cp.cuda.function.CPointer(ctypes.addressof(prm))

    def per_call(call):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t1 = time.perf_counter()
        cp.cuda.Device().synchronize()
        return (t1 - t0) / calls * 1e6

    # A grid of zero blocks would be an error; one block whose batch index is out of range
    # returns at once (batch = 0 in the zeroed params), which isolates the launch cost.
    bare = per_call(lambda: fn((1, 1, 1), (variant.threads,), (arg,), shared_mem=variant.smem_bytes))
    full = per_call(lambda: cuflash.attention(q, q, q, out=out))
    new_out = per_call(lambda: cuflash.attention(q, q, q))
    cache = cp.zeros((4, 256, 2, 64), dtype=np.float16)
    lengths = cp.full(4, 200, dtype=cp.int32)
    step = cp.zeros((4, 1, 8, 64), dtype=np.float16)
    decode = per_call(lambda: cuflash.attention_with_kvcache(step, cache, cache, cache_seqlens=lengths))
    compile_s = []
    for v in [_kernels.fwd_variant("bfloat16", d, softcap=False, alibi=False) for d in (64, 128, 256)]:
        t0 = time.perf_counter()
        _kernels.compile_for_arch(v, "90")
        compile_s.append((v.name, time.perf_counter() - t0))
    return {"attention_us": full, "attention_new_out_us": new_out, "kvcache_decode_us": decode, "bare_launch_us": bare,
            "overhead_us": full - bare, "compile_s": compile_s}


def main(argv=None, progress=_plain_progress):
    """The command line of scripts/bench.py; ``progress(items, label)`` wraps each sweep (the CLI
    passes click's progress bar, which replaces the JSON line printed per row)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", help="comma-separated, of bf16, fp16, fp32, fp64 (standard suite default bf16,fp16; "
                                      "modifiers suite bf16)")
    ap.add_argument("--headdims", help="comma-separated (standard suite default 64,128,256; modifiers suite 128)")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--peers", help="standard suite: only these peers (comma-separated, e.g. torch-cudnn,fa3-jax; "
                                    "default every one available: cupy-plain, torch-flash, torch-cudnn, "
                                    "torch-efficient, jax-cudnn, fa3-jax)")
    ap.add_argument("--backward", action="store_true", help="time attention_backward instead of the forward")
    ap.add_argument("--deterministic", action="store_true",
                    help="with --backward: also time deterministic=True (column cuflash-det, and det / default)")
    ap.add_argument("--jax-headdims", default="128", help="JAX compiles per shape; limit it to these head dims")
    ap.add_argument("--suite", choices=("standard", "paper", "decode", "varlen", "host", "modifiers"), default="standard")
    ap.add_argument("--page-size", type=int, default=256, help="decode suite: also time a paged cache (0 = no)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--plot", help="PNG bar chart of the sweep (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.suite == "host":
        r = host_suite()
        print(f"host time per warm call: cuflash.attention {r['attention_us']:.1f} us, bare kernel launch "
              f"{r['bare_launch_us']:.1f} us, cuflash adds {r['overhead_us']:.1f} us")
        print(f"  without out= (allocates out and lse): {r['attention_new_out_us']:.1f} us; "
              f"attention_with_kvcache decode step: {r['kvcache_decode_us']:.1f} us")
        for name, seconds in r["compile_s"]:
            print(f"cold NVRTC compile {name}: {seconds:.2f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1))
        return
    if args.suite in ("decode", "varlen", "modifiers"):
        env = environment()
        if args.suite == "modifiers":
            if not set((args.dtypes or "bf16").split(",")) <= {"bf16", "fp16"}:
                ap.error(f"--dtypes {args.dtypes}: the modifiers suite runs bf16 and fp16 (its peers' fused bias/mask "
                         "kernels are 16-bit; float32/float64 modifier rows are not timed)")
            rows = modifiers_suite(headdims=tuple(map(int, (args.headdims or "128").split(","))),
                                   dtypes=tuple((args.dtypes or "bf16").split(",")), backward=args.backward,
                                   peers={} if args.no_peers else None, progress=progress)
            md = modifiers_markdown(rows, env, backward=args.backward)
        elif args.suite == "decode":
            rows = decode_suite(peers={} if args.no_peers else None, page_size=args.page_size, progress=progress)
            md = decode_markdown(rows, env)
        else:
            rows = varlen_suite(progress=progress)
            md = varlen_markdown(rows, env)
        print(md)
        if args.json:
            Path(args.json).write_text(json.dumps({"env": env, args.suite: rows}, indent=1))
        if args.markdown:
            Path(args.markdown).write_text(md + "\n")
        return
    if args.suite == "paper":
        env = environment()
        rows = paper_suite()
        md = paper_markdown(rows, env)
        print(md)
        if args.json:
            Path(args.json).write_text(json.dumps({"env": env, "paper": rows}, indent=1))
        if args.markdown:
            Path(args.markdown).write_text(md + "\n")
        return

    base_peers = {} if args.no_peers else {"cupy-plain": _plain_peer, **_torch_peers()}
    jax_peers = {} if args.no_peers else {**_jax_peer(), **_fa3_peer()}
    if args.backward:
        base_peers = {} if args.no_peers else {"cupy-plain": _plain_bwd_peer, **_torch_bwd_peers()}
        jax_peers = {} if args.no_peers else _fa3_peer(True)
    if args.peers is not None:  # (the slow baselines, cupy-plain and torch-efficient, take most of a long sweep)
        wanted = {name.strip() for name in args.peers.split(",") if name.strip()}
        base_peers = {n: f for n, f in base_peers.items() if n in wanted}
        jax_peers = {n: f for n, f in jax_peers.items() if n in wanted}
    rows = []
    args.dtypes, args.headdims = args.dtypes or "bf16,fp16", args.headdims or "64,128,256"
    configs = [(dtype_name, headdim, causal, seqlen) for dtype_name in args.dtypes.split(",")
               for headdim in map(int, args.headdims.split(","))
               for causal in (c == "true" for c in args.causal.split(","))
               for seqlen in map(int, args.seqlens.split(","))]
    with progress(configs, "cuflash bench") as configs:
        for dtype_name, headdim, causal, seqlen in configs:
            peers = dict(base_peers)
            if str(headdim) in args.jax_headdims.split(","):  # JAX's cuDNN in bf16; FA3 in both dtypes
                peers.update({n: f for n, f in jax_peers.items()
                              if dtype_name == "bf16" or (n == "fa3-jax" and dtype_name == "fp16")})
            if args.backward:
                rows.append(bench_backward(dtype_name, headdim, seqlen, causal, peers, deterministic=args.deterministic))
            else:
                rows.append(bench_config(dtype_name, headdim, seqlen, causal, peers))
            _echo(rows[-1], progress)
    env = environment()
    # Each dtype's cupy.matmul ceiling (fp16 always: the forward issue reads every row against it).
    env["matmul"] = {d: matmul_tflops(d) for d in ["fp16"] + [d for d in args.dtypes.split(",") if d in ("fp32", "fp64")]}
    md = ("Backward (TF/s = 2.5 x forward FLOPs / time)\n" if args.backward else "") + to_markdown(rows, env)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
