"""training.stop_accuracy_drop: a run stops at the first evaluation more than the drop below
round 0's accuracy, and a drop of exactly the setting goes on (hand values; the engine with
its accuracies replaced by a chosen sequence)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.progress import Progress, accuracy_fell, stop_before_round
from tiny_runs import DATA, TINY_EVAL_RUN

needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


def _cfg(*extra: str):
    return load_config(None, ["model.name=tiny-llama", *extra])


def test_the_drop_is_judged_against_round_0_and_exactly_the_setting_goes_on():
    cfg = _cfg("training.stop_accuracy_drop=0.05")
    # 500 questions: 50.8% -> 45.8% is exactly 5 points (0.05000000000000004 in floats)
    assert not accuracy_fell(cfg, Progress(initial_accuracy=0.508, last_accuracy=0.458))
    assert accuracy_fell(cfg, Progress(initial_accuracy=0.508, last_accuracy=0.456))
    assert stop_before_round(cfg, Progress(initial_accuracy=0.508, last_accuracy=0.456)) == (
        "accuracy_drop"
    )
    # no evaluation yet, or the setting off: never
    assert not accuracy_fell(cfg, Progress(initial_accuracy=None, last_accuracy=None))
    off = _cfg()
    assert off.training.stop_accuracy_drop == 0.0
    assert not accuracy_fell(off, Progress(initial_accuracy=0.9, last_accuracy=0.1))
    # a rise is no drop
    assert not accuracy_fell(cfg, Progress(initial_accuracy=0.3, last_accuracy=0.9))


@pytest.mark.parametrize("value", [-0.1, 1.5, "x"])
def test_a_bad_drop_names_the_field(value):
    with pytest.raises(ConfigError, match="training.stop_accuracy_drop"):
        _cfg(f"training.stop_accuracy_drop={value!r}")


@needs_data
def test_the_engine_stops_at_the_first_evaluation_past_the_drop(tmp_path, monkeypatch):
    from fedlora.federation import round_steps
    from fedlora.federation.run import prepare_run_dir, run_experiment

    # round 0 at 0.50; rounds 1-3 at 0.48, 0.45 (exactly 5 points: goes on), 0.44 (stops)
    accuracies = iter([0.50, 0.48, 0.45, 0.44, 0.60, 0.60])
    monkeypatch.setattr(round_steps, "mean_over_tasks", lambda accs: next(accuracies))
    extra = ["training.rounds=6", "training.stop_accuracy_drop=0.05"]
    cfg = load_config(None, [*TINY_EVAL_RUN, *extra])
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    assert summary["stop_reason"] == "accuracy_drop" and summary["rounds"] == 3
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["eval_accuracy"] for x in lines] == [0.50, 0.48, 0.45, 0.44]
