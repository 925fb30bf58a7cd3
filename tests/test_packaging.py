"""The wheel ships every kernel source and works from a fresh virtual environment.

``pip wheel .`` builds the wheel (hatchling force-includes ``kernels/`` as ``cuflash/kernels``);
the wheel is installed into a new venv outside the checkout, and a script run there imports
cuflash, finds the kernel sources through ``cuflash._kernels.kernel_dir()``, checks that they are
the installed copies, and runs ``cuflash.attention`` on NumPy arrays.  Needs network access or a
warm pip cache (for hatchling and for numpy, ml_dtypes, click).
"""

import json
import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = (".cu", ".cuh")

CHECK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import numpy as np

    import cuflash

    package = Path(cuflash.__file__).resolve().parent
    try:
        from cuflash import _kernels
    except ModuleNotFoundError as exc:  # before cuflash._kernels existed
        if exc.name != "cuflash._kernels":
            raise
        kernel_dir = package / "kernels"
    else:
        kernel_dir = Path(_kernels.kernel_dir()).resolve()

    try:
        import cupy  # noqa: F401
        has_cupy = True
    except ImportError:
        has_cupy = False

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 7, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 7, 2, 16)).astype(np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    # Plain softmax(q k^T / sqrt(d)) v in float64, key head h // 2 for query head h.
    kk, vv = np.repeat(k, 2, axis=2).astype(np.float64), np.repeat(v, 2, axis=2).astype(np.float64)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), kk) / 4.0
    p = np.exp(s - s.max(-1, keepdims=True))
    ref_lse = np.log(p.sum(-1)) + s.max(-1)
    ref = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), vv)

    print(json.dumps({
        "cuflash_file": str(Path(cuflash.__file__).resolve()),
        "package": str(package),
        "prefix": str(Path(sys.prefix).resolve()),
        "kernel_dir": str(kernel_dir),
        "kernel_files": sorted(p.name for p in kernel_dir.iterdir() if p.is_file()),
        "has_cupy": has_cupy,
        "out_err": float(np.abs(out - ref).max()),
        "lse_err": float(np.abs(lse - ref_lse).max()),
        "out_shape": list(out.shape),
    }))
    """
)


def _kernel_sources():
    return sorted(
        p.relative_to(ROOT / "kernels").as_posix()
        for p in (ROOT / "kernels").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    )


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_wheel_ships_kernels_and_runs_in_a_fresh_venv(tmp_path):
    sources = _kernel_sources()
    assert any(name.endswith(KERNEL_SUFFIXES) for name in sources), "kernels/ holds no .cu/.cuh file"

    # 1. Build the wheel from the checkout.
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(dist), "-q"], env=env)
    wheels = list(dist.glob("cuflash-*.whl"))
    assert len(wheels) == 1, wheels

    # 2. The wheel holds exactly the checkout's kernel files, byte for byte, and the console script.
    with zipfile.ZipFile(wheels[0]) as zf:
        names = zf.namelist()
        shipped = sorted(n[len("cuflash/kernels/"):] for n in names if n.startswith("cuflash/kernels/"))
        assert shipped == sources
        for name in sources:
            assert zf.read(f"cuflash/kernels/{name}") == (ROOT / "kernels" / name).read_bytes(), name
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "cuflash = cuflash.cli:main" in zf.read(entry_points).decode()
    assert "cuflash/__init__.py" in names and "cuflash/cli.py" in names
    assert not any(n.startswith(("tests/", "kernels/", "scripts/")) for n in names)

    # 3. A fresh venv outside the checkout; pip resolves the wheel's own dependencies.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    _run([str(python), "-m", "pip", "install", "-q", "--prefer-binary", str(wheels[0])], env=env)

    # 4. Import from there (cwd outside the checkout, so only the installed copy can be found).
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = _run([str(python), "-c", CHECK_SCRIPT], cwd=work, env=env)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    prefix = Path(info["prefix"])
    assert Path(info["cuflash_file"]).is_relative_to(prefix), info
    assert not Path(info["cuflash_file"]).is_relative_to(ROOT), info
    assert Path(info["kernel_dir"]) == Path(info["package"]) / "kernels", info
    top_level = sorted(n for n in sources if "/" not in n)
    assert info["kernel_files"] == top_level
    assert not info["has_cupy"]  # cuflash imports and runs without CuPy
    assert info["out_shape"] == [2, 5, 4, 16]
    assert info["out_err"] < 1e-5 and info["lse_err"] < 1e-5, info

    # 5. The console script works.
    script = bindir / ("cuflash.exe" if os.name == "nt" else "cuflash")
    out = _run([str(script), "io", "--seqlen", "32768"], cwd=work, env=env).stdout
    assert "2 GiB" in out
    out = _run([str(script), "info"], cwd=work, env=env).stdout
    assert str(Path(info["package"]) / "kernels") in out
    assert "no GPU found" in out


def test_parallel_is_an_attribute_of_the_package():
    """``cuflash.parallel`` works after ``import cuflash`` (loaded on first use), not only through
    ``from cuflash import parallel``."""
    import cuflash

    assert cuflash.parallel.__name__ == "cuflash.parallel"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cuflash.nope  # noqa: B018
