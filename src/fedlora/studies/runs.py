"""Finished runs as the reports read them: config.toml, metrics.jsonl and summary.json of each
run directory (and a suite's suite.toml for its labels and targets), and the curves of one run
(its accuracy or eval_loss against the simulated clock, the time it first reaches a target).

A run that never reaches a target is *censored*: its time is only known to be >= its last
`sim_time_s`, which is what `time_to_target` / `time_to_loss` then return with reached = False.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedlora.errors import ConfigError, DataError
from fedlora.federation.metrics_file import METRICS_FILE, read_metrics
from fedlora.federation.runfiles import (
    SUMMARY_FILE,
    RunSummary,
    read_run_text,
    read_summary,
    summary_from_dict,
)

MEAN_TASK = "mean"  # the mean over data.eval_tasks (metrics "eval_accuracy")
SUITE_FILE = "suite.toml"
REFERENCE = "fslora"  # the method the speed-ups are measured against (Table I)
NO_SUMMARY = summary_from_dict({}, "no summary.json")  # a run without one (unfinished)


@dataclass
class RunRecord:
    """One finished (or partial) run as read from its directory."""

    path: Path
    label: str
    method: str
    seed: int
    lines: list[dict[str, Any]]  # metrics.jsonl (`fedlora.federation.metrics_file.read_metrics`)
    summary: RunSummary = field(default=NO_SUMMARY)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def total_time_s(self) -> float:
        return float(self.lines[-1]["sim_time_s"]) if self.lines else 0.0

    @property
    def calibration_time_s(self) -> float:
        if self.lines:
            return float(self.lines[0].get("calibration_sim_time_s", 0.0) or 0.0)
        return 0.0

    def eval_points(self, task: str) -> list[tuple[float, float]]:
        """(sim_time_s, accuracy) of every evaluated line, in order."""
        points = []
        for line in self.lines:
            if task == MEAN_TASK:
                acc = line.get("eval_accuracy")
            else:
                acc = (line.get("eval") or {}).get(task)
            if acc is not None:
                points.append((float(line["sim_time_s"]), float(acc)))
        return points

    def loss_points(self) -> list[tuple[float, float]]:
        """(sim_time_s, mean eval_loss) of every evaluated line that logged one, in order."""
        return [
            (float(line["sim_time_s"]), float(line["eval_loss"]))
            for line in self.lines
            if line.get("eval_loss") is not None
        ]

    def last_eval_line(self) -> dict[str, Any] | None:
        """The last metrics line with an evaluation."""
        return next((line for line in reversed(self.lines) if line.get("eval")), None)

    def final_accuracy(self, task: str) -> float | None:
        points = self.eval_points(task)
        return points[-1][1] if points else None

    def tasks(self) -> list[str]:
        for line in self.lines:
            if line.get("eval"):
                return list(line["eval"])
        return []


def read_toml(path: Path) -> dict[str, Any]:
    """A run's config.toml; unreadable or invalid files raise `DataError` naming them."""
    try:
        return tomllib.loads(read_run_text(path, "config file"))
    except tomllib.TOMLDecodeError as e:
        raise DataError(f"config file {str(path)!r} is not valid TOML: {e}") from None


_SEED_SUFFIX = re.compile(r"^(?P<label>.+)-seed(?P<seed>\d+)$")


def load_run(run_dir: str | Path, label: str | None = None) -> RunRecord:
    """Read one run directory; the label defaults to the directory name without -seed<N>.

    A torn last metrics line is dropped with a warning on stderr; a metrics.jsonl without one
    complete line is a `DataError` naming it (unless summary.json records the run's error)."""
    path = Path(run_dir)
    metrics, summary_path = path / METRICS_FILE, path / SUMMARY_FILE
    if not metrics.is_file() and not summary_path.is_file():
        raise DataError(f"{str(path)!r} is not a fedlora run directory (no metrics.jsonl)")
    config: dict[str, Any] = {}
    if (path / "config.toml").is_file():
        config = read_toml(path / "config.toml")
    summary = read_summary(summary_path) if summary_path.is_file() else NO_SUMMARY
    try:
        method = summary.method or str(config.get("method", {}).get("name", "unknown"))
        seed = summary.seed if summary.seed is not None else config.get("training", {}).get("seed")
        seed = int(seed or 0)
    except (AttributeError, TypeError, ValueError):
        raise DataError(
            f"{str(path)!r}: summary.json / config.toml do not name the run's method and seed "
            "(damaged files?)"
        ) from None
    match = _SEED_SUFFIX.match(path.name)
    if label is None:
        label = match["label"] if match else method
    dropped: list[str] = []
    lines = read_metrics(metrics, warn=dropped.append) if metrics.is_file() else []
    if metrics.is_file() and not lines and summary.error is None:
        why = " (its one line is torn or not a metrics line)" if dropped else " (it is empty)"
        raise DataError(
            f"metrics file {str(metrics)!r} holds no complete round{why}: nothing to report "
            "for this run; resume it (fedlora run --resume) or leave it out"
        )
    for message in dropped:
        print(message, file=sys.stderr)
    _check_lines(metrics, lines)
    return RunRecord(path, label, method, seed, lines, summary, config)


_NUMBER_MAPS = ("eval", "eval_losses", "eval_acc_norm", "eval_mc_losses")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check_lines(metrics: Path, lines: list[dict[str, Any]]) -> None:
    """Every value a report reads is a number: `sim_time_s` (finite, on every line),
    `eval_accuracy`, `eval_loss` and the per-task maps (None allowed: not evaluated)."""
    for i, line in enumerate(lines, 1):
        where = f"metrics file {str(metrics)!r} line {i}"
        t = line.get("sim_time_s")
        if not _is_number(t) or abs(t) == float("inf"):
            raise DataError(f"{where}: sim_time_s = {str(t)[:200]!r} is invalid: a finite number")
        for key in ("eval_accuracy", "eval_loss"):
            if line.get(key) is not None and not _is_number(line[key]):
                raise DataError(f"{where}: {key} = {str(line[key])[:200]!r} is invalid: a number")
        for key in _NUMBER_MAPS:
            table = line.get(key)
            if table is None:
                continue
            bad = (
                [(k, v) for k, v in table.items() if v is not None and not _is_number(v)]
                if isinstance(table, dict)
                else [("", table)]
            )
            if bad:
                name = f"{key}.{bad[0][0]}" if bad[0][0] else key
                raise DataError(
                    f"{where}: {name} = {str(bad[0][1])[:200]!r} is invalid: "
                    + ("a number" if isinstance(table, dict) else "a table {task: number}")
                )


def read_suite(path: Path) -> dict[str, Any]:
    """A suite directory's suite.toml ({} if there is none), its report fields checked."""
    file = path / SUITE_FILE
    if not file.is_file():
        return {}
    try:
        suite = tomllib.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from None
    for key, lo, allowed in (
        ("targets", 0.0, "a table of task = accuracy in (0, 1]"),
        ("target_losses", 0.0, "a table of task = eval_loss > 0"),
    ):
        table = suite.get(key, {})
        ok = isinstance(table, dict) and all(
            _is_number(v) and v > lo and (key != "targets" or v <= 1) for v in table.values()
        )
        if not ok:
            raise ConfigError(f"{file}: {key} = {str(table)[:200]} is invalid: {allowed}")
    labels = suite.get("labels", [])
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise ConfigError(f"{file}: labels = {str(labels)[:200]} is invalid: a list of strings")
    for key in ("title", "command", "target_rule"):
        if key in suite and not isinstance(suite[key], str):
            raise ConfigError(f"{file}: {key} = {str(suite[key])[:200]} is invalid: a string")
    return suite


def collect_runs(paths: Sequence[str | Path]) -> tuple[list[RunRecord], dict[str, Any]]:
    """Runs from run directories and suite directories (every run dir inside a suite dir).

    Returns the runs and the merged suite settings (targets, labels, title, command)."""
    runs: list[RunRecord] = []
    suite: dict[str, Any] = {}
    for p in map(Path, paths):
        if not p.is_dir():
            raise DataError(f"{str(p)!r}: no such directory")
        if (p / METRICS_FILE).is_file() or (p / SUMMARY_FILE).is_file():
            runs.append(load_run(p))
            continue
        found = read_suite(p)
        for key, value in found.items():
            suite.setdefault(key, value)
        subdirs = sorted(
            d for d in p.iterdir() if (d / METRICS_FILE).is_file() or (d / SUMMARY_FILE).is_file()
        )
        if not subdirs:
            raise DataError(
                f"{str(p)!r} holds no run (no metrics.jsonl in it or in its subdirectories)"
            )
        runs.extend(load_run(d) for d in subdirs)
    return _named_by_directory(runs), suite


def _named_by_directory(runs: list[RunRecord]) -> list[RunRecord]:
    """A run directory without a -seed<N> suffix is labelled by its method; where two such
    runs would share a label and a seed (the same method in two settings: `lora-inf`,
    `lora-eps8`), each of them is labelled by its directory name instead."""
    unsuffixed = [r for r in runs if not _SEED_SUFFIX.match(r.path.name)]
    count: dict[tuple[str, int], int] = {}
    for r in unsuffixed:
        count[r.label, r.seed] = count.get((r.label, r.seed), 0) + 1
    clashing = {id(r) for r in unsuffixed if count[r.label, r.seed] > 1}
    return [replace(r, label=r.path.name) if id(r) in clashing else r for r in runs]


# ----------------------------------------------------------------------------- curves
# Two views of a run's curve: `RunRecord.eval_points` / `loss_points` (report.md's, where
# `MEAN_TASK` is the mean over the eval tasks) and `points` (the powered report's: one task,
# accuracy or eval_loss).


def _first_time(
    run: RunRecord, points: Sequence[tuple[float, float]], reached: Callable[[float], bool]
) -> tuple[float, bool]:
    """(time, True) of the first point whose value is `reached`, else (last clock, False)."""
    for time_s, value in points:
        if reached(value):
            return time_s, True
    return run.total_time_s, False


def time_to_target(run: RunRecord, task: str, target: float) -> tuple[float, bool]:
    """(time, reached): the first sim_time_s with accuracy >= target, or (total time, False)."""
    return _first_time(run, run.eval_points(task), lambda acc: acc >= target)


def time_to_loss(run: RunRecord, target: float) -> tuple[float, bool]:
    """(time, reached): the first sim_time_s with mean eval_loss <= target, or (total, False)."""
    return _first_time(run, run.loss_points(), lambda loss: loss <= target)


def points(run: RunRecord, task: str, metric: str) -> list[tuple[float, float]]:
    """(sim_time_s, value) of every evaluation of `task` (a task's name, `MEAN_TASK` is not
    special here); metric "accuracy" (metrics `eval`) or "loss" (`eval_losses`)."""
    key = "eval" if metric == "accuracy" else "eval_losses"
    out = []
    for line in run.lines:
        value = (line.get(key) or {}).get(task)
        if value is not None:
            out.append((float(line["sim_time_s"]), float(value)))
    return out


def level_at(run: RunRecord, task: str, metric: str, time_s: float) -> float | None:
    """The last evaluated value at or before `time_s` (the curve is a step function)."""
    value = None
    for t, v in points(run, task, metric):
        if t > time_s:
            break
        value = v
    return value


def time_to(run: RunRecord, task: str, metric: str, target: float) -> tuple[float, bool]:
    """(time, reached): first evaluation at/above an accuracy target or at/below a loss
    target; (last clock, False) when never (censored).

    metric "loss_drop": `target` is a decrease in nats from the run's own first evaluation
    (round 0: the untrained adapter on the run's eval questions, the same for every method of
    a seed), so that one target means the same on every seed's questions; a run without
    evaluations is censored at its clock.
    """
    if metric == "accuracy":
        return _first_time(run, points(run, task, metric), lambda v: v >= target)
    pts = points(run, task, "loss")
    if metric == "loss_drop":
        if not pts:
            return run.total_time_s, False
        target = pts[0][1] - target
    return _first_time(run, pts, lambda v: v <= target)


def final_value(run: RunRecord, task: str, metric: str) -> float | None:
    """The last evaluated value of `task` (None when never evaluated)."""
    pts = points(run, task, metric)
    return pts[-1][1] if pts else None


def flat_config(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config's nested tables as dotted keys: {"data": {"mc": {"task": "a"}}} ->
    {"data.mc.task": "a"} (what comparisons of two runs' configs key on)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def eval_constant(run: RunRecord, task: str, key: str) -> float | None:
    """A per-task constant of the eval set from the first line that logged it
    (eval_majority, eval_chance, eval_n)."""
    for line in run.lines:
        value = (line.get(key) or {}).get(task)
        if value is not None:
            return float(value)
    return None
