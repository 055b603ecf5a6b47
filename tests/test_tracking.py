"""Experiment trackers (output.trackers): the events read back with TensorBoard's own
EventAccumulator and MLflow's own MlflowClient; a resumed run continues the same tracked run
without duplicate steps; a tracker is one class; a bad store URI or an unknown stored run is
refused before anything is written; a run that does not finish leaves its MLflow run FAILED
(an exception, Ctrl-C in round 0, SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import ClassVar

import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation import tracked_run
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.tracked_run import Trackers
from fedlora.federation.tracking import (
    TRACKER_REGISTRY,
    TRACKERS,
    Tracker,
    check_tracker_names,
    check_trackers,
    register_tracker,
    scalars,
    tracker_class,
)
from test_engine import TINY, _metrics

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc


def test_scalars_flatten_numbers_only():
    line = {
        "round": 2,
        "eval": {"arc-e": 0.5, "boolq": None},
        "k": [1, 2],
        "ok": True,
        "train_loss": None,
        "sim_time_s": 1.5,
        "x": float("nan"),
        "name": "a",
    }
    assert scalars(line) == {"round": 2.0, "eval/arc-e": 0.5, "sim_time_s": 1.5}


def test_unknown_tracker_is_a_config_error():
    cfg = load_config(None, ['output.trackers=["tensorbord"]'])
    with pytest.raises(
        ConfigError,
        match=r"output.trackers\[0\] = 'tensorbord' is invalid: allowed: tensorboard, mlflow"
        r".*\(did you mean 'tensorboard'\?\)",
    ):
        check_trackers(cfg)
    with pytest.raises(ConfigError, match=r"output.trackers\[0\] = 3 is invalid"):
        load_config(None, ["output.trackers=[3]"])


class _Recorder(Tracker):
    """A tracker added by one class (registered by the test that uses it): it records every
    call."""

    calls: ClassVar[list] = []

    def open(self, cfg, run_dir, *, resume, next_step):
        self.calls.append(("open", resume, next_step))

    def log_metrics(self, step, values):
        self.calls.append(("log", step, values["sim_time_s"]))

    def log_artifact(self, path):
        self.calls.append(("artifact", path.name))

    def close(self, *, failed):
        self.calls.append(("close", failed))


def test_the_decorator_registers_a_tracker_and_unregister_forgets_it():
    class Named(Tracker):
        pass

    try:
        assert register_tracker("test_named")(Named) is Named and Named.name == "test_named"
        assert TRACKERS["test_named"] is Named and tracker_class("test_named") is Named
        check_tracker_names(load_config(None, ['output.trackers=["test_named"]']))
    finally:
        TRACKER_REGISTRY.unregister("test_named")
    assert "test_named" not in TRACKERS
    with pytest.raises(ConfigError, match=r"output.trackers\[0\] = 'test_named' is invalid"):
        check_tracker_names(load_config(None, ['output.trackers=["test_named"]']))
    with pytest.raises(TypeError, match="Tracker subclass"):
        register_tracker("not_a_tracker")(int)


def test_a_tracker_failing_to_close_leaves_the_others_failed(tmp_path):
    closed = []

    class Broken(Tracker):
        name = ""  # not in the table

        def close(self, *, failed):
            raise OSError("store gone")

    class Fine(Tracker):
        name = ""

        def close(self, *, failed):
            closed.append(failed)

    (tmp_path / "summary.json").write_text("{}")
    trackers = Trackers([Broken(), Fine()], tmp_path)
    assert trackers in tracked_run._OPEN
    with pytest.raises(OSError, match="store gone"):
        trackers.finish()
    assert closed == [True] and not tracked_run._OPEN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("{tmp}/plain", "file store"),
        ("relative/dir", "file store"),
        ("file:///{tmp}/x", "file store"),
        ("http://[::1", "does not parse as a URI"),
        ("http://localhost:99999", "does not parse as a URI"),
        ("http://", "names a host"),
        ("htp://localhost", "unknown scheme 'htp'"),
        ("sqlite:///{tmp}/no/such/m.db", "does not exist"),
        ("sqlite:///{tmp}", "is not a file"),
        ("sqlite://host/x.db", "an SQLite URI is"),
    ],
)
def test_bad_mlflow_uri_is_refused_before_anything_is_written(uri, why, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = uri.format(tmp=tmp_path)
    cfg = load_config(None, ['output.trackers=["mlflow"]', f'output.mlflow_uri="{uri}"'])
    with pytest.raises(ConfigError, match=r"^output.mlflow_uri = .* is invalid: ") as e:
        check_trackers(cfg)
    assert why in str(e.value) and "sqlite:///PATH.db" in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("uri", ["sqlite:///{tmp}/m.db", "http://localhost:5000", "databricks"])
def test_good_mlflow_uris_pass_without_a_connection(uri, tmp_path):
    uri = uri.format(tmp=tmp_path)
    check_trackers(load_config(None, ['output.trackers=["mlflow"]', f'output.mlflow_uri="{uri}"']))
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_and_mlflow_get_every_line_and_resume_continues(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(TRACKERS, "recorder", _Recorder)  # what `name = "recorder"` does
    cfg = load_config(None, [*TINY, 'output.trackers=["tensorboard", "mlflow", "recorder"]'])
    check_trackers(cfg)
    run_dir = tmp_path / "t"
    prepare_run_dir(cfg, run_dir)
    run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    lines = _metrics(run_dir)
    assert [m["round"] for m in lines] == [0, 1, 2, 3]

    calls = _Recorder.calls  # the interface's verbs, in order
    assert calls[0] == ("open", False, 0)
    logged = [c[1:] for c in calls if c[0] == "log"]
    assert logged == [(m["round"], m["sim_time_s"]) for m in lines]
    artifacts = {c[1] for c in calls if c[0] == "artifact"}
    assert artifacts == {"config.toml", "summary.json", "metrics.jsonl", "adapter"}
    assert calls[-1] == ("close", False) and not tracked_run._OPEN

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

    # a stored run id the store does not hold: refused at check time, naming the setting
    (run_dir / "mlflow_run.json").write_text(json.dumps(record | {"run_id": "0" * 32}))
    with pytest.raises(ConfigError, match=r"^output.mlflow_uri = .*names MLflow run '0000"):
        check_trackers(cfg, run_dir, resume=True)
    (run_dir / "mlflow.db").rename(run_dir / "moved.db")
    with pytest.raises(ConfigError, match=r"mlflow.db does not exist: point output.mlflow_uri"):
        check_trackers(cfg, run_dir, resume=True)


def test_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    cfg = load_config(None, [*TINY, "training.rounds=1", 'output.trackers=["mlflow"]'])
    run_dir = tmp_path / "m"
    with pytest.raises(ConfigError, match=r"fedlora\[tracking\]"):  # checked on the way in
        prepare_run_dir(cfg, run_dir)
    assert not run_dir.exists()  # refused before anything is written


def test_ctrl_c_in_round_0_leaves_the_mlflow_run_failed_at_exit(tmp_path, monkeypatch):
    """Round 0 runs before the round loop's clean-up: the run's trackers stay open, and what
    the process runs at exit (atexit: close_open_trackers) closes them as FAILED."""
    import atexit

    from mlflow.tracking import MlflowClient

    import fedlora.federation.engine as engine

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(engine, "_round_zero", interrupt)
    registered, register = [], atexit.register
    monkeypatch.setattr(atexit, "register", lambda f, *a: registered.append(f) or register(f, *a))
    monkeypatch.setattr(tracked_run, "_registered", [])
    cfg = load_config(None, [*TINY, "training.rounds=1", 'output.trackers=["mlflow"]'])
    run_dir = tmp_path / "r"
    prepare_run_dir(cfg, run_dir)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    assert tracked_run.close_open_trackers in registered and len(tracked_run._OPEN) == 1
    tracked_run.close_open_trackers()  # what the interpreter does at exit
    assert not tracked_run._OPEN
    record = json.loads((run_dir / "mlflow_run.json").read_text())
    run = MlflowClient(tracking_uri=record["tracking_uri"]).get_run(record["run_id"])
    assert run.info.status == "FAILED"


def test_sigterm_unwinds_the_run_and_leaves_the_mlflow_run_failed(tmp_path, monkeypatch):
    """SIGTERM during a round raises SystemExit(143) while trackers are open (the CLI exits
    143), the round loop's clean-up closes the MLflow run as FAILED, and the default SIGTERM
    action is back afterwards."""
    from mlflow.tracking import MlflowClient

    import fedlora.federation.engine as engine

    one_round = engine._one_round

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` or `timeout` would
        return one_round(*args, **kwargs)

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(engine, "_one_round", terminated)
    cfg = load_config(None, [*TINY, "training.rounds=2", 'output.trackers=["mlflow"]'])
    run_dir = tmp_path / "r"
    prepare_run_dir(cfg, run_dir)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(SystemExit) as e:
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    assert e.value.code == 143 and not tracked_run._OPEN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    record = json.loads((run_dir / "mlflow_run.json").read_text())
    run = MlflowClient(tracking_uri=record["tracking_uri"]).get_run(record["run_id"])
    assert run.info.status == "FAILED"
