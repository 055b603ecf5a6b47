"""Amendment 5 of the planner study (research/study_planner/study_planner_v2.md): with
`grid_stops_at_drop`, a step-size grid's run stops at its first evaluation more than
learn_max_drop below round 0 (training.stop_accuracy_drop); runs at the protocol's step run
to B, and a grid run started before the amendment resumes as it was written."""

from __future__ import annotations

import json

import pytest
import tomllib

from fedlora.errors import ConfigError
from research.study_planner.study_pilot import drop_stop_override
from research.study_planner.study_runner import pilot_stage
from research.study_planner.study_spec import spec_from_dict
from research.study_planner.study_status import pilot_states, render_status
from study_tiny import TINY_STUDY
from test_study_v2 import V2_KEYS

V2_STOP = TINY_STUDY.replace('metric = "arc-e/loss"', 'metric = "arc-e/acc"' + V2_KEYS)


def _spec(**study):
    raw = tomllib.loads(V2_STOP)
    raw["study"].update(study)
    return spec_from_dict(raw, "tiny-v2-stop")


def test_the_key_is_checked():
    assert _spec().grid_stops_at_drop is False
    assert _spec(grid_stops_at_drop=True).grid_stops_at_drop is True
    with pytest.raises(ConfigError, match="study.grid_stops_at_drop.*true or false"):
        _spec(grid_stops_at_drop="yes")
    with pytest.raises(ConfigError, match="unless study.step_grid and study.learn_max_drop"):
        _spec(grid_stops_at_drop=True, step_grid=[])
    raw = tomllib.loads(
        TINY_STUDY.replace('metric = "arc-e/loss"', 'metric = "arc-e/mc_loss"' + V2_KEYS)
    )
    raw["study"]["grid_stops_at_drop"] = True
    with pytest.raises(ConfigError, match="the accuracy of the one evaluation task"):
        spec_from_dict(raw, "tiny")


def test_grid_runs_stop_at_the_drop_and_protocol_step_runs_do_not(tmp_path):
    spec = _spec(grid_stops_at_drop=True)  # learn_max_drop 0.05, grid x0.3 and x3
    lr = spec.config([]).training.lr
    seen = {}

    def fake(cfg, run_dir, *, resume):
        drop = cfg.training.stop_accuracy_drop
        seen[run_dir.name] = drop
        if run_dir.name.startswith("fixed-0.5"):  # falls 6 points, except at x3 where it learns
            falls = cfg.training.lr != pytest.approx(3 * lr)
            curve = [(0, 0.5), (2, 0.44), (4, 0.5), (6, 0.52)] if falls else [
                (0, 0.5), (2, 0.53), (4, 0.55), (6, 0.56)]  # fmt: skip
        else:
            curve = [(0, 0.5), (2, 0.54), (4, 0.55), (6, 0.56)]
        stop = "time_budget"
        if drop and curve[1][1] < curve[0][1] - drop:  # what the engine does: stop at 2 s
            curve, stop = curve[:2], "accuracy_drop"
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            {"round": r, "sim_time_s": t, "eval": {"arc-e": v}} for r, (t, v) in enumerate(curve)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (run_dir / "config.toml").write_text(f"[training]\nstop_accuracy_drop = {drop!r}\n")
        summary = {"sim_time_s": curve[-1][0], "rounds": len(curve) - 1, "stop_reason": stop}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return {}

    rule = pilot_stage(spec, tmp_path, run_fn=fake, log=lambda _: None)
    assert seen == {
        "fixed-full-seed5": 0.0,
        "fixed-0.5-seed5": 0.0,  # the protocol's step: to B, though it falls
        "fslora-seed5": 0.0,
        "proposed-separate-seed5": 0.0,
        "fixed-0.5-x0.3-seed5": 0.05,
        "fixed-0.5-x3-seed5": 0.05,
    }
    # the stopped run cannot learn; the factor that learns is chosen, as without the stop
    assert rule["steps"]["fixed-0.5"] == 3.0
    assert rule["learning"]["fixed-0.5"]["0.3"]["learned"] is False
    rows = {r.name: r for r in pilot_states(spec, tmp_path)[0]}
    assert rows["pilot/fixed-0.5-x0.3-seed5"].stop_reason == "accuracy_drop"
    text = render_status(spec, tmp_path)
    assert "| no (-6.0 at 2 s: stopped at the drop) |" in text
    assert "| 50.0, 44.0, 50.0, 52.0 | no (2.0 at B) |" in text  # x1 fell too, and ran to B
    assert "grid runs stop early where they fall (grid_stops_at_drop): at most this." in text
    assert "at most this" not in render_status(_spec(), tmp_path)
    # the report's pilot table says where it stopped
    from fedlora.studies.runs import load_run
    from research.study_planner.study_report_pilot import pilot_lines

    pilot = {d.name[: -len("-seed5")]: load_run(d) for d in sorted((tmp_path / "pilot").iterdir())}
    lines = pilot_lines(rule, spec.metric, pilot)
    assert "| fixed-0.5-x0.3 | 0.10 | False | 2 | at the drop, 2 s |" in lines
    assert "| fixed-0.5 | 0.10 | False | 4 | time_budget |" in lines


def test_a_grid_run_started_before_the_amendment_resumes_as_written(tmp_path):
    spec = _spec(grid_stops_at_drop=True)
    run_dir = tmp_path / "fslora-x3-seed5"
    assert drop_stop_override(spec, run_dir, 3.0) == ["training.stop_accuracy_drop=0.05"]
    assert drop_stop_override(spec, run_dir, 1.0) == []  # the protocol's step: never
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("[training]\nlr = 0.15\n")  # written before it
    assert drop_stop_override(spec, run_dir, 3.0) == []
    (run_dir / "config.toml").write_text("[training]\nstop_accuracy_drop = 0.05\n")
    assert drop_stop_override(spec, run_dir, 3.0) == ["training.stop_accuracy_drop=0.05"]
    assert drop_stop_override(_spec(), run_dir, 3.0) == []  # the amendment off
