"""The ``cuflash`` command line (also ``python -m cuflash``).

``cuflash info`` reports the installation (versions, GPU, NVRTC, where kernels come from and where
compiled kernels are cached); ``cuflash io`` prints the I/O model of :mod:`cuflash._io_model`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
from io import StringIO
from pathlib import Path

import click

from . import _io_model
from ._io_model import format_bytes


def _version_string() -> str:
    from . import __version__

    return __version__


class _Group(click.Group):
    """Lists every command with the whole first line of its docstring (click's default cuts
    them to the terminal's width)."""

    def format_commands(self, ctx, formatter):
        rows = [(name, (cmd.help or "").strip().splitlines()[0]) for name, cmd in sorted(self.commands.items())]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=_version_string(), prog_name="cuflash")
def main():
    """cuflash: exact FlashAttention for NumPy and CuPy arrays, without PyTorch."""


# ---------------------------------------------------------------------------------------------
# cuflash info


def _version(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return "not installed"
    except Exception as exc:  # a broken install raising at import
        return f"fails to import ({type(exc).__name__}: {exc})"
    return getattr(module, "__version__", "unknown version")


def kernel_cache_dir() -> Path:
    """Where CuPy caches compiled kernels: ``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or "~/.cupy/kernel_cache").expanduser()


def kernel_source_dir() -> Path | None:
    """The folder holding the CUDA sources, as cuflash._kernels finds it (or where it would)."""
    try:
        from . import _kernels
    except ImportError:
        _kernels = None
    if _kernels is not None and hasattr(_kernels, "kernel_dir"):
        try:
            return Path(_kernels.kernel_dir())
        except FileNotFoundError:
            return None
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):  # wheel, then checkout
        if candidate.is_dir():
            return candidate
    return None


def _gpu_lines(cp) -> list[str]:
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: cudaErrorInsufficientDriver / cudaErrorNoDevice
        msg = str(exc).splitlines()[0] if str(exc) else ""
        hint = "; no NVIDIA driver, or one older than this CuPy's CUDA" if "InsufficientDriver" in msg else ""
        return [f"no GPU found ({type(exc).__name__}{': ' + msg if msg else ''}{hint})"]
    if count == 0:
        return ["no GPU found"]
    lines = []
    for i in range(count):
        try:
            props = cp.cuda.runtime.getDeviceProperties(i)
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            cc = f"{props['major']}.{props['minor']}"
            smem = props.get("sharedMemPerBlockOptin")
            extra = f", {format_bytes(smem)} shared memory per block" if smem else ""
            lines.append(f"GPU {i}: {name}, compute capability {cc}{extra}; "
                         f"{kernel_family(props['major'], props['minor'], _nvrtc_tuple(cp))}")
        except Exception as exc:
            lines.append(f"GPU {i}: could not be queried ({type(exc).__name__}: {exc})")
    return lines


def kernel_family(major: int, minor: int, nvrtc, disabled: bool | None = None) -> str:
    """Which cuflash kernels a GPU of this compute capability runs with this NVRTC version."""
    from . import _kernels

    if major < 8:
        return "no cuflash kernels (they need compute capability 8.0 or newer)"
    if (major, minor) != (9, 0):
        return "sm_80 kernels (mma.sync)"
    if _kernels.sm90_disabled() if disabled is None else disabled:
        return "sm_80 kernels (CUFLASH_DISABLE_SM90 is set)"
    if not _kernels.sm90_applies(f"{major}{minor}", nvrtc):
        return "sm_80 kernels (the Hopper kernels need NVRTC 12.9 or newer to build sm_90a)"
    return (f"Hopper kernels (wgmma, sm_90a) for the forward at head dims {_kernels.SM90_FWD_MIN_HEADDIM}-"
            f"{max(_kernels.SM90_FWD_TILES)} "
            f"and the backward at {_headdim_spans(_hopper_backward_buckets())}; sm_80 kernels for other head dims "
            f"and for decoding (<= 16 query rows, paged caches) and float64 (FP64 tensor cores)")


def _hopper_backward_buckets() -> set:
    """The head-dim buckets the wgmma backward serves (the default, non-deterministic form)."""
    from . import _kernels

    return {b for b in _kernels.HEADDIM_BUCKETS
            if _kernels.sm90_bwd_variant("bfloat16", b, softcap=False, alibi=False) is not None}


def _headdim_spans(buckets) -> str:
    """The head dims of ``buckets``, adjacent buckets joined, e.g. "33-64, 97-256"."""
    from ._kernels import HEADDIM_BUCKETS

    spans = []
    for low, b in zip((1, *(b + 1 for b in HEADDIM_BUCKETS)), HEADDIM_BUCKETS):
        if b not in buckets:
            continue
        if spans and spans[-1][1] == low - 1:
            spans[-1][1] = b
        else:
            spans.append([low, b])
    return ", ".join(f"{lo}-{hi}" for lo, hi in spans)


def _nvrtc_tuple(cp):
    try:
        return tuple(cp.cuda.nvrtc.getVersion())
    except Exception:
        return None


def _nvrtc_version(cp) -> str:
    try:
        major, minor = cp.cuda.nvrtc.getVersion()
    except Exception as exc:
        return f"not available ({type(exc).__name__}: {exc})"
    return f"{major}.{minor}"


@main.command()
def info():
    """Versions, GPU, NVRTC, and where kernels are found and cached."""
    from . import __version__, _arrays

    rows = [
        ("cuflash", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("numpy", _version("numpy")),
        ("ml_dtypes", _version("ml_dtypes")),
    ]
    cp = _arrays.cupy_module()
    if cp is None:
        cupy_state = _version("cupy")  # why the import fails, if it does
        cupy_state = cupy_state if cupy_state.startswith("fails to import") else "not installed"
        rows.append(("cupy", f"{cupy_state}: NumPy arrays run on the CPU (for the GPU install the extra "
                             "that matches the driver: `nvidia-smi` shows CUDA Version 13.x -> "
                             "pip install -e '.[cuda13]' in the checkout, or '<path to it>[cuda13]' from elsewhere; 12.x -> "
                             "cuda12; see the README)"))
        gpus = [f"no GPU found (CuPy {cupy_state})"]
    else:
        rows.append(("cupy", cp.__version__))
        rows.append(("NVRTC", _nvrtc_version(cp)))
        gpus = _gpu_lines(cp)
    source_dir = kernel_source_dir()
    if source_dir is None:
        sources = "not found"
    else:
        n = sum(1 for p in source_dir.glob("*") if p.suffix in (".cu", ".cuh"))
        sources = f"{source_dir} ({n} .cu/.cuh files)"
    rows.append(("kernel sources", sources))
    rows.append(("kernel cache", f"{kernel_cache_dir()} (CuPy's CUPY_CACHE_DIR)"))
    width = max(len(k) for k, _ in rows + [("GPU", "")])
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")
    for line in gpus:
        click.echo(f"{'GPU':<{width}}  {line}")


# ---------------------------------------------------------------------------------------------
# cuflash io

# (up to 2^40: the model's byte counts, products of up to four of them, stay within float64's range)
_POSITIVE = click.IntRange(min=1, max=2**40)
_SHORT_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}  # bench's spellings, accepted by io


@main.command()
@click.option("--batch", type=_POSITIVE, default=1, show_default=True, help="Batch size B.")
@click.option("--heads", type=_POSITIVE, default=1, show_default=True, help="Number of heads H.")
@click.option("--seqlen", type=_POSITIVE, default=8192, show_default=True, help="Query length N.")
@click.option("--seqlen-k", type=_POSITIVE, default=None, help="Key/value length [default: --seqlen].")
@click.option("--headdim", type=_POSITIVE, default=128, show_default=True, help="Head dimension d.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32", "float64", *_SHORT_DTYPES]),
              default="float16", show_default=True,
              help="Element type of Q, K, V, O (fp16, bf16, fp32, fp64 also accepted).")
@click.option("--block-m", type=_POSITIVE, default=128, show_default=True, help="Query rows per tile.")
@click.option("--block-n", type=_POSITIVE, default=64, show_default=True, help="Key columns per tile.")
@click.option("--sram-kib", type=_POSITIVE, default=228, show_default=True,
              help="On-chip memory M per SM in KiB (228 on H100/H200).")
def io(batch, heads, seqlen, seqlen_k, headdim, dtype, block_m, block_n, sram_kib):
    """Memory sizes and HBM traffic: standard attention versus the tiled algorithm.

    The model of Dao et al. 2022 (FlashAttention), Section 3.2, Theorem 2: standard attention
    moves Theta(Nd + N^2) bytes, the tiled algorithm Theta(N^2 d^2 / M).
    """
    m = _io_model.io_model(
        batch=batch, nheads=heads, seqlen_q=seqlen, seqlen_k=seqlen_k, headdim=headdim,
        dtype=_SHORT_DTYPES.get(dtype, dtype), block_m=block_m, block_n=block_n, sram_bytes=sram_kib * 1024,
    )
    for line in io_report(m):
        click.echo(line)


def io_report(m: _io_model.IOModel) -> list[str]:
    """The lines ``cuflash io`` prints for one model."""
    d, nq, nk, e = m.headdim, m.seqlen_q, m.seqlen_k, m.dtype
    acc = "float64" if m.acc_itemsize == 8 else "float32"

    def row(label: str, nbytes: int, note: str = "") -> str:
        return f"  {label:<30} {format_bytes(nbytes):>12}" + (f"   {note}" if note else "")

    lines = [
        f"Attention I/O model: batch {m.batch}, heads {m.nheads}, seqlen {nq} (q) x {nk} (k), "
        f"head dim {d}, {e} ({m.itemsize} bytes per element)",
        "",
        "Sizes in HBM (whole batch, all heads)",
        row(f"Q ({nq} x {d} per head)", m.q_bytes),
        row(f"K ({nk} x {d} per head)", m.k_bytes),
        row(f"V ({nk} x {m.headdim_v} per head)", m.v_bytes),
        row(f"O ({nq} x {m.headdim_v} per head)", m.o_bytes),
        row("Q, K, V, O together", m.qkvo_bytes),
        row(f"score matrix S ({nq} x {nk})", m.score_bytes,
            f"{format_bytes(m.score_bytes_per_head)} per (batch, head) = "
            f"{m.score_over_matrix:g} x one {nq} x {d} matrix"),
        "",
        f"On-chip working set of one tile (block_m {m.block_m}, block_n {m.block_n})",
        row(f"Q tile {m.block_m} x {d} {e}", m.tile_q_bytes),
        row(f"K tile {m.block_n} x {d} {e}", m.tile_k_bytes),
        row(f"V tile {m.block_n} x {m.headdim_v} {e}", m.tile_v_bytes),
        row(f"S tile {m.block_m} x {m.block_n} {acc}", m.tile_s_bytes),
        row(f"O accumulator {m.block_m} x {m.headdim_v} {acc}", m.tile_o_bytes),
        row(f"row max m, row sum l ({m.block_m} each)", m.tile_stats_bytes),
        row("one tile in total", m.tile_bytes,
            f"{'fits in' if m.tile_fits else 'does NOT fit in'} M = {format_bytes(m.sram_bytes)}"),
        "",
        "HBM traffic",
        row("standard attention", m.standard_hbm_bytes, "Theta(Nd + N^2)"),
    ]
    lines += [row(f"  {label}", nbytes) for label, nbytes in m.standard_steps]
    lines += [
        row("tiled (FlashAttention)", m.tiled_hbm_bytes, "Theta(N^2 d^2 / M)"),
        f"    {m.query_blocks} query block{'s' * (m.query_blocks != 1)} of B_r = min(ceil(M / 4 max(d, dv)), Nq) = {m.block_rows} row{'s' * (m.block_rows != 1)} "
        f"(M = {m.sram_elems} {e} elements)",
    ]
    lines += [row(f"  {label}", nbytes) for label, nbytes in m.tiled_steps]
    lines += [
        row(f"tiled, block_m = {m.block_m}", m.kernel_hbm_bytes,
            f"K and V read {_io_model.times(m.kernel_query_blocks)}"),
        f"  {'standard / tiled':<30} {_io_model.ratio(m.hbm_ratio):>12}",
        "",
        _io_model.why_fast(m),
    ]
    return lines


# ---------------------------------------------------------------------------------------------
# cuflash demo and cuflash check


def _array_module():
    """(xp, description): CuPy on its current GPU when one is visible, else NumPy."""
    from . import _arrays

    if _arrays.gpu_available():
        cp = _arrays.cupy_module()
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return cp, f"GPU {cp.cuda.Device().id}: {name}"
    import numpy as np

    return np, "no GPU found: running the CPU path (NumPy)"


def _progress_stream():
    """Progress bars go to stderr when it is a terminal, so that piped or redirected results hold
    only the results; otherwise nowhere (click would print the bar's label as a stray line)."""
    return sys.stderr if getattr(sys.stderr, "isatty", lambda: False)() else StringIO()


def _progress_steps(labels):
    """A click progress bar advanced by name; returns (bar, step)."""
    stream = _progress_stream()
    bar = click.progressbar(length=len(labels), label="cuflash demo", show_pos=True, file=stream)
    on_terminal = getattr(stream, "isatty", lambda: False)()  # off one click prints each new label as a line
    seen = []

    def step(label):
        if seen:
            bar.update(1)
        seen.append(label)
        if on_terminal:
            bar.label = f"cuflash demo: {label}"
            bar.render_progress()
    return bar, step


@main.command()
def demo():
    """Run a default attention problem, check it, and time it against plain attention."""
    from . import _demo

    xp, where = _array_module()
    cfg = _demo.GPU_DEFAULT if xp.__name__ == "cupy" else _demo.CPU_DEFAULT
    click.echo(where)
    click.echo(f"problem: batch {cfg.batch}, seqlen {cfg.seqlen}, heads {cfg.heads}, head dim {cfg.headdim}, "
               f"{cfg.dtype}, causal={cfg.causal}")
    labels = ["forward", "backward", "plain attention"]
    bar, step = _progress_steps(labels)
    with bar:
        r = _demo.run(cfg, xp, step)
        bar.update(1)
    on_gpu = xp.__name__ == "cupy"  # TF/s only there: on a CPU the number says nothing about cuflash

    def rate(key):
        return f"  {r[key]:7.2f} TF/s" if on_gpu else ""

    click.echo(f"(median times of {_demo.REPEATS} runs; the backward of 3)")
    click.echo(f"forward : {r['forward_s'] * 1e3:9.2f} ms{rate('forward_tflops')}   "
               f"max error vs float64 on 64 rows: {r['forward_error']:.2e}")
    click.echo(f"backward: {r['backward_s'] * 1e3:9.2f} ms{rate('backward_tflops')}   "
               f"error ratio on a small problem: {r['backward_ratio']:.2f} (pass <= 1)")
    if r["plain_s"] is not None:
        speedup = r["plain_s"] / r["forward_s"]
        verdict = f"{speedup:.1f}x faster" if speedup >= 1 else f"{1 / speedup:.1f}x slower (the CPU path trades speed for memory)"
        click.echo(f"plain attention (matmul, softmax, matmul): {r['plain_s'] * 1e3:.2f} ms -> cuflash forward is {verdict}")
    else:
        click.echo(f"plain attention failed ({r['plain_error']}); cuflash needs no score matrix")
    click.echo(f"score matrix plain attention materialises: {format_bytes(r['score_bytes'])} (float32); "
               f"cuflash keeps only {cfg.batch * cfg.heads * cfg.seqlen * 4 // 1024} KiB of LSE")
    if r["backward_ratio"] > 1 or not r["forward_error"] < 0.1:
        raise SystemExit(1)


@main.command()
@click.option("--quick", is_flag=True, help="A short sweep (two head dims, two lengths).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Seed of the random inputs, to replay a run [default: fresh, printed].")
def check(quick, seed):
    """Correctness sweep against the float64 reference on this machine's GPU (or the CPU path).

    The ratio is max|cuflash - ref64| / (2 max|naive - ref64| + 1e-5), ref64 the float64
    reference and naive plain attention in the input dtype: <= 1 passes (docs/conventions.md).
    """
    import numpy as np

    from . import _check

    xp, where = _array_module()
    cases = _check.cases(on_gpu=xp is not np, quick=quick)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (1 << 32))
    click.echo(f"{where}; {len(cases)} cases, forward and backward, exactness rule (ratio <= 1 passes); seed {seed}")
    rng = np.random.default_rng(seed)
    results = []
    with click.progressbar(cases, label="cuflash check", item_show_func=lambda c: c.label if c else "",
                           file=_progress_stream()) as bar:
        for case in bar:
            results.append(_check.run_case(case, xp, rng))
    width = max(len(r.case.label) for r in results)
    click.echo(f"{'case'.ljust(width)}  fwd ratio  bwd ratio  result")
    for r in results:
        verdict = "ok" if r.passed else "FAIL"
        click.echo(f"{r.case.label.ljust(width)}  {r.forward_ratio:9.3f}  {r.backward_ratio:9.3f}  {verdict}")
    failed = [r for r in results if not r.passed]
    worst = max(max(r.forward_ratio, r.backward_ratio) for r in results)
    click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed; worst error ratio {worst:.3f}")
    if failed:
        raise SystemExit(1)


# ---------------------------------------------------------------------------------------------
# cuflash bench


def _check_writable(path: str, option: str):
    """An output file of the benchmark can be written (checked by opening it for appending;
    a file this creates is removed again)."""
    if not path:
        raise click.BadParameter("an empty path", param_hint=option)
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise click.BadParameter(f"the folder of {path} does not exist", param_hint=option)
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write {path}: {exc.strerror or exc}", param_hint=option) from None
    if not existed:
        os.remove(path)


def _check_sweep(dtypes, headdims, seqlens):
    """The comma lists of the standard sweep: known dtypes, head dims 1..256, positive lengths.
    Returns the dtypes in bench's short spelling (the long names are accepted too)."""
    long_to_short = {long: short for short, long in _SHORT_DTYPES.items()}
    short = []
    for d in dtypes.split(","):
        spelled = long_to_short.get(d, d)
        if spelled not in ("bf16", "fp16", "fp32", "fp64"):
            raise click.BadParameter(f"{d!r} is not one of bf16, fp16, fp32, fp64 (bfloat16, float16, float32, "
                                     "float64)", param_hint="--dtypes")
        short.append(spelled)
    for name, text, low, high in (("--headdims", headdims, 1, 256), ("--seqlens", seqlens, 1, 1 << 24)):
        for item in text.split(","):
            if not item.strip().isascii() or not item.strip().isdigit() or not low <= int(item) <= high:
                raise click.BadParameter(f"{item!r} is not an integer in [{low}, {high}]", param_hint=name)
    return ",".join(dict.fromkeys(short))  # in order, each once


@main.command()
@click.option("--suite", type=click.Choice(["standard", "paper", "decode", "varlen", "host", "modifiers"]),
              default="standard", show_default=True,
              help="standard: the FlashAttention-2/3 sweep; paper: GPT-2 medium, standard vs cuflash; "
                   "decode: one token against a KV cache, TB/s; varlen: packed vs padded prefill; host: CPU "
                   "microseconds per call and cold compile seconds; modifiers: bias, key-padding mask and "
                   "dropout against cuflash without them and the peers that take them.")
@click.option("--backward", is_flag=True, help="Time attention_backward instead of the forward (standard and "
                                               "modifiers suites).")
@click.option("--deterministic", is_flag=True, help="With --backward (standard suite): also time "
                                                     "deterministic=True, beside the default.")
@click.option("--dtypes", default="bf16,fp16", show_default=True,
              help="Comma list of bf16, fp16, fp32, fp64 (bfloat16, float16, float32, float64 also accepted); "
                   "fp32/fp64 rows show the peers and each dtype's cupy.matmul rate; cuflash runs float32 "
                   "on the TF32 tensor cores (3xTF32) and float64 on the FP64 ones (what their kernels "
                   "lack yet, those rows say).")
@click.option("--headdims", default="64,128,256", show_default=True,
              help="Comma list of head dims to sweep (standard suite; the modifiers suite runs 128 unless "
                   "given), each 1 to 256.")
@click.option("--seqlens", default="512,1024,2048,4096,8192,16384", show_default=True,
              help="Comma list of sequence lengths to sweep (standard suite); batch = 16384 / seqlen.")
@click.option("--no-peers", is_flag=True, help="Skip plain CuPy, torch and JAX.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the numbers as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Bar chart PNG (needs matplotlib).")
def bench(suite, backward, deterministic, dtypes, headdims, seqlens, no_peers, json_path, plot_path):
    """Measure TF/s on this GPU, with the peers present on the machine in the same run."""
    from . import _arrays

    dtypes = _check_sweep(dtypes, headdims, seqlens)
    ctx = click.get_current_context()

    def given(name):
        return ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT

    if suite != "standard":
        fixed = ("seqlens", "plot_path", "deterministic") + (("backward", "dtypes", "headdims") if suite != "modifiers" else ())
        refused = [f"--{name.replace('_', '-')}" for name in fixed if given(name)]
        if refused:
            options = ", ".join(refused).replace("--plot-path", "--plot")
            takes = "--backward, --dtypes and --headdims" if suite == "modifiers" else "none of them"
            raise click.UsageError(f"{options}: only for --suite standard; --suite {suite} runs fixed configurations "
                                   f"(of --seqlens, --plot, --deterministic, --backward, --dtypes, --headdims it "
                                   f"takes {takes})")
        if suite == "modifiers" and not set(dtypes.split(",")) <= {"bf16", "fp16"}:
            raise click.UsageError(f"--dtypes {dtypes}: the modifiers suite runs bf16 and fp16 (its peers' "
                                   "fused bias/mask kernels are 16-bit; float32/float64 modifier rows are not timed)")
    if deterministic and not backward:
        raise click.UsageError("--deterministic times the backward's deterministic=True: add --backward")
    for path, option in ((json_path, "--json"), (plot_path, "--plot")):  # fail now, not after the sweep
        if path is not None:
            _check_writable(path, option)
    if not _arrays.gpu_available():
        raise click.ClickException(f"cuflash bench measures GPU kernels; {_arrays.no_gpu_reason()} (see `cuflash info`)")
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException("--plot needs matplotlib: in a cuflash checkout, pip install -e '.[plot]'")
    from . import bench as bench_module

    argv = ["--suite", suite, "--seqlens", seqlens]
    for name, value in (("dtypes", dtypes), ("headdims", headdims)):  # (modifiers: bf16, head dim 128 unless given)
        if suite == "standard" or given(name):
            argv += [f"--{name}", value]
    argv += ["--backward"] * backward + ["--deterministic"] * deterministic + ["--no-peers"] * no_peers
    argv += ["--json", json_path] if json_path else []
    argv += ["--plot", plot_path] if plot_path else []
    bench_module.main(argv, progress=lambda items, label: click.progressbar(items, label=label, file=_progress_stream()))
