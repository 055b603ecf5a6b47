"""Tables and plots from finished runs: reads only config.toml, metrics.jsonl and summary.json
of each run directory (and a suite's suite.toml for its labels and target accuracies).

Time to target (Table I): the simulated wall-clock `sim_time_s` of the first metrics line
whose eval accuracy on the task is >= the task's target (line 0, the untrained adapter,
counts; for `proposed` its clock starts at the calibration's simulated time). A run that never
reaches the target is *censored*: its time is only known to be >= its last `sim_time_s`.
Means over seeds use those lower bounds and are then printed as ">= x"; the 95% interval is
the t interval over seeds (none for one seed or any censored seed). Speed-up over FSLoRA is
the ratio of the two means; it is a bound (">=" or "<=") when one side is censored and "n/a"
when both are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedlora.config import LoraConfig, NetworkConfig
from fedlora.errors import ConfigError, DataError, bad_value

MEAN_TASK = "mean"  # the mean over data.eval_tasks (metrics "eval_accuracy")
SUITE_FILE = "suite.toml"
REFERENCE = "fslora"


@dataclass
class RunRecord:
    """One finished (or partial) run as read from its directory."""

    path: Path
    label: str
    method: str
    seed: int
    lines: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
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


def _read_text(path: Path, what: str) -> str:
    """A run file's text; unreadable or non-UTF-8 files raise `DataError` naming them."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise DataError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start})") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(_read_text(path, "config file"))
    except tomllib.TOMLDecodeError as e:
        raise DataError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_read_text(path, "summary file"))
    except json.JSONDecodeError as e:
        raise DataError(f"summary file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DataError(f"summary file {str(path)!r} is not a JSON object")
    return data


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl; a torn last line (a run killed mid-write) is dropped."""
    lines = []
    text = _read_text(path, "metrics file").splitlines()
    for i, raw in enumerate(text):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            if i == len(text) - 1:
                break
            raise DataError(f"{path}: line {i + 1} is not JSON ({e.msg})") from None
        if not isinstance(line, dict) or "sim_time_s" not in line:
            raise DataError(f"{path}: line {i + 1} is not a fedlora metrics line (no sim_time_s)")
        lines.append(line)
    return lines


_SEED_SUFFIX = re.compile(r"^(?P<label>.+)-seed(?P<seed>\d+)$")


def load_run(run_dir: str | Path, label: str | None = None) -> RunRecord:
    """Read one run directory; the label defaults to the directory name without -seed<N>."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file() and not (path / "summary.json").is_file():
        raise DataError(f"{str(path)!r} is not a fedlora run directory (no metrics.jsonl)")
    config: dict[str, Any] = {}
    if (path / "config.toml").is_file():
        config = _read_toml(path / "config.toml")
    summary: dict[str, Any] = {}
    if (path / "summary.json").is_file():
        summary = _read_json_object(path / "summary.json")
    try:
        method = str(summary.get("method") or config.get("method", {}).get("name", "unknown"))
        seed = int(summary.get("seed", config.get("training", {}).get("seed", 0)) or 0)
    except (AttributeError, TypeError, ValueError):
        raise DataError(
            f"{str(path)!r}: summary.json / config.toml do not name the run's method and seed "
            "(damaged files?)"
        ) from None
    match = _SEED_SUFFIX.match(path.name)
    if label is None:
        label = match["label"] if match else method
    lines = read_metrics(metrics) if metrics.is_file() else []
    return RunRecord(path, label, method, seed, lines, summary, config)


# ----------------------------------------------------------------------------- statistics


def time_to_target(run: RunRecord, task: str, target: float) -> tuple[float, bool]:
    """(time, reached): the first sim_time_s with accuracy >= target, or (total time, False)."""
    for time_s, acc in run.eval_points(task):
        if acc >= target:
            return time_s, True
    return run.total_time_s, False


def time_to_loss(run: RunRecord, target: float) -> tuple[float, bool]:
    """(time, reached): the first sim_time_s with mean eval_loss <= target, or (total, False)."""
    for time_s, loss in run.loss_points():
        if loss <= target:
            return time_s, True
    return run.total_time_s, False


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: b, c are the discordant pairs (only run A right, only
    run B right); under H0 (equal accuracy) b ~ Binomial(b + c, 1/2)."""
    for name, v in (("b", b), ("c", c)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise DataError(f"{name} = {v!r} is invalid: a count >= 0")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


PREDICTIONS_FILE = "predictions.jsonl"


def read_predictions(run_dir: Path) -> dict[str, dict[str, Any]]:
    """task -> the predictions line of the run's last evaluation of that task ({} if the run
    wrote none)."""
    path = Path(run_dir) / PREDICTIONS_FILE
    last: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return last
    for i, raw in enumerate(path.read_text(encoding="utf-8").splitlines()):
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a torn line of a killed run
        if not isinstance(line, dict) or not {"round", "task", "ids", "correct"} <= set(line):
            raise DataError(f"{path}: line {i + 1} is not a fedlora predictions line")
        if line["task"] not in last or line["round"] >= last[line["task"]]["round"]:
            last[line["task"]] = line
    return last


@dataclass
class PairedTest:
    """McNemar's test of two runs' last evaluations on the questions they share."""

    task: str
    n: int  # paired questions
    both: int  # right in both runs
    a_only: int  # b: right only in run A
    b_only: int  # c: right only in run B
    neither: int
    p_value: float

    @property
    def accuracy_a(self) -> float:
        return (self.both + self.a_only) / self.n if self.n else math.nan

    @property
    def accuracy_b(self) -> float:
        return (self.both + self.b_only) / self.n if self.n else math.nan


def _keyed(line: dict[str, Any]) -> dict[tuple[str, int], int]:
    """(question id, occurrence) -> correct, so repeated questions pair in order."""
    seen: dict[str, int] = {}
    out = {}
    for qid, ok in zip(line["ids"], line["correct"]):
        k = seen.get(qid, 0)
        seen[qid] = k + 1
        out[(qid, k)] = int(ok)
    return out


def paired_tests(run_a: Path, run_b: Path) -> list[PairedTest]:
    """Per task both runs evaluated: McNemar on the questions of their last evaluations that
    both scored (matched by question id). A run without predictions.jsonl is an error."""
    pa, pb = read_predictions(run_a), read_predictions(run_b)
    for path, p in ((run_a, pa), (run_b, pb)):
        if not p:
            raise DataError(
                f"{str(path)!r} has no {PREDICTIONS_FILE} (runs from before issue 13 or with "
                "evaluation.predictions = false cannot be paired)"
            )
    tests = []
    for task in [t for t in pa if t in pb]:
        a, b = _keyed(pa[task]), _keyed(pb[task])
        common = [k for k in a if k in b]
        both = sum(1 for k in common if a[k] and b[k])
        a_only = sum(1 for k in common if a[k] and not b[k])
        b_only = sum(1 for k in common if b[k] and not a[k])
        neither = len(common) - both - a_only - b_only
        tests.append(
            PairedTest(task, len(common), both, a_only, b_only, neither, mcnemar_p(a_only, b_only))
        )
    return tests


def t_interval95(values: Sequence[float]) -> float | None:
    """Half-width of the 95% t interval of the mean; None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    from scipy.stats import t

    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return float(t.ppf(0.975, n - 1) * sd / math.sqrt(n))


@dataclass
class Cell:
    """Time to target of one (label, task) over seeds."""

    label: str
    task: str
    target: float
    times_s: list[float]
    reached: list[bool]
    final_accuracy: list[float]
    calibration_s: list[float]

    @property
    def censored(self) -> int:
        return sum(not r for r in self.reached)

    @property
    def mean_s(self) -> float:
        return sum(self.times_s) / len(self.times_s)

    @property
    def ci_s(self) -> float | None:
        return None if self.censored else t_interval95(self.times_s)


def summarize(
    runs: Sequence[RunRecord], targets: dict[str, float], order: Sequence[str] | None = None
) -> list[Cell]:
    """One `Cell` per (label, task) in label order (`order` first, then as found)."""
    labels: list[str] = list(order or [])
    for run in runs:
        if run.label not in labels:
            labels.append(run.label)
    cells = []
    for label in labels:
        group = [r for r in runs if r.label == label]
        if not group:
            continue
        for task, target in targets.items():
            results = [time_to_target(r, task, target) for r in group]
            finals = [r.final_accuracy(task) for r in group]
            cells.append(
                Cell(
                    label,
                    task,
                    target,
                    [t for t, _ in results],
                    [ok for _, ok in results],
                    [f for f in finals if f is not None],
                    [r.calibration_time_s for r in group],
                )
            )
    return cells


def speedup(cell: Cell, reference: Cell | None) -> str:
    """Reference mean / this mean, with the direction of a bound when censored."""
    if reference is None:
        return "n/a"
    if cell.censored and reference.censored:
        return "n/a"
    if cell.mean_s <= 0:  # reached before any simulated time passed
        return "n/a" if reference.mean_s <= 0 else "inf"
    ratio = reference.mean_s / cell.mean_s
    text = "inf" if math.isinf(ratio) else f"{ratio:.2f}x"
    if reference.censored:
        return ">= " + text
    if cell.censored:
        return "<= " + text
    return text


def _fmt_time(cell: Cell) -> str:
    text = f"{cell.mean_s:.1f}"
    if cell.censored:
        return f">= {text} ({cell.censored}/{len(cell.times_s)} not reached)"
    ci = cell.ci_s
    return text + (f" ± {ci:.1f}" if ci is not None else "")


def _fmt_acc(values: Sequence[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    ci = t_interval95(values)
    return f"{100 * mean:.1f}%" + (f" ± {100 * ci:.1f}" if ci is not None else "")


# ----------------------------------------------------------------------------- re-clocking


def _clients(path: Path) -> tuple[list[float], list[float]]:
    import csv

    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    return [float(r["tau_full_s"]) for r in rows], [float(r["t_full"]) for r in rows]


def _reclock_lines(
    lines: list[dict[str, Any]], config: dict[str, Any], clients: Path, cost: tuple[str, str, float],
    start_s: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """Round times recomputed from each line's participants and k under another cost model."""
    import numpy as np

    from fedlora.system.network import round_time

    net = config.get("network", {})
    # the downlink's broadcast time does not depend on the cost model: runs record it per
    # round (`downlink_s`); runs from before that record cannot be re-clocked with a downlink
    paid_downlink = float(net.get("downlink_rate_bps", 0.0)) > 0
    unrecorded = paid_downlink and any(
        x.get("round", 0) >= 1 and x.get("participants") and "downlink_s" not in x for x in lines
    )
    if net.get("fading", "none") != "none" or unrecorded:
        raise ConfigError(
            f"{clients.parent}: re-clocking needs network.fading = none and a free downlink "
            f"or one recorded per round (got fading = {net.get('fading')!r}, "
            f"downlink_rate_bps = {net.get('downlink_rate_bps')!r})"
        )
    # a key missing from an old run's config.toml had the config's default
    gamma = int(config.get("lora", {}).get("rank", LoraConfig.rank))
    f_tot = float(net.get("f_tot_hz", NetworkConfig.f_tot_hz))
    comm, comp, rho = cost
    tau_full, t_full = (np.asarray(x) for x in _clients(clients))
    out, clock = [], start_s
    for line in lines:
        line = dict(line)
        who = np.asarray(line.get("participants") or [], dtype=int)
        if line.get("round", 0) >= 1 and who.size:
            k = np.asarray(line["k"], dtype=float)
            # no payload bits recorded: exact = linear (a sketch's uplink ∝ k)
            line["round_time_s"] = round_time(
                tau_full[who], t_full[who], k, gamma,
                comm_cost=comm, comp_cost=comp, rho=rho, f_tot_hz=f_tot,
            )[0]  # fmt: skip
            line["round_time_s"] += float(line.get("downlink_s", 0.0)) if paid_downlink else 0.0
        elif line.get("round", 0) >= 1:
            line["round_time_s"] = 0.0
        clock += line.get("round_time_s", 0.0) if line.get("round", 0) >= 1 else 0.0
        line["sim_time_s"] = clock
        out.append(line)
    return out


def reclock(run: RunRecord, comm_cost: str, comp_cost: str, rho: float | None = None) -> RunRecord:
    """The run's clock under another cost model (PAPER_NOTES #4–#5), from its metrics lines
    (participants and k per round), its clients.csv (τ_n^γ, t_n^γ) and config.toml.

    Exact for every method whose training does not depend on the cost model: all baselines
    and fixed-q/k methods (their uplink is k_n(m+n) parameters, so `exact` = linear). For
    `proposed` the plan itself depends on the cost model, so a re-clocked `proposed` run is
    *its plan* timed under the other model (its calibration runs are re-clocked too), not
    what it would have planned there.
    """
    if comm_cost not in ("exact", "linear", "quadratic"):
        raise bad_value("--comm-cost", comm_cost, "allowed: exact, linear, quadratic")
    if comp_cost not in ("affine", "linear", "quadratic"):
        raise bad_value("--comp-cost", comp_cost, "allowed: affine, linear, quadratic")
    net = run.config.get("network", {})
    cost = (comm_cost, comp_cost, float(net.get("rho", NetworkConfig.rho) if rho is None else rho))
    start = 0.0
    calib = run.path / "calibration"
    if run.calibration_time_s > 0 and calib.is_dir():
        for sub in sorted(d for d in calib.iterdir() if (d / "metrics.jsonl").is_file()):
            sub_cfg = _read_toml(sub / "config.toml")
            lines = _reclock_lines(read_metrics(sub / "metrics.jsonl"), sub_cfg,
                                   sub / "clients.csv", cost, 0.0)  # fmt: skip
            start += lines[-1]["sim_time_s"] if lines else 0.0
    lines = _reclock_lines(run.lines, run.config, run.path / "clients.csv", cost, start)
    if lines:
        lines[0]["calibration_sim_time_s"] = start
    summary = dict(run.summary, sim_time_s=lines[-1]["sim_time_s"] if lines else 0.0)
    return RunRecord(run.path, run.label, run.method, run.seed, lines, summary, run.config)


# ----------------------------------------------------------------------------- output


def save_figure(fig: Any, path: Path, *, axes: Sequence[Any] = (), title: str = "") -> Path:
    """Turn off the unused `axes`, add the title, lay out and write `fig` to `path`; close it."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_runs(
    runs: Sequence[RunRecord], targets: dict[str, float], path: Path, title: str = ""
) -> Path:
    """Accuracy against simulated wall-clock (minutes, or seconds below 2 min), one panel per task, one colour per
    label (every seed drawn; the target as a dashed line). Written with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(targets)
    cols = min(2, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.0 * rows), squeeze=False)
    labels = list(dict.fromkeys(r.label for r in runs))
    longest_s = max((r.total_time_s for r in runs), default=0.0)
    unit, scale = ("min", 60.0) if longest_s >= 120 else ("s", 1.0)
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    for ax, task in zip(axes.flat, tasks):
        for label in labels:
            first = True
            for run in (r for r in runs if r.label == label):
                points = run.eval_points(task)
                if not points:
                    continue
                xs = [t / scale for t, _ in points]
                ys = [100 * a for _, a in points]
                ax.plot(xs, ys, marker=".", color=colors[label], label=label if first else None)
                first = False
                band = _wilson_band(run, task)
                if band:
                    bx, lo, hi = band
                    ax.fill_between(
                        [t / scale for t in bx], lo, hi, color=colors[label], alpha=0.12
                    )
        for key, style, name in (
            ("eval_majority", ":", "most-frequent label"),
            ("eval_chance", "-.", "chance"),
        ):
            value = _baseline(runs, task, key)
            if value is not None:
                ax.axhline(100 * value, color="black", linestyle=style, linewidth=1, label=name)
        ax.axhline(100 * targets[task], color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{task} (target {100 * targets[task]:.0f}%)")
        ax.set_xlabel(f"simulated wall-clock ({unit})")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, axes=list(axes.flat)[len(tasks) :], title=title)


def _wilson_band(run: RunRecord, task: str) -> tuple[list[float], list[float], list[float]]:
    """(times, lower %, upper %) of the run's logged 95% Wilson intervals of `task`."""
    xs, lo, hi = [], [], []
    for line in run.lines:
        ci = (line.get("eval_ci95") or {}).get(task)
        if ci is not None and line.get("eval"):
            xs.append(float(line["sim_time_s"]))
            lo.append(100 * ci[0])
            hi.append(100 * ci[1])
    return (xs, lo, hi) if xs else ()


def _baseline(runs: Sequence[RunRecord], task: str, key: str) -> float | None:
    """The mean over runs of a per-task constant of the eval set (majority or chance score);
    the mean eval task's is the mean over tasks."""
    values = []
    for run in runs:
        line = next((x for x in run.lines if x.get(key)), None)
        if line is None:
            continue
        per_task = line[key]
        if task == MEAN_TASK:
            values.append(sum(per_task.values()) / len(per_task))
        elif task in per_task:
            values.append(float(per_task[task]))
    return sum(values) / len(values) if values else None


def plot_losses(
    runs: Sequence[RunRecord], path: Path, target_loss: float | None = None, title: str = ""
) -> Path | None:
    """Mean eval_loss against simulated wall-clock, one colour per label; None (nothing
    written) when no run logged eval_loss."""
    if not any(r.loss_points() for r in runs):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r.label for r in runs))
    longest_s = max((r.total_time_s for r in runs), default=0.0)
    unit, scale = ("min", 60.0) if longest_s >= 120 else ("s", 1.0)
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for i, label in enumerate(labels):
        first = True
        for run in (r for r in runs if r.label == label):
            points = run.loss_points()
            if points:
                ax.plot(
                    [t / scale for t, _ in points],
                    [v for _, v in points],
                    marker=".",
                    color=plt.cm.tab10(i % 10),
                    label=label if first else None,
                )
                first = False
    if target_loss:
        ax.axhline(target_loss, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel(f"simulated wall-clock ({unit})")
    ax.set_ylabel("eval_loss (NLL of the answer tokens)")
    ax.set_title(title or "held-out loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _loss_sections(runs: Sequence[RunRecord], labels: list[str], target_loss: float) -> list[str]:
    out = ["", f"## Time to eval_loss <= {target_loss:g} (s)", ""]
    out += [
        "The first simulated time at which the mean eval_loss over the eval tasks is <= the "
        "target (`>=`: not reached by some seed, a lower bound).",
        "",
        "| method | time (s) | final eval_loss |",
        "|---|---|---|",
    ]
    for label in labels:
        group = [r for r in runs if r.label == label]
        results = [time_to_loss(r, target_loss) for r in group]
        finals = [r.loss_points()[-1][1] for r in group if r.loss_points()]
        cell = Cell(
            label,
            "eval_loss",
            target_loss,
            [t for t, _ in results],
            [ok for _, ok in results],
            finals,
            [r.calibration_time_s for r in group],
        )
        ci = t_interval95(finals)
        final = "-" if not finals else f"{sum(finals) / len(finals):.4f}"
        out.append(
            f"| {label} | {_fmt_time(cell)} | {final}{'' if ci is None else f' ± {ci:.4f}'} |"
        )
    return out


def _baseline_section(runs: Sequence[RunRecord], labels: list[str]) -> list[str]:
    rows = []
    for label in labels:
        for r in sorted((r for r in runs if r.label == label), key=lambda r: r.seed):
            line = r.last_eval_line()
            if line is None or not line.get("eval_ci95"):
                continue
            for task, acc in line["eval"].items():
                lo, hi = line["eval_ci95"][task]
                loss = (line.get("eval_losses") or {}).get(task)
                rows.append(
                    f"| {label} | {r.seed} | {task} | {line.get('round', '-')} | "
                    f"{100 * acc:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
                    f"{100 * line['eval_majority'][task]:.1f}% | "
                    f"{100 * line['eval_chance'][task]:.1f}% | "
                    f"{'-' if loss is None else f'{loss:.4f}'} | {line['eval_n'][task]} |"
                )
    if not rows:
        return []
    return [
        "",
        "## Last evaluation against the baselines",
        "",
        "Accuracy with its 95% Wilson interval beside the score of always answering the most "
        "frequent label of the same questions and chance: an accuracy shows learning only "
        "when its interval lies above both.",
        "",
        "| method | seed | task | round | accuracy [95%] | most-frequent label | chance | "
        "eval_loss | n |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _mcnemar_section(runs: Sequence[RunRecord], labels: list[str]) -> list[str]:
    """Two runs: that pair. More: every two runs of the same seed (the same eval subset) and
    different labels."""
    ordered = [r for label in labels for r in runs if r.label == label]
    if len(ordered) == 2:
        pairs = [(ordered[0], ordered[1])]
    else:
        pairs = [
            (a, b)
            for i, a in enumerate(ordered)
            for b in ordered[i + 1 :]
            if a.seed == b.seed and a.label != b.label
        ]
    unique = len({r.label for r in ordered}) == len(ordered)

    def name(r: RunRecord) -> str:
        return r.label if unique else f"{r.path.parent.name}/{r.path.name}"

    rows = []
    for a, b in pairs:
        if not read_predictions(a.path) or not read_predictions(b.path):
            continue
        for t in paired_tests(a.path, b.path):
            rows.append(
                f"| {name(a)} | {name(b)} | {t.task} | {t.n} | {t.both} | {t.a_only} | "
                f"{t.b_only} | {t.neither} | {100 * t.accuracy_a:.1f}% | "
                f"{100 * t.accuracy_b:.1f}% | {t.p_value:.4g} |"
            )
    out = ["", "## Paired test (McNemar)", ""]
    if not rows:
        return out + ["No pair of runs (of the same seed) wrote predictions.jsonl.", ""]
    return out + [
        "Last evaluation of each run, on the questions both scored (matched by question id). "
        "A only / B only: the discordant questions; p: exact two-sided McNemar (binomial on "
        "the discordant pairs).",
        "",
        "| run A | run B | task | n | both right | A only | B only | neither | "
        "accuracy A | accuracy B | p |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def render_markdown(
    runs: Sequence[RunRecord],
    targets: dict[str, float],
    *,
    title: str = "fedlora report",
    order: Sequence[str] | None = None,
    command: str = "",
    plot_name: str = "accuracy_vs_time.png",
    note: str = "",
    target_loss: float | None = None,
    mcnemar: bool = False,
) -> str:
    """report.md: time to target per label and task, final accuracy, speed-up over FSLoRA.

    Runs without metrics lines (failed before round 0) are listed under "Failed runs"."""
    failed = [r for r in runs if r.summary.get("error")]
    runs = [r for r in runs if r.lines]
    cells = summarize(runs, targets, order)
    seeds = sorted({r.seed for r in runs})
    out = [f"# {title}", ""]
    if command:
        out += ["Produced by:", "", "```", command, "```", ""]
    out += [
        f"Runs: {len(runs)} ({len({r.label for r in runs})} methods, seeds {seeds}). "
        "Times are simulated wall-clock seconds (`sim_time_s`); mean ± 95% t interval over "
        "seeds. `>=`: some seed never reached the target (its time is its last clock, a lower "
        "bound). `proposed` includes its calibration runs' simulated time.",
        "",
        *([note, ""] if note else []),
        "## Time to target accuracy (s)",
        "",
    ]
    tasks = list(targets)
    header = "| method | " + " | ".join(f"{t} (>= {100 * targets[t]:.0f}%)" for t in tasks) + " |"
    out += [header, "|---" * (len(tasks) + 1) + "|"]
    labels = list(dict.fromkeys(c.label for c in cells))
    by = {(c.label, c.task): c for c in cells}
    for label in labels:
        out.append(f"| {label} | " + " | ".join(_fmt_time(by[label, t]) for t in tasks) + " |")
    ref_label = next((lab for lab in labels if lab == REFERENCE), None)
    if ref_label is None:
        ref_label = next(
            (r.label for r in runs if r.method == REFERENCE and r.label in labels), None
        )
    if ref_label:
        out += ["", f"## Speed-up over {ref_label} (its mean time / the method's)", ""]
        out += ["| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        for label in labels:
            row = [speedup(by[label, t], by.get((ref_label, t))) for t in tasks]
            out.append(f"| {label} | " + " | ".join(row) + " |")
    calibrated = [lab for lab in labels if any(by[lab, t].calibration_s[0] > 0 for t in tasks)]
    if calibrated:
        out += ["", "## Time to target without the calibration runs (s)", ""]
        out += [
            "The same times minus the calibration's simulated time (as if the constants A–D "
            "were known beforehand)"
            + (f"; speed-up over {ref_label} in brackets." if ref_label else "."),
            "",
            "| method | " + " | ".join(tasks) + " |",
            "|---" * (len(tasks) + 1) + "|",
        ]
        for label in calibrated:
            row = []
            for t in tasks:
                c = by[label, t]
                bare = dataclasses.replace(
                    c, times_s=[x - s for x, s in zip(c.times_s, c.calibration_s)]
                )
                ref = by.get((ref_label, t)) if ref_label else None
                row.append(_fmt_time(bare) + (f" [{speedup(bare, ref)}]" if ref_label else ""))
            out.append(f"| {label} | " + " | ".join(row) + " |")
    out += ["", "## Final accuracy", ""]
    out += ["| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for label in labels:
        out.append(
            f"| {label} | "
            + " | ".join(_fmt_acc(by[label, t].final_accuracy) for t in tasks)
            + " |"  # fmt: skip
        )
    out += ["", "## Runs", ""]
    out += [
        "| method | seed | rounds | simulated time (s) | of which calibration (s) | "
        "uplink (MB) | empty rounds | stop | compute (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        for r in sorted((r for r in runs if r.label == label), key=lambda r: r.seed):
            s = r.summary
            mb = s.get("total_uplink_bits")
            out.append(
                f"| {label} | {r.seed} | {r.lines[-1].get('round', '-') if r.lines else '-'} | "
                f"{r.total_time_s:.1f} | {r.calibration_time_s:.1f} | "
                f"{'-' if mb is None else f'{mb / 8e6:.1f}'} | {s.get('empty_rounds', '-')} | "
                f"{s.get('stop_reason', s.get('error', 'unfinished'))} | "
                f"{s.get('compute_s', 0.0):.0f} |"
            )
    out += _baseline_section(runs, labels)
    if target_loss:
        out += _loss_sections(runs, labels, target_loss)
    if mcnemar:
        out += _mcnemar_section(runs, labels)
    if failed:
        out += ["", "## Failed runs", ""]
        out += [f"- {r.label} seed {r.seed}: {r.summary['error']}" for r in failed]
    out += ["", f"![accuracy against simulated wall-clock]({plot_name})", ""]
    if any(r.loss_points() for r in runs):
        out += ["![eval_loss against simulated wall-clock](eval_loss_vs_time.png)", ""]
    return "\n".join(out)


def read_suite(path: Path) -> dict[str, Any]:
    """A suite directory's suite.toml ({} if there is none)."""
    file = path / SUITE_FILE
    if not file.is_file():
        return {}
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from None


def collect_runs(paths: Sequence[str | Path]) -> tuple[list[RunRecord], dict[str, Any]]:
    """Runs from run directories and suite directories (every run dir inside a suite dir).

    Returns the runs and the merged suite settings (targets, labels, title, command)."""
    runs: list[RunRecord] = []
    suite: dict[str, Any] = {}
    for p in map(Path, paths):
        if not p.is_dir():
            raise DataError(f"{str(p)!r}: no such directory")
        if (p / "metrics.jsonl").is_file() or (p / "summary.json").is_file():
            runs.append(load_run(p))
            continue
        found = read_suite(p)
        for key, value in found.items():
            suite.setdefault(key, value)
        subdirs = sorted(
            d
            for d in p.iterdir()
            if (d / "metrics.jsonl").is_file() or (d / "summary.json").is_file()
        )
        if not subdirs:
            raise DataError(
                f"{str(p)!r} holds no run (no metrics.jsonl in it or in its subdirectories)"
            )
        runs.extend(load_run(d) for d in subdirs)
    return runs, suite


def write_report(
    runs: Sequence[RunRecord],
    targets: dict[str, float],
    out_dir: str | Path,
    *,
    title: str = "fedlora report",
    order: Sequence[str] | None = None,
    command: str = "",
    note: str = "",
    target_loss: float | None = None,
    mcnemar: bool = False,
) -> Path:
    """Write report.md, accuracy_vs_time.png (and eval_loss_vs_time.png when the runs logged
    eval_loss) into `out_dir`; returns the report's path. `target_loss`: add the time to a
    mean eval_loss; `mcnemar`: add the paired test of every two runs of the same seed."""
    if not runs:
        raise DataError("no runs to report")
    if not any(r.lines for r in runs):
        raise DataError("no run has metrics yet: " + ", ".join(str(r.path) for r in runs))
    if not targets:
        raise ConfigError(
            "no target accuracy: give --target TASK=ACCURACY (e.g. arc-e=0.5) or report a "
            "suite directory whose suite.toml has [targets]"
        )
    for task, value in targets.items():
        if not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ConfigError(f"target {task} = {value!r} is invalid: an accuracy in (0, 1]")
    out = Path(out_dir)
    if target_loss is not None and not (
        isinstance(target_loss, (int, float)) and math.isfinite(target_loss) and target_loss > 0
    ):
        raise bad_value("--target-loss", target_loss, "an eval_loss > 0")
    try:
        out.mkdir(parents=True, exist_ok=True)
        plot_runs([r for r in runs if r.lines], targets, out / "accuracy_vs_time.png", title)
        plot_losses([r for r in runs if r.lines], out / "eval_loss_vs_time.png", target_loss, title)
        text = render_markdown(
            runs,
            targets,
            title=title,
            order=order,
            command=command,
            note=note,
            target_loss=target_loss,
            mcnemar=mcnemar,
        )
        (out / "report.md").write_text(text, encoding="utf-8")
    except OSError as e:
        where = f" {e.filename!r}" if e.filename else ""
        raise ConfigError(f"--out {str(out)!r}: cannot write{where}: {e.strerror or e}") from None
    return out / "report.md"
