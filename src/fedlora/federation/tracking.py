"""Experiment trackers (`output.trackers`): every metrics line of a run also goes to
TensorBoard event files and/or an MLflow run, as OpenFedLLM / NVIDIA FLARE users expect.

    [output]
    trackers = ["tensorboard", "mlflow"]   # pip install 'fedlora[tracking]'
    mlflow_uri = ""                        # "" = $MLFLOW_TRACKING_URI, else the run's own store

- **tensorboard**: event files in ``<run dir>/tensorboard`` (``tensorboard --logdir runs``),
  one scalar per numeric field of a metrics line at step = round; the resolved config as text.
- **mlflow**: one MLflow run; the store is ``output.mlflow_uri``, else $MLFLOW_TRACKING_URI,
  else ``sqlite:///<run dir>/mlflow.db`` with artifacts in ``<run dir>/mlflow-artifacts``
  (``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db``). The resolved config are
  its parameters (``section.key``), the metrics lines its metrics (step = round), and at the
  end config.toml, summary.json, metrics.jsonl, report.md (if any) and the PEFT adapter its
  artifacts. Its id is kept in ``<run dir>/mlflow_run.json``.

A resumed run continues the same tracked run without duplicate steps: TensorBoard's writer
starts with ``purge_step`` = the first round logged again (readers drop the older events from
that step on); MLflow continues the stored run id and skips the steps it already holds (a
resumed run replays those rounds exactly, so the values are the same).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.toml_io import dump_toml
from fedlora.errors import ConfigError

MLFLOW_RUN_FILE = "mlflow_run.json"
EXPERIMENT = "fedlora"


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a metrics line; nested dicts as ``key/sub`` (eval/arc-e).
    Lists, strings, booleans and None are left out."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if isinstance(value, dict):
            for sub, v in scalars(value).items():
                out[f"{key}/{sub}"] = v
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(float(value)):
                out[key] = float(value)
    return out


def _missing(tracker: str, module: str) -> ConfigError:
    return ConfigError(
        f"output.trackers includes {tracker!r}, but {module} is not installed: "
        "pip install 'fedlora[tracking]'"
    )


class TensorBoardTracker:
    """Scalars to ``<run dir>/tensorboard`` (torch's SummaryWriter, tensorboard's format)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, next_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        # purge_step: readers drop this directory's older events at steps >= next_step
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=next_step)
        if next_step == 0:
            self.writer.add_text("config", "```toml\n" + dump_toml(cfg) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, run_dir: Path, failed: bool) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run per fedlora run (MlflowClient: no global active run)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, resume: bool) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow (or mlflow-skinny)") from None
        uri = cfg.output.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        own_store = not uri
        if own_store:
            uri = "sqlite:///" + str((run_dir / "mlflow.db").resolve())
        self.client = MlflowClient(tracking_uri=uri)
        stored = _read_run_file(run_dir) if resume else None
        if stored is not None and stored.get("tracking_uri") == uri:
            self.run_id = str(stored["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
            history = self.client.get_metric_history(self.run_id, "sim_time_s")
            self.last_step = max((m.step for m in history), default=-1)
        else:
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            if exp is not None:
                exp_id = exp.experiment_id
            elif own_store:
                where = (run_dir / "mlflow-artifacts").resolve().as_uri()
                exp_id = self.client.create_experiment(EXPERIMENT, artifact_location=where)
            else:
                exp_id = self.client.create_experiment(EXPERIMENT)
            run = self.client.create_run(exp_id, run_name=run_dir.name)
            self.run_id, self.last_step = run.info.run_id, -1
            self._log_params(cfg)
            record = {"tracking_uri": uri, "run_id": self.run_id, "experiment_id": exp_id}
            (run_dir / MLFLOW_RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")

    def _log_params(self, cfg: ExperimentConfig) -> None:
        from mlflow.entities import Param

        params = [
            Param(f"{section}.{key}", _param_text(value))
            for section, values in cfg.to_dict().items()
            for key, value in values.items()
        ]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last_step:  # already logged before the resume: same values
            return
        import time

        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, v, now_ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self.last_step = step

    def finish(self, run_dir: Path, failed: bool) -> None:
        if not failed:
            for name in ("config.toml", "summary.json", "metrics.jsonl", "report.md"):
                if (run_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(run_dir / name))
            if (run_dir / "adapter").is_dir():
                self.client.log_artifacts(self.run_id, str(run_dir / "adapter"), "adapter")
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _param_text(value: Any) -> str:
    """A config value as an MLflow parameter: JSON (strings as they are), cut to MLflow's
    6000-character limit (a long per-client vector; config.toml is an artifact in full)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def _read_run_file(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / MLFLOW_RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


class Trackers:
    """The run's trackers (none: every call does nothing)."""

    def __init__(self, trackers: list[Any]) -> None:
        self.trackers = trackers

    def log(self, line: dict[str, Any]) -> None:
        """One metrics line, at step = its round."""
        if self.trackers:
            values = scalars(line)
            for t in self.trackers:
                t.log(int(line["round"]), values)

    def finish(self, run_dir: Path, *, failed: bool = False) -> None:
        """Close every tracker (after summary.json and the adapter were written)."""
        for t in self.trackers:
            t.finish(run_dir, failed)
        self.trackers = []


def open_trackers(
    cfg: ExperimentConfig, run_dir: Path, *, resume: bool, next_step: int
) -> Trackers:
    """The trackers of `output.trackers`; `next_step`: the first round this process logs."""
    trackers: list[Any] = []
    for name in cfg.output.trackers:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(cfg, run_dir, next_step))
        elif name == "mlflow":
            trackers.append(MlflowTracker(cfg, run_dir, resume))
    return Trackers(trackers)
