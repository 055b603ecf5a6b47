"""Experiment trackers (output.trackers): the events read back with TensorBoard's own
EventAccumulator and MLflow's own MlflowClient; a resumed run continues the same tracked run
without duplicate steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.tracking import scalars
from test_engine import TINY, _metrics

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc


def test_scalars_flatten_numbers_only():
    line = {"round": 2, "eval": {"arc-e": 0.5, "boolq": None}, "k": [1, 2], "ok": True,
            "train_loss": None, "sim_time_s": 1.5, "x": float("nan"), "name": "a"}  # fmt: skip
    assert scalars(line) == {"round": 2.0, "eval/arc-e": 0.5, "sim_time_s": 1.5}


def test_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match=r"output.trackers\[0\].*tensorboard, mlflow"):
        load_config(None, ['output.trackers=["wandb"]'])


def test_tensorboard_and_mlflow_get_every_line_and_resume_continues(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [*TINY, 'output.trackers=["tensorboard", "mlflow"]'])
    run_dir = tmp_path / "t"
    prepare_run_dir(cfg, run_dir)
    run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    lines = _metrics(run_dir)
    assert [m["round"] for m in lines] == [0, 1, 2, 3]

    events = _events(run_dir)
    sim = [(e.step, e.value) for e in events.Scalars("sim_time_s")]
    assert sim == [(m["round"], pytest.approx(m["sim_time_s"], rel=1e-6)) for m in lines]
    acc = [(e.step, e.value) for e in events.Scalars("eval/arc-e")]
    want = [(m["round"], m["eval"]["arc-e"]) for m in lines if "eval" in m]
    assert [s for s, _ in acc] == [s for s, _ in want]
    assert [v for _, v in acc] == pytest.approx([v for _, v in want], rel=1e-6)

    record = json.loads((run_dir / "mlflow_run.json").read_text())
    assert record["tracking_uri"] == f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["training.rounds"] == "3"
    assert run.data.params["data.tasks"] == '["arc-e", "boolq"]'
    hist = client.get_metric_history(record["run_id"], "sim_time_s")
    assert sorted((m.step, m.value) for m in hist) == [(m["round"], m["sim_time_s"]) for m in lines]
    artifacts = {a.path for a in client.list_artifacts(record["run_id"])}
    assert {"config.toml", "summary.json", "metrics.jsonl", "adapter"} <= artifacts
    adapter = {a.path for a in client.list_artifacts(record["run_id"], "adapter")}
    assert "adapter/adapter_model.safetensors" in adapter

    # a crash after round 3's line but before its checkpoint: resume replays round 3
    newest = sorted((run_dir / "checkpoints").glob("round-*.safetensors"))[-1]
    newest.unlink()
    run_experiment(cfg, run_dir, resume=True, quiet=True, log=lambda m: None)
    assert [m["round"] for m in _metrics(run_dir)] == [0, 1, 2, 3]
    assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == record["run_id"]
    hist = client.get_metric_history(record["run_id"], "sim_time_s")
    assert sorted(m.step for m in hist) == [0, 1, 2, 3]  # no duplicate step 3
    assert client.get_run(record["run_id"]).info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    events = _events(run_dir)  # the replayed step 3 replaces the first one
    assert [e.step for e in events.Scalars("sim_time_s")] == [0, 1, 2, 3]


def test_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    cfg = load_config(None, [*TINY, "training.rounds=1", 'output.trackers=["mlflow"]'])
    run_dir = tmp_path / "m"
    prepare_run_dir(cfg, run_dir)
    with pytest.raises(ConfigError, match=r"fedlora\[tracking\]"):
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
