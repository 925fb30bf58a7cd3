"""The ``cuflash`` command line: ``cuflash info`` and ``cuflash io``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import click
from click.testing import CliRunner

import cuflash
from cuflash import _arrays, cli
from cuflash._io_model import format_bytes, io_model

ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = _arrays.gpu_available()


def run(*args, env=None):
    result = CliRunner().invoke(cli.main, list(args), env=env, catch_exceptions=False)
    return result


def test_io_defaults_print_the_textbook_numbers():
    result = run("io")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "seqlen 8192 (q) x 8192 (k), head dim 128, float16" in out
    assert "2 MiB" in out  # one N x d matrix
    assert re.search(r"Q, K, V, O together\s+8 MiB", out)
    assert re.search(r"score matrix S \(8192 x 8192\)\s+128 MiB\s+128 MiB per \(batch, head\) = 64 x one 8192 x 128 matrix", out)
    assert re.search(r"one tile in total\s+161 KiB\s+fits in M = 228 KiB", out)
    assert re.search(r"standard attention\s+520 MiB", out)
    assert "Why it is fast" in out


def test_io_output_uses_the_model_numbers():
    args = dict(batch=2, nheads=3, seqlen_q=1000, seqlen_k=3000, headdim=64, dtype="bfloat16",
                block_m=64, block_n=32, sram_bytes=100 * 1024)
    m = io_model(**args)
    result = run("io", "--batch", "2", "--heads", "3", "--seqlen", "1000", "--seqlen-k", "3000",
                 "--headdim", "64", "--dtype", "bfloat16", "--block-m", "64", "--block-n", "32",
                 "--sram-kib", "100")
    assert result.exit_code == 0, result.output
    for value in (m.q_bytes, m.k_bytes, m.score_bytes, m.tile_bytes, m.standard_hbm_bytes,
                  m.tiled_hbm_bytes, m.kernel_hbm_bytes):
        assert format_bytes(value) in result.output
    assert f"{m.query_blocks} query blocks of B_r = min(ceil(M / 4 max(d, dv)), Nq) = {m.block_rows} rows" in result.output
    assert "score matrix S (1000 x 3000)" in result.output


def test_io_at_32768_shows_the_2_gib_score_matrix():
    result = run("io", "--seqlen", "32768")
    assert result.exit_code == 0
    assert re.search(r"score matrix S \(32768 x 32768\)\s+2 GiB", result.output)


def test_io_flags_a_tile_that_does_not_fit():
    result = run("io", "--headdim", "256", "--block-m", "256", "--block-n", "128", "--sram-kib", "100")
    assert result.exit_code == 0
    assert "does NOT fit in M = 100 KiB" in result.output


@pytest.mark.parametrize(
    "args, word",
    [
        (["--dtype", "int8"], "--dtype"),
        (["--seqlen", "0"], "--seqlen"),
        (["--headdim", "x"], "--headdim"),
        (["--block-m", "-4"], "--block-m"),
        (["--seqlen", str(10**160)], "--seqlen"),  # (was an OverflowError traceback in the byte formatting)
        (["--sram-kib", str(10**306)], "--sram-kib"),
        (["--headdim", str(2**40 + 1)], "--headdim"),
    ],
)
def test_io_rejects_bad_options(args, word):
    result = CliRunner().invoke(cli.main, ["io", *args])
    assert result.exit_code == 2
    assert word in result.output


def test_io_at_the_largest_sizes_prints_finite_numbers():
    big = str(2**40)
    result = CliRunner().invoke(cli.main, ["io", "--seqlen", big, "--headdim", big, "--batch", big, "--heads", big,
                                           "--block-n", big, "--block-m", big])
    assert result.exit_code == 0, result.output
    assert "PiB" in result.output and "inf" not in result.output and "nan" not in result.output


def test_help_lists_the_commands():
    result = run("--help")
    assert result.exit_code == 0
    assert "info" in result.output and "io" in result.output
    assert run("--version").output.strip().endswith(cuflash.__version__)


def test_info(tmp_path):
    result = run("info", env={"CUPY_CACHE_DIR": str(tmp_path / "cache")})
    assert result.exit_code == 0, result.output
    out = result.output
    assert re.search(rf"cuflash\s+{re.escape(cuflash.__version__)}", out)
    assert np.__version__ in out
    assert re.search(rf"kernel cache\s+{re.escape(str(tmp_path / 'cache'))}", out)
    assert "kernel sources" in out and "not found" not in out
    if _arrays.cupy_module() is None:
        assert "not installed" in out
    else:
        assert re.search(rf"cupy\s+{re.escape(_arrays.cupy_module().__version__)}", out)
        assert "NVRTC" in out
    if HAS_GPU:
        assert "compute capability" in out
    else:
        assert "no GPU found" in out


def test_info_default_cache_dir():
    env = {"CUPY_CACHE_DIR": None}
    result = run("info", env=env)
    assert str(Path("~/.cupy/kernel_cache").expanduser()) in result.output


def test_info_kernel_sources_are_the_checkout_or_package_kernels():
    folder = cli.kernel_source_dir()
    assert folder is not None
    assert {p.name for p in folder.iterdir()} >= {p.name for p in (ROOT / "kernels").iterdir()}


def test_info_without_cupy(monkeypatch):
    monkeypatch.setattr(_arrays, "cupy_module", lambda: None)
    result = run("info")
    assert result.exit_code == 0, result.output
    assert "not installed" in result.output
    assert "no GPU found" in result.output


def test_info_in_a_process_where_cupy_cannot_be_imported():
    code = "import sys; sys.modules['cupy'] = None\nfrom cuflash.cli import main\nmain(['info'])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"cupy\s+not installed", proc.stdout)
    assert "no GPU found" in proc.stdout


def test_info_names_why_cupy_fails_to_import(tmp_path):
    """A CuPy whose import raises (a broken CUDA install) was reported as "not installed"."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise RuntimeError('libcudart.so.13: cannot open')\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r})\nfrom cuflash.cli import main\nmain(['info'])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"cupy\s+fails to import \(RuntimeError: libcudart.so.13: cannot open\)", proc.stdout)
    assert "no GPU found (CuPy fails to import" in proc.stdout


def test_python_dash_m_cuflash_io_in_a_real_process():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "cuflash", "io", "--seqlen", "32768"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 GiB" in proc.stdout
    assert "Why it is fast" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--dtypes", "xyz"], "--dtypes"), (["--headdims", "0"], "--headdims"), (["--headdims", "abc"], "--headdims"),
    (["--seqlens", "-5"], "--seqlens"), (["--plot", "/nonexistent-folder/x.png"], "does not exist"),
    (["--seqlens", "\u00b2"], "--seqlens"), (["--headdims", "\u2460"], "--headdims"),  # isdigit() yet not int()
    (["--json", "/proc/cuflash-bench.json"], "cannot write"), (["--json", ""], "an empty path"),
])
def test_bench_rejects_bad_sweep_options_before_running(args, message):
    result = CliRunner().invoke(cli.main, ["bench", *args])
    assert result.exit_code == 2 and message in result.output


def test_io_says_when_tiling_moves_more():
    result = CliRunner().invoke(cli.main, ["io", "--headdim", "3000000", "--sram-kib", "1"])
    assert result.exit_code == 0 and "Why tiling does not pay at this size" in result.output


def test_bench_refuses_sweep_options_on_fixed_suites():
    result = CliRunner().invoke(cli.main, ["bench", "--suite", "decode", "--headdims", "64"])
    assert result.exit_code == 2 and "--headdims" in result.output and "--suite decode" in result.output
    result = CliRunner().invoke(cli.main, ["bench", "--suite", "paper", "--backward"])
    assert result.exit_code == 2 and "--backward" in result.output
    result = CliRunner().invoke(cli.main, ["bench", "--suite", "modifiers", "--plot", "m.png"])
    # (a new user's report: the message named the modifiers suite among those taking the option it refused)
    assert result.exit_code == 2 and "--plot: only for --suite standard" in result.output
    assert "it takes --backward, --dtypes and --headdims" in " ".join(result.output.split())
    result = CliRunner().invoke(cli.main, ["bench", "--suite", "modifiers", "--seqlens", "4096"])
    assert result.exit_code == 2 and "--seqlens" in result.output
    # The modifiers suite sweeps head dims and the 16-bit dtypes; float32/float64 have no bias/mask/dropout kernels yet.
    result = CliRunner().invoke(cli.main, ["bench", "--suite", "modifiers", "--dtypes", "fp32"])
    assert result.exit_code == 2 and "bf16 and fp16" in result.output


def test_bench_modifiers_passes_head_dims_and_dtypes_only_when_given(monkeypatch):
    """`cuflash bench --suite modifiers` runs issue 23's bf16 / head dim 128 rows unless --headdims or
    --dtypes are given; the standard suite always gets its sweep."""
    seen = []
    monkeypatch.setattr(_arrays, "gpu_available", lambda: True)
    fake = type(sys)("cuflash.bench")
    fake.main = lambda argv, progress=None: seen.append(argv)
    monkeypatch.setitem(sys.modules, "cuflash.bench", fake)
    monkeypatch.setattr(cuflash, "bench", fake, raising=False)
    assert CliRunner().invoke(cli.main, ["bench", "--suite", "modifiers"]).exit_code == 0
    assert "--headdims" not in seen[-1] and "--dtypes" not in seen[-1]
    assert CliRunner().invoke(cli.main, ["bench", "--suite", "modifiers", "--headdims", "64,256", "--dtypes", "fp16"]).exit_code == 0
    assert seen[-1][seen[-1].index("--headdims") + 1] == "64,256" and seen[-1][seen[-1].index("--dtypes") + 1] == "fp16"
    assert CliRunner().invoke(cli.main, ["bench"]).exit_code == 0
    assert seen[-1][seen[-1].index("--headdims") + 1] == "64,128,256"


def test_info_names_the_kernel_family_per_gpu():
    from cuflash.cli import kernel_family

    assert "Hopper" in kernel_family(9, 0, (13, 0), disabled=False)
    assert "NVRTC 12.9" in kernel_family(9, 0, (12, 4), disabled=False)
    assert "CUFLASH_DISABLE_SM90" in kernel_family(9, 0, (13, 0), disabled=True)
    assert kernel_family(8, 0, (13, 0), disabled=False).startswith("sm_80")
    assert kernel_family(12, 0, (13, 0), disabled=False).startswith("sm_80")  # sm_90a code runs on CC 9.0 only
    assert "8.0 or newer" in kernel_family(7, 5, (13, 0), disabled=False)


def test_dtype_spellings_are_shared_by_io_and_bench():
    """Fresh-user report (session 6): io took only float16/bfloat16, bench only fp16/bf16."""
    long, short = (CliRunner().invoke(cli.main, ["io", "--dtype", d, "--seqlen", "1024"]) for d in ("bfloat16", "bf16"))
    assert long.exit_code == 0 and long.output == short.output
    assert cli._check_sweep("bfloat16,fp16", "64", "1024") == "bf16,fp16"


def test_every_option_has_help_and_help_shows_whole_descriptions():
    """Issue 20: `cuflash bench --help` showed --headdims without help; `python -m cuflash --help`
    cut the command descriptions off."""
    for name, cmd in cli.main.commands.items():
        for param in cmd.params:
            if isinstance(param, click.Option) and param.name not in ("help",):
                assert param.help, f"cuflash {name} {param.opts[0]} has no help text"
    text = " ".join(CliRunner().invoke(cli.main, ["--help"], terminal_width=60).output.split())
    for name, cmd in cli.main.commands.items():
        first = " ".join(cmd.help.strip().splitlines()[0].split())
        assert first in text, f"--help does not show all of {name!r}: {first!r}"


def test_bench_sweep_takes_the_wide_dtypes():
    """Issue 24: the standard sweep takes fp32/fp64 (peers and cupy.matmul rates now, cuflash's own
    float32/float64 kernels once they exist), in short or long spelling."""
    import click

    from cuflash.cli import _check_sweep

    assert _check_sweep("float64,fp32,bf16,float16", "64", "512") == "fp64,fp32,bf16,fp16"
    with pytest.raises(click.BadParameter, match="not one of bf16, fp16, fp32, fp64"):
        _check_sweep("int8", "64", "512")


@pytest.mark.parametrize("cupy_installed", [False, True])
def test_bench_without_a_gpu_says_why(monkeypatch, cupy_installed):
    """No CuPy at all is a different fix (install an extra) from CuPy seeing no GPU."""
    from cuflash import _arrays

    monkeypatch.setattr(_arrays, "cupy_module", (lambda: object()) if cupy_installed else (lambda: None))
    monkeypatch.setattr(_arrays, "gpu_available", lambda: False)
    result = CliRunner().invoke(cli.main, ["bench"])
    assert result.exit_code != 0
    expected = "no GPU visible to CuPy" if cupy_installed else "CuPy is not installed (in a cuflash checkout: pip install -e '.[cuda13]'"
    assert expected in result.output, result.output
