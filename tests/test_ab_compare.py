"""scripts/ab_compare.py's rotation and table, with the measuring processes replaced (no GPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "ab_compare.py"


def _module():
    spec = importlib.util.spec_from_file_location("ab_compare", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_checkout_runs_once_per_round_in_a_rotating_order_with_its_environment(monkeypatch, tmp_path):
    ab = _module()
    calls = []
    rates = {"base": 100.0, "new": 90.0, "env": 110.0}  # new is 10 % slower, env 10 % faster

    class Done:
        returncode, stderr = 0, ""

        def __init__(self, rate):
            self.stdout = json.dumps([["fwd d64", rate], ["host calls", rate / 10]])

    def run(cmd, capture_output, text, env):
        side = Path(cmd[cmd.index("--side") + 1]).name
        calls.append((side, env.get("CUFLASH_SM90_PERSISTENT")))
        return Done(rates[side])

    monkeypatch.setattr(ab.subprocess, "run", run)
    for name in rates:
        (tmp_path / name).mkdir()
    table = tmp_path / "ab.md"
    ab.main([str(tmp_path / "base"), str(tmp_path / "new"), f"{tmp_path / 'env'},CUFLASH_SM90_PERSISTENT=0",
             "--rounds", "3", "--parts", "fwd", "--markdown", str(table)])
    assert [c[0] for c in calls] == ["base", "new", "env", "new", "env", "base", "env", "base", "new"]
    assert {c for c in calls if c[0] == "env"} == {("env", "0")} and all(c[1] is None for c in calls if c[0] != "env")
    text = table.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| fwd d64"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["100.00", "90.00", "110.00"]
    assert cells[4] == "0.900 **slower**" and cells[5] == "1.100" and cells[6] == "0.000"


def test_one_checkout_is_refused():
    with pytest.raises(SystemExit):
        _module().main(["only-one"])
