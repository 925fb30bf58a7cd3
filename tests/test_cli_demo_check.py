"""`cuflash demo` and `cuflash check` on this machine (the CPU path without a GPU)."""

from click.testing import CliRunner

from cuflash import _arrays, _check
from cuflash.cli import main


def test_demo_runs_checks_and_reports():
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    if not _arrays.gpu_available():
        assert "no GPU found" in result.output
    for needle in ("forward :", "backward:", "max error vs float64", "score matrix", "median times of 5 runs"):
        assert needle in result.output
    assert ("TF/s" in result.output) == _arrays.gpu_available()  # no TF/s for the CPU path (issue 20)


def test_check_quick_passes():
    result = CliRunner().invoke(main, ["check", "--quick"])
    assert result.exit_code == 0, result.output
    assert " 0 failed" in result.output and "worst error ratio" in result.output
    # Redirected (not a terminal), the progress bar prints nothing: a newcomer's `2>&1 | tail -1`
    # once read "worst error ratio 0.500cuflash check".
    assert "cuflash check" not in result.output


def test_check_exits_nonzero_on_a_failure(monkeypatch):
    def failing(case, xp, rng):
        return _check.Result(case, 3.0, 0.5)

    monkeypatch.setattr(_check, "run_case", failing)
    result = CliRunner().invoke(main, ["check", "--quick"])
    assert result.exit_code == 1
    assert "FAIL" in result.output


def test_check_cases_cover_every_option_and_dtype():
    cpu = _check.cases(on_gpu=False)
    assert {c.dtype for c in cpu} == {"float16", "bfloat16", "float32"}
    assert {c.option for c in cpu} == {name for name, _ in _check.OPTIONS}
    gpu = _check.cases(on_gpu=True, quick=True)
    assert {c.dtype for c in gpu} == {"float16", "bfloat16", "float32"}  # (float32: the 3xTF32 kernels, issue 24)
    assert not [c for c in gpu if c.dtype == "float32" and c.option in _check.GPU_FLOAT32_LACKS]
    assert {c.option for c in gpu if c.dtype == "bfloat16"} == {name for name, _ in _check.OPTIONS}


def test_check_seed_replays_the_run():
    """Fresh-user report (session 6): two runs could not be compared (fresh inputs, no seed)."""
    first, second = (CliRunner().invoke(main, ["check", "--quick", "--seed", "7"]) for _ in range(2))
    assert first.exit_code == 0 and "seed 7" in first.output
    assert first.output == second.output
