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

A tracker is one class: a subclass of `Tracker` registered with ``@register_tracker(name)``
(the registry idiom of methods and privacy mechanisms, `fedlora.config.registry`), or by
another package in the ``fedlora.trackers`` entry-point group; ``output.trackers`` accepts the
name. Its verbs: ``check`` (before anything is written: what ``open`` would fail on, as a
ConfigError naming the field), ``open``, ``log_metrics``, ``log_artifact``, ``close``.

A resumed run continues the same tracked run without duplicate steps: TensorBoard's writer
starts with ``purge_step`` = the first round logged again (readers drop the older events from
that step on); MLflow continues the stored run id and skips the steps it already holds (a
resumed run replays those rounds exactly, so the values are the same).

A run's open trackers, and their closing as FAILED on any exit but the end of the run, are
`fedlora.federation.tracked_run`'s.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.registry import Registry
from fedlora.config.toml_io import dump_toml
from fedlora.errors import ConfigError, FedloraError, cut, shown
from fedlora.federation.mlflow_store import (
    MLFLOW_RUN_FILE,
    check_store_uri,
    own_store,
    store_uri,
    stored_run,
)
from fedlora.files import atomic_write

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


class Tracker:
    """One experiment tracker, registered under its ``output.trackers`` name
    (`register_tracker`, which sets `name`)."""

    name: ClassVar[str] = ""

    @classmethod
    def check(cls, cfg: ExperimentConfig, run_dir: Path | None, resume: bool) -> None:
        """Refuse, before anything is written, what `open` would fail on (ConfigError)."""

    def open(self, cfg: ExperimentConfig, run_dir: Path, *, resume: bool, next_step: int) -> None:
        """Start (or with `resume` continue) the tracked run; `next_step`: the first round
        this process logs."""
        raise NotImplementedError

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def log_artifact(self, path: Path) -> None:
        """Keep a file or folder of the finished run (no-op for a tracker without artifacts)."""

    def close(self, *, failed: bool) -> None:
        raise NotImplementedError


def _name_the_class(name: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Tracker)):
        raise TypeError(f"@register_tracker({name!r}) needs a Tracker subclass, got {cls!r}")
    cls.name = name


TRACKER_GROUP = "fedlora.trackers"
TRACKER_REGISTRY: Registry[type[Tracker]] = Registry(
    "output.trackers",
    TRACKER_GROUP,
    kind="tracker",
    accepts=lambda obj: isinstance(obj, type) and issubclass(obj, Tracker),
    on_add=_name_the_class,
    sorted_names=False,  # as registered: the built-ins first
)
TRACKERS = TRACKER_REGISTRY.table  # output.trackers name -> the tracker's class (registered)
T = TypeVar("T", bound=type)


def register_tracker(name: str) -> Callable[[T], T]:
    """Class decorator: ``output.trackers`` accepts `name`, and runs the class."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a tracker name must be an identifier, got {name!r}")
    return TRACKER_REGISTRY.register(name)


def tracker_class(name: str) -> type[Tracker]:
    """The tracker registered as `name` (an entry point is loaded here); ConfigError if none."""
    return TRACKER_REGISTRY.get(name)


def _missing(tracker: str, module: str) -> ConfigError:
    return ConfigError(
        f"output.trackers includes {tracker!r}, but {module} is not installed: "
        "pip install 'fedlora[tracking]'"
    )


@register_tracker("tensorboard")
class TensorBoardTracker(Tracker):
    """Scalars to ``<run dir>/tensorboard`` (torch's SummaryWriter, tensorboard's format)."""

    @classmethod
    def check(cls, cfg: ExperimentConfig, run_dir: Path | None, resume: bool) -> None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None

    def open(self, cfg: ExperimentConfig, run_dir: Path, *, resume: bool, next_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        # purge_step: readers drop this directory's older events at steps >= next_step
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=next_step)
        if next_step == 0:
            self.writer.add_text("config", "```toml\n" + dump_toml(cfg) + "\n```", 0)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, *, failed: bool) -> None:
        self.writer.close()


@register_tracker("mlflow")
class MlflowTracker(Tracker):
    """One MLflow run per fedlora run (MlflowClient: no global active run)."""

    @classmethod
    def check(cls, cfg: ExperimentConfig, run_dir: Path | None, resume: bool) -> None:
        """The store's URI (its form: nothing is written), and on resume the stored run id
        (read from the store)."""
        try:
            import mlflow.tracking  # noqa: F401
        except ImportError:
            raise _missing("mlflow", "mlflow (or mlflow-skinny)") from None
        field, uri = store_uri(cfg)
        if uri:
            check_store_uri(field, uri)
        if resume and run_dir is not None:
            stored_run(field, uri or own_store(run_dir), run_dir)

    def open(self, cfg: ExperimentConfig, run_dir: Path, *, resume: bool, next_step: int) -> None:
        from mlflow.tracking import MlflowClient

        self.check(cfg, None, False)
        self.field, uri = store_uri(cfg)
        is_own = not uri
        self.uri = uri = uri or own_store(run_dir)
        stored = stored_run(self.field, uri, run_dir) if resume else None  # before any write
        with self._store():
            self.client = MlflowClient(tracking_uri=uri)
            if stored is not None:
                self.run_id = stored
                self.client.update_run(self.run_id, status="RUNNING")
                history = self.client.get_metric_history(self.run_id, "sim_time_s")
                self.last_step = max((m.step for m in history), default=-1)
                return
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            if exp is not None:
                exp_id = exp.experiment_id
            elif is_own:
                where = (run_dir / "mlflow-artifacts").resolve().as_uri()
                exp_id = self.client.create_experiment(EXPERIMENT, artifact_location=where)
            else:
                exp_id = self.client.create_experiment(EXPERIMENT)
            run = self.client.create_run(exp_id, run_name=run_dir.name)
            self.run_id, self.last_step = run.info.run_id, -1
            self._log_params(cfg)
        record = {"tracking_uri": uri, "run_id": self.run_id, "experiment_id": exp_id}
        atomic_write(run_dir / MLFLOW_RUN_FILE, (json.dumps(record, indent=2) + "\n").encode())

    @contextlib.contextmanager
    def _store(self) -> Iterator[None]:
        """The store's failures (an unreachable server, a locked database) as one line."""
        try:
            yield
        except FedloraError:
            raise
        except Exception as e:  # noqa: BLE001 - MLflow, SQLAlchemy, HTTP: all the store's
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"{self.field} = {shown(self.uri)}: the MLflow store failed "
                f"({type(e).__name__}: {cut(first)})"
            ) from None

    def _log_params(self, cfg: ExperimentConfig) -> None:
        from mlflow.entities import Param

        params = [
            Param(name, _param_text(value))
            for section, values in cfg.to_dict().items()
            for name, value in _flat(section, values)
        ]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last_step:  # already logged before the resume: same values
            return
        import time

        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, v, now_ms, step) for k, v in values.items()]
        with self._store():
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self.last_step = step

    def log_artifact(self, path: Path) -> None:
        with self._store():
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), path.name)
            else:
                self.client.log_artifact(self.run_id, str(path))

    def close(self, *, failed: bool) -> None:
        with self._store():
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _flat(prefix: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
    """A section's ``(section.key, value)`` pairs; a sub-table's keys as section.table.key."""
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        name = f"{prefix}.{key}"
        out.extend(_flat(name, value) if isinstance(value, dict) else [(name, value)])
    return out


def _param_text(value: Any) -> str:
    """A config value as an MLflow parameter: JSON (strings as they are), cut to MLflow's
    6000-character limit (a long per-client vector; config.toml is an artifact in full)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def check_trackers(
    cfg: ExperimentConfig, run_dir: Path | None = None, *, resume: bool = False
) -> None:
    """Every tracker of ``output.trackers`` as far as it can be checked before anything is
    written: its name, its package, its settings (``output.mlflow_uri``'s form), and with
    `resume` and `run_dir` the tracked run it continues. ConfigError naming the field."""
    check_tracker_names(cfg)
    for name in cfg.output.trackers:
        tracker_class(name).check(cfg, run_dir, resume)


def check_tracker_names(cfg: ExperimentConfig) -> None:
    """Each name of ``output.trackers`` is a registered tracker or an entry point of
    ``fedlora.trackers`` (ConfigError with a suggestion)."""
    for i, name in enumerate(cfg.output.trackers):
        if TRACKER_REGISTRY.find(name) is None:
            names = TRACKER_REGISTRY.names()
            close = difflib.get_close_matches(cut(name), list(names), n=1, cutoff=0.5)
            raise ConfigError(
                f"output.trackers[{i}] = {shown(name)} is invalid: allowed: "
                f"{', '.join(names)}" + (f" (did you mean {close[0]!r}?)" if close else "")
            )
