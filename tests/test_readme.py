"""The README tells the truth: its Python examples run, its set-up commands are the ones CI runs,
and its ``cuflash io`` sample is what the command prints."""

import doctest
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from cuflash import _arrays, cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(language):
    return [(README[: m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(README)
            if m.group(1) == language]


PYTHON_BLOCKS = blocks("python")


def _needs_gpu(code):
    return "cupy" in code


def test_readme_has_numpy_and_cupy_examples():
    assert any(not _needs_gpu(code) for _, code in PYTHON_BLOCKS)
    assert any(_needs_gpu(code) for _, code in PYTHON_BLOCKS)


def _run_block(lineno, code, namespace):
    if ">>>" in code:
        parser = doctest.DocTestParser()
        test = parser.get_doctest(code, namespace, f"README.md:{lineno}", str(ROOT / "README.md"), lineno)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        result = runner.run(test, clear_globs=False)
        assert result.failed == 0, f"README.md line {lineno}: {result.failed} doctest example(s) failed"
        namespace.update(test.globs)  # get_doctest copied the namespace; later blocks continue it
    else:
        exec(compile(code, f"README.md:{lineno}", "exec"), namespace)


def test_readme_numpy_examples_run():
    namespace = {}  # one namespace, in order: later blocks continue earlier ones
    ran = 0
    for lineno, code in PYTHON_BLOCKS:
        if not _needs_gpu(code):
            _run_block(lineno, code, namespace)
            ran += 1
    assert ran >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not _arrays.gpu_available(), reason="the README's CuPy example needs a GPU")
def test_readme_cupy_examples_run():
    for lineno, code in PYTHON_BLOCKS:
        if _needs_gpu(code):
            _run_block(lineno, code, {})


SETUP_COMMANDS = ('pip install -e ".[test]"', "python -m pytest -q")
GPU_INSTALL = 'pip install -e ".[test,cuda13]"'


def _commands(code):
    return [line.split("#")[0].strip() for line in code.strip().splitlines() if line.split("#")[0].strip()]


def test_readme_setup_commands_are_what_ci_runs():
    """The first block is the CPU set-up (no CUDA wheels); CI installs the README's CUDA 13 line
    instead (NVRTC compiles the kernels there) and runs the README's test command as written."""
    setup = _commands(blocks("bash")[0][1])
    assert tuple(setup) == SETUP_COMMANDS
    assert not any("cuda" in c for c in setup)
    gpu = _commands(blocks("bash")[1][1])
    assert GPU_INSTALL in gpu and 'pip install -e ".[test,cuda12]"' in gpu
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in (GPU_INSTALL, SETUP_COMMANDS[1]):
        assert command in ci_lines, f".ci/run does not run the README's {command!r}"


def test_readme_io_sample_is_the_real_output():
    (_, sample), = [b for b in blocks("console") if b[1].startswith("$ cuflash io\n")]
    expected = sample.split("\n", 1)[1]
    result = CliRunner().invoke(cli.main, ["io"])
    assert result.exit_code == 0
    assert result.output == expected


def test_readme_mentions_every_cli_command():
    for name in cli.main.commands:
        assert f"cuflash {name}" in README
