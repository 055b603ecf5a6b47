"""`fedlora plan PROBLEM.json [--solver exact|cvxpy] [-o PLAN.json]`: output schema and bad input
(exit 2, one-line message, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlora.cli import main

PROBLEM = {
    "gamma": 16,
    "f_tot": 100.0,
    "clients": [
        {"a": 0.5, "tau_full_s": 1.3, "t_full": 40.0},
        {"a": 0.3, "tau_full_s": 0.4, "t_full": 90.0},
        {"a": 0.2, "tau_full_s": 2.0, "t_full": 10.0},
    ],
    "constants": {"A": 1.0, "B": 1.0, "C": 0.01, "D": 0.001},
    "options": {
        "comm_cost": "quadratic",
        "comp_cost": "quadratic",
        "q_lower_bound": "per_client",
        "m_search": "exact",
    },
}
KEYS = {
    "q",
    "k",
    "objective",
    "expected_round_time_s",
    "expected_rounds",
    "constants",
    "iterations",
    "solver",
}


def write(tmp_path: Path, data, name: str = "problem.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_plan_prints_the_documented_output(tmp_path, capsys):
    assert main(["plan", str(write(tmp_path, PROBLEM))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= out.keys()
    assert len(out["q"]) == 3 and all(0 < q <= 1 for q in out["q"])
    assert all(isinstance(k, int) and 1 <= k <= 16 for k in out["k"])
    assert out["objective"] == pytest.approx(out["expected_rounds"] * out["expected_round_time_s"])
    assert out["constants"] == PROBLEM["constants"] and out["solver"] == "exact"


def test_plan_writes_plan_json_and_cvxpy_agrees(tmp_path, capsys):
    problem = write(tmp_path, PROBLEM)
    assert main(["plan", str(problem), "-o", str(tmp_path / "exact.json")]) == 0
    assert main(["plan", str(problem), "--solver", "cvxpy", "-o", str(tmp_path / "cvx.json")]) == 0
    assert "P2 =" in capsys.readouterr().out
    exact = json.loads((tmp_path / "exact.json").read_text())
    cvx = json.loads((tmp_path / "cvx.json").read_text())
    assert cvx["solver"] == "cvxpy"
    assert cvx["objective"] == pytest.approx(exact["objective"], rel=1e-6)


def test_plan_with_calibration_reports_estimated_constants(tmp_path, capsys):
    a = [0.5, 0.3, 0.2]
    runs = []
    for q, k in ((1.0, 16), (0.5, 8), (0.8, 4), (0.3, 12)):
        y = sum(x * x / q for x in a)
        z = y * 256 / k**2
        runs.append({"q": [q] * 3, "k": [k] * 3, "rounds": 2.0 / (1.0 - 0.02 * y - 0.004 * z)})
    problem = dict(PROBLEM, calibration=runs)
    del problem["constants"]
    assert main(["plan", str(write(tmp_path, problem))]) == 0
    c = json.loads(capsys.readouterr().out)["constants"]
    assert [c[x] for x in "ABCD"] == pytest.approx([2.0, 1.0, 0.02, 0.004], rel=1e-9)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gamma": 0}, "gamma = 0 is invalid"),
        ({"clients": []}, "clients = [] is invalid: at least one client"),
        ({"f_tot": -5}, "f_tot = -5 is invalid"),
        ({"constants": {"A": 1, "B": -1, "C": 0.01, "D": 0.001}}, "constants.B = -1"),
        ({"options": {"solver": "cvx"}}, "options.solver = 'cvx'"),
    ],
)
def test_plan_bad_input_exits_2_without_traceback(tmp_path, capsys, change, message):
    assert main(["plan", str(write(tmp_path, dict(PROBLEM, **change)))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora plan: error: ") and message in err
    assert "Traceback" not in err


def test_plan_weights_and_normalise_flag(tmp_path, capsys):
    problem = json.loads(json.dumps(PROBLEM))
    problem["clients"][0]["a"] = 1.0  # sum 1.5
    path = write(tmp_path, problem)
    assert main(["plan", str(path)]) == 2
    assert "sum to 1.5, not 1" in capsys.readouterr().err
    assert main(["plan", str(path), "--normalize-a"]) == 0


def test_plan_infeasible_client_is_named(tmp_path, capsys):
    problem = dict(PROBLEM, constants={"A": 1, "B": 1, "C": 2.0, "D": 0.1})
    assert main(["plan", str(write(tmp_path, problem))]) == 2
    assert "infeasible: client 0 needs q_0 > " in capsys.readouterr().err


def test_plan_malformed_json_subprocess(tmp_path):
    path = write(tmp_path, '{"gamma": 16,\n  "clients": [,]}')
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "fedlora.cli", "plan", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "problem.json: invalid JSON at line 2 column 15" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_plan_max_weight_and_constrained_calibration_fit(tmp_path, capsys):
    # Prepare: calibration runs where halving q never cost a round (C = 0 in truth): the SVD
    # fit gives C <= 0; the constrained fit floors C and names it; --max-weight bounds a/q
    a = [0.5, 0.3, 0.2]
    runs = []
    for q, k in ((1.0, 16), (0.5, 8), (0.8, 4), (0.3, 12)):
        z = sum(x * x / q for x in a) * 256 / k**2
        runs.append({"q": [q] * 3, "k": [k] * 3, "rounds": 2.0 / (1.0 - 0.004 * z)})
    problem = dict(PROBLEM, calibration=runs)
    del problem["constants"]
    path = write(tmp_path, problem)
    # Execute / Assert: refused as before with --calibration-fit refuse
    assert main(["plan", str(path), "--calibration-fit", "refuse"]) == 2
    assert "A, B, C, D must be > 0" in capsys.readouterr().err
    assert main(["plan", str(path), "--max-weight", "1.5", "-o", str(tmp_path / "p.json")]) == 0
    assert "floored: C (not identified" in capsys.readouterr().out
    out = json.loads((tmp_path / "p.json").read_text())
    assert set(out["floors"]) == {"C"} and out["constants_fit"].startswith("constrained")
    assert out["constants"]["D"] == pytest.approx(0.004, rel=1e-6)
    assert all(x / q <= 1.5 * (1 + 1e-12) for x, q in zip(a, out["q"]))
    assert main(["plan", str(path), "--max-weight", "-1"]) == 2
    assert "options.max_weight = -1" in capsys.readouterr().err
