"""Re-clocking (fedlora.studies.reclock, `fedlora report --comm-cost/--comp-cost`) on a
hand-made run whose round times are solved by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.studies.reclock import reclock
from fedlora.studies.runs import load_run, time_to_target


def _reclock_run(root: Path) -> Path:
    """γ = 4, f_tot = 10; client 0: τ^γ = 2 s, t^γ = 40; client 1: τ^γ = 1 s, t^γ = 20."""
    d = root / "fslora-seed0"
    d.mkdir(parents=True)
    (d / "config.toml").write_text(
        '[lora]\nrank = 4\n[network]\nf_tot_hz = 10.0\nfading = "none"\nrho = 0.5\n'
        '[method]\nname = "fslora"\n'
    )
    (d / "clients.csv").write_text(
        "client,n_examples,a,tau_full_s,t_full\n0,5,0.5,2.0,40.0\n1,5,0.5,1.0,20.0\n"
    )
    lines = [
        {"round": 0, "sim_time_s": 0.0, "participants": [], "k": [], "eval": {"arc-e": 0.2}},
        {"round": 1, "sim_time_s": 99.0, "participants": [0], "k": [2], "round_time_s": 99.0},
        {
            "round": 2,
            "sim_time_s": 199.0,
            "participants": [0, 1],
            "k": [4, 4],
            "round_time_s": 100.0,
            "eval": {"arc-e": 0.6},
        },  # fmt: skip
        {"round": 3, "sim_time_s": 199.0, "participants": [], "k": [], "round_time_s": 0.0},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_reclock_recomputes_round_times_under_another_cost_model(tmp_path):
    # Prepare
    run = load_run(_reclock_run(tmp_path))
    # Round 2, k = γ: 40/(T−2) + 20/(T−1) = 10  <=>  T² − 9T + 10 = 0  ->  T = (9 + √41)/2
    t2 = (9 + math.sqrt(41)) / 2
    # Execute: paper model: round 1 (k = 2 of 4): τ = 2·(1/2)² = 0.5, t = 40/4 = 10 -> 0.5 + 1
    paper = reclock(run, "quadratic", "quadratic")
    # exact (= linear upload) + affine ρ = 0.5: τ = 2·(0.5 + 0.25) = 1.5, t = 20 -> 1.5 + 2
    exact = reclock(run, "exact", "affine")
    # Assert
    assert [x["sim_time_s"] for x in paper.lines] == pytest.approx([0, 1.5, 1.5 + t2, 1.5 + t2])
    assert [x["sim_time_s"] for x in exact.lines] == pytest.approx([0, 3.5, 3.5 + t2, 3.5 + t2])
    assert time_to_target(exact, "arc-e", 0.5) == (pytest.approx(3.5 + t2), True)
    assert run.lines[1]["sim_time_s"] == 99.0  # the original is untouched
    with pytest.raises(ConfigError, match="--comm-cost = 'cubic' is invalid"):
        reclock(run, "cubic", "affine")


def test_reclock_keeps_a_recorded_downlink_and_refuses_an_unrecorded_one(tmp_path):
    # Prepare: the same run with a paid downlink whose broadcast took 5 s in round 1, 7 s in 2
    d = _reclock_run(tmp_path)
    cfg = (d / "config.toml").read_text().replace("rho = 0.5", "rho = 0.5\ndownlink_rate_bps = 1e6")
    (d / "config.toml").write_text(cfg)
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for line, dl in zip(lines, [None, 5.0, 7.0, 0.0]):
        if dl is not None:
            line["downlink_s"] = dl
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    t2 = (9 + math.sqrt(41)) / 2
    # Execute
    paper = reclock(load_run(d), "quadratic", "quadratic")
    # Assert: the broadcast times are added to the re-clocked upload + compute times
    assert [x["sim_time_s"] for x in paper.lines] == pytest.approx(
        [0, 1.5 + 5, 1.5 + 5 + t2 + 7, 1.5 + 5 + t2 + 7]
    )
    del lines[2]["downlink_s"]  # a run from before downlink_s was recorded
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ConfigError, match="free downlink or one recorded per round"):
        reclock(load_run(d), "quadratic", "quadratic")


def test_report_cli_reclocks(tmp_path, capsys):
    d = _reclock_run(tmp_path / "suite")
    out = tmp_path / "exact"
    argv = ["report", str(d), "--target", "arc-e=0.5", "-o", str(out)]
    assert main([*argv, "--comm-cost", "exact", "--comp-cost", "affine"]) == 0
    text = (out / "report.md").read_text()
    assert "Re-clocked under comm_cost = exact, comp_cost = affine" in text
    assert f"| fslora | {3.5 + (9 + math.sqrt(41)) / 2:.1f} |" in text
    assert main([*argv, "--comm-cost", "exact"]) == 2
    assert "--comm-cost and --comp-cost go together" in capsys.readouterr().err
