"""Where a study stands (`study_planner.py status`): every pilot job and analysed run with its
state, rounds, simulated clock and metric curve read from its run directory, the learning
criterion of each finished pilot run, and what is still to run. It reads files only (run
directories and rule.json) and changes nothing, so it is safe beside running
runners; a parked or running run shows what it has written so far, no criterion applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedlora.federation.machine_log import MACHINE_FILE, describe_machines
from fedlora.federation.progress import ACCURACY_DROP
from fedlora.studies.runs import load_run
from research.study_planner import study_pilot
from research.study_planner.study_rule import Learning, Metric, learning, metric_points
from research.study_planner.study_runner import PILOT_DIR, RULE_FILE, finished
from research.study_planner.study_spec import StudySpec

FINISHED, PARTIAL, NOT_STARTED = "finished", "partial", "not started"


@dataclass(frozen=True)
class RunState:
    """One job of the study as its directory shows it now."""

    name: str  # relative to the study directory, e.g. pilot/fslora-x0.3-seed7
    step: float | None  # the step size the job runs at (the rule's step key); None: analysed
    state: str  # FINISHED, PARTIAL (started or parked) or NOT_STARTED
    rounds: int | None  # the last round written
    sim_time_s: float | None  # the simulated clock at that round
    values: tuple[float, ...]  # the metric at each evaluation, round 0 first
    criterion: Learning | None  # the pilot's learning criterion (finished pilot runs only)
    compute_s: float | None  # Σ compute_s of its rounds so far, every stretch (metrics.jsonl)
    client_steps: int | None = None  # Σ participants × training.local_steps so far
    train_loss: tuple[float, float] | None = None  # mean train loss, first and last tenth
    label: str = ""  # the arm (the pilot's label, or the analysed arm)
    stop_reason: str | None = None  # a finished run's summary.json stop_reason


def _tenths(losses: list[float]) -> tuple[float, float] | None:
    """The mean of the first and of the last tenth of `losses` (at least one value each)."""
    if not losses:
        return None
    n = max(1, len(losses) // 10)
    return sum(losses[:n]) / n, sum(losses[-n:]) / n


def _read(out: Path, run_dir: Path, spec: StudySpec, step: float | None, label: str) -> RunState:
    """One run directory as it stands; a finished pilot run (`step` given) with its learning
    criterion."""
    name = run_dir.relative_to(out).as_posix()
    if finished(run_dir):
        state = FINISHED
    elif (run_dir / "config.toml").is_file():
        state = PARTIAL
    else:
        state = NOT_STARTED
    if state == NOT_STARTED or not (run_dir / "metrics.jsonl").is_file():
        return RunState(name, step, state, None, None, (), None, None, label=label)
    run = load_run(run_dir)
    last = run.lines[-1] if run.lines else {}
    points = metric_points(run, spec.metric)
    criterion = None
    if state == FINISHED and step is not None:
        criterion = learning(
            points, spec.metric, spec.budget_s, spec.learn_min_gain, spec.learn_max_drop
        )
    # the work a run did: arms whose rounds are cheap in simulated time take many more
    # client-steps within B (a reason an arm can overfit its few clients' data)
    local_steps = (run.config.get("training") or {}).get("local_steps")
    steps = None
    if isinstance(local_steps, int):
        steps = local_steps * sum(int(x.get("n_participants") or 0) for x in run.lines)
    losses = [float(x["train_loss"]) for x in run.lines if x.get("train_loss") is not None]
    clock = last.get("sim_time_s")
    spent = sum(float(x.get("compute_s") or 0.0) for x in run.lines)
    stop = run.summary.stop_reason if state == FINISHED else None
    return RunState(
        name=name,
        step=step,
        state=state,
        rounds=last.get("round"),
        sim_time_s=None if clock is None else float(clock),
        values=tuple(v for _, v in points),
        criterion=criterion,
        compute_s=spent or None,
        client_steps=steps,
        train_loss=_tenths(losses),
        label=label,
        stop_reason=stop,
    )


def pilot_states(spec: StudySpec, out: Path) -> tuple[list[RunState], list[str], list[str]]:
    """(the pilot's known jobs in the runner's order, the arms whose step-size grid is not
    known yet because their run at the protocol's step has not finished, the pilot run
    directories that are no job of this config: arms an amendment took out)."""
    jobs, _ = study_pilot.pilot_jobs(spec, out, finished)
    rows = []
    for label, factor in jobs:
        run_dir = study_pilot.pilot_dir(out, label, factor, spec.pilot_seed)
        step = spec.step_value(spec.pilot_labels[label]) * factor
        rows.append(_read(out, run_dir, spec, step, label))
    pending = [
        label
        for label in spec.pilot_labels
        if spec.step_grid and not finished(study_pilot.pilot_dir(out, label, 1.0, spec.pilot_seed))
    ]
    known = {r.name for r in rows}
    pilot_root = out / PILOT_DIR
    others = sorted(
        d.relative_to(out).as_posix()
        for d in (pilot_root.iterdir() if pilot_root.is_dir() else ())
        if d.is_dir() and d.relative_to(out).as_posix() not in known
    )
    return rows, pending, others


def analysed_states(spec: StudySpec, out: Path) -> list[RunState]:
    """Every analysed run (each seed, each arm and fixed-best) as its directory stands: before
    rule.json too, where an arm whose own pilot has finished may have started its runs."""
    return [
        _read(out, out / f"{label}-seed{seed}", spec, None, label)
        for seed in spec.seeds
        for label in spec.labels
    ]


def early_arms_line(spec: StudySpec, out: Path) -> str:
    """Before rule.json: which arms may start their analysed runs now (`run --arms LABEL`:
    their own pilot has finished, so their step is known) and at which step factor."""
    ready = []
    for label in spec.arms:
        factor, _ = study_pilot.arm_factor(spec, out, label, finished)
        if factor is not None:
            ready.append(f"{label} (step x{factor:g})")
    return (
        f"{RULE_FILE} is not written yet: fixed-best's runs wait for it (every fixed rule's "
        "pilot). Arms whose own pilot has finished may start their runs now (`run --arms "
        f"LABEL`): {', '.join(ready) if ready else 'none yet'}."
    )


def compute_rates(rows: list[RunState], budget_s: float) -> dict[str, float]:
    """{arm: compute seconds per simulated second}, the mean over its runs past a tenth of B
    (`seconds_left`: earlier, round 0's evaluation weighs too much)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.compute_s and r.sim_time_s and r.sim_time_s >= budget_s / 10:
            by.setdefault(r.label, []).append(r.compute_s / r.sim_time_s)
    return {label: sum(v) / len(v) for label, v in by.items()}


def seconds_left(r: RunState, budget_s: float, rates: dict[str, float]) -> float | None:
    """The compute seconds `r` still needs to reach B: 0 when finished; a run past a tenth of
    B at its own rate times what is left of B, else at its arm's rate (`rates`, else its own);
    None: no rate yet. A run's first rounds carry round 0's evaluation, so a run just started
    would overstate its own rate. An estimate for planning sessions: compute_s is wall time
    and moves with the load."""
    if r.state == FINISHED:
        return 0.0
    clock = r.sim_time_s or 0.0
    own = r.compute_s / clock if r.compute_s and clock > 0 else None
    rate = own if own is not None and clock >= budget_s / 10 else rates.get(r.label, own)
    return None if rate is None else rate * max(0.0, budget_s - clock)


def work_left_line(
    spec: StudySpec, rows: list[RunState], pending: list[str], analysed: list[RunState] | None
) -> str:
    """One line: the compute hours the pilot and the analysed runs still need (estimated)."""
    rates = compute_rates([*rows, *(analysed or [])], spec.budget_s)
    fixed = [rates[lab] for lab in spec.fixed_rules if lab in rates]
    if fixed:  # fixed-best is one of the fixed rules: the dearest of them, until the rule
        rates.setdefault("fixed-best", max(fixed))
    if analysed is None:  # before rule.json: every analysed run, not started
        analysed = [
            RunState(f"{lab}-seed{seed}", None, NOT_STARTED, None, None, (), None, None, label=lab)
            for seed in spec.seeds
            for lab in spec.labels
        ]
    parts, unknown = [], []
    for what, group in (("pilot", rows), ("analysed runs", analysed)):
        left = [(r, seconds_left(r, spec.budget_s, rates)) for r in group]
        unknown += [r.name for r, s in left if s is None]
        todo = [s for r, s in left if s]
        parts.append(f"{what} {sum(todo) / 3600:.1f} h ({len(todo)} runs)")
    grid = len(spec.step_grid) * sum(rates.get(lab, 0.0) for lab in pending) * spec.budget_s
    line = (
        "Compute left, estimated (a run past a tenth of B at its own compute_s per simulated "
        "second, else at its arm's, times what is left of B; compute_s is wall time and moves "
        "with the load): " + "; ".join(parts)
    )
    if grid:
        line += f"; the step grids of arms not yet judged, if they fail: up to {grid / 3600:.1f} h"
    if unknown:
        line += f"; no rate yet for {len(unknown)} runs ({', '.join(unknown[:4])}"
        line += ", ...)" if len(unknown) > 4 else ")"
    if spec.grid_stops_at_drop:
        line += "; grid runs stop early where they fall (grid_stops_at_drop): at most this"
    return line + "."


def _scale(metric: Metric) -> tuple[float, str]:
    """Accuracies in percent (one decimal), losses as they are (three decimals)."""
    return (metric.scale, "{:.1f}" if metric.scale == 100.0 else "{:.3f}")


def _row(r: RunState, metric: Metric, with_step: bool) -> str:
    scale, fmt = _scale(metric)
    curve = ", ".join(fmt.format(v * scale) for v in r.values) or "-"
    rounds = "-" if r.rounds is None else str(r.rounds)
    clock = "-" if r.sim_time_s is None else f"{r.sim_time_s:.1f}"
    if r.criterion is None:
        verdict = "-"
    else:
        gain = fmt.format(r.criterion.gain_at_budget * scale)
        verdict = f"{'yes' if r.criterion.learned else 'no'} ({gain} at B)"
        if r.stop_reason == ACCURACY_DROP:  # a grid run stopped where it fell (amendment 5)
            verdict = f"no ({gain} at {r.sim_time_s:.0f} s: stopped at the drop)"
    cpu = "-" if r.compute_s is None else f"{r.compute_s:.0f}"
    work = "-" if r.client_steps is None else f"{r.client_steps:,}"
    loss = "-" if r.train_loss is None else f"{r.train_loss[0]:.2f} -> {r.train_loss[1]:.2f}"
    step = [f"{r.step:g}"] if with_step else []
    cells = [r.name, *step, r.state, rounds, work, loss, clock, curve, verdict, cpu]
    return "| " + " | ".join(cells) + " |"


def _missing(out: Path) -> str:
    return "is not a directory" if out.exists() else "does not exist"


def render_status(spec: StudySpec, out: Path) -> str:
    """The study's state as markdown (what `study_planner.py status` prints)."""
    rows, pending, others = pilot_states(spec, out)
    metric = spec.metric
    scale = _scale(metric)[0]
    unit, points = (" (%)", " points") if scale == 100.0 else ("", "")
    lines = [
        f"# {out}: {spec.source}",
        "",
        *(
            [f"{out} {_missing(out)}: nothing of this study has run there.", ""]
            if not out.is_dir()
            else []
        ),
        f"Metric {metric.text}{unit} at each evaluation (round 0 first); budget B = "
        f"{spec.budget_s:g} s of simulated time; pilot seed {spec.pilot_seed}. Learns: gain at "
        f"B >= {spec.learn_min_gain * scale:g}{points} and no evaluation more than "
        f"{spec.learn_max_drop * scale:g}{points} below round 0 (finished runs only). Train "
        "loss: the clients' mean over the first and the last tenth of the rounds so far.",
        "",
        "## Pilot",
        "",
        "| run | step | state | rounds | client-steps | train loss | clock (s) | curve | learns "
        "| compute s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_row(r, metric, with_step=True) for r in rows),
        "",
    ]
    done = sum(r.state == FINISHED for r in rows)
    lines.append(f"{done} of {len(rows)} known pilot jobs finished.")
    if pending:
        lines.append(
            "Step-size grid not known yet (its run at the protocol's step is unfinished): "
            + ", ".join(pending)
            + "."
        )
    if others:
        lines.append("Pilot directories that are no job of this config: " + ", ".join(others) + ".")
    analysed = analysed_states(spec, out)
    lines.append(work_left_line(spec, rows, pending, analysed))
    lines += ["", "## Analysed runs", ""]
    shown = analysed
    if not (out / RULE_FILE).is_file():
        lines.append(early_arms_line(spec, out))
        shown = [r for r in analysed if r.state != NOT_STARTED]
    if shown:
        lines += [
            "",
            "| run | state | rounds | client-steps | train loss | clock (s) | curve | learns "
            "| compute s |",
            "|---|---|---|---|---|---|---|---|---|",
            *(_row(r, metric, with_step=False) for r in shown),
            "",
            f"{sum(r.state == FINISHED for r in analysed)} of {len(analysed)} analysed runs "
            "finished.",
        ]
    lines += ["", *machines_lines(out, [*rows, *analysed])]
    return "\n".join(lines) + "\n"


def machines_lines(out: Path, rows: list[RunState]) -> list[str]:
    """The "Machines" section: which machine computed which rounds of each started run
    (machine.jsonl), and how many runs have no record (their stretches ran before fedlora
    wrote one); fp32 results agree across CPU kinds in their printed accuracies, not bits."""
    started = [r for r in rows if r.state != NOT_STARTED]
    described = [(r.name, describe_machines(out / r.name)) for r in started]
    recorded = [(name, text) for name, text in described if text]
    lines = ["## Machines", ""]
    lines += [f"- {name}: {text}" for name, text in recorded]
    unrecorded = len(started) - len(recorded)
    if unrecorded:
        lines.append(
            f"{'- ' if recorded else ''}{unrecorded} started run(s) have no {MACHINE_FILE}: "
            "every stretch of theirs ran before fedlora recorded machines."
        )
    return lines
