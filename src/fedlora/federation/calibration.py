"""Algorithm 2 on real training: the calibration runs of a `proposed` run and its plan, a
step the run's entry (`fedlora.federation.run.run`) calls before the first round
(`prepare_proposed`). In-run (the default) nothing runs first: the run calibrates itself
(`proposed`'s round hooks, `fedlora.federation.methods.proposed_replan`). With
`planner.calibration = "separate"` `prepare_proposed`

1. runs four calibration runs of Algorithm 1 (`sketched`) with `run_one` (the entry's
   in-process run, injected: this module imports no engine and no entry), with the same
   seed (so the same data partition and client profiles) and every client alike within a run:
   (q, k) ∈ {0.3, 0.15} × {γ, ⌈γ/4⌉} (`calibration_settings`; two k's so that D is
   identifiable: docs/paper.md, row 3). Each stops at the first round R_i whose smoothed training
   loss is <= F_s, or after `planner.calibration_rounds` rounds;
2. estimates A–D from the observations (q_i, k_i, R_i) (`fedlora.system.planner.estimate_constants`);
3. plans (q*, k*) for the run's client profiles (a_n, τ_n^γ, t_n^γ from the calibration's
   clients.csv, f_tot and the cost models of [network]; `fedlora.federation.calibration_plan`)
   with `fedlora.system.planner`
   (`planner.optimize`: both, q only with k from `method.k`, k only with q from `method.q`);
4. writes `plan.json` (constants, plan, calibration observations, F_s, simulated time) in the
   run directory for the user and returns the plan as a value (`Plan`), which the entry
   hands to the engine (`run_in_process(plan=...)`). A resumed run reads plan.json back.

The calibration rounds' simulated time starts the main run's clock (the engine adds it) and is
reported separately as `calibration_sim_time_s` in metrics line 0 and summary.json.

Calibration loss (decided before any result was seen; planner.calibration_loss = 0 = "auto"):
F_s = f · L_0 (f = planner.calibration_loss_fraction, 0.5 by default), with L_0 the training
loss of the first round with participants of the first calibration run (mean over its
participants and H local steps). The loss a round reports is smoothed as the trailing mean
over the last `SMOOTHING_ROUNDS` rounds that had participants. Every calibration run goes on
until it reaches F_s or the cap `planner.calibration_rounds`; a finished run that stopped at a
lower cap is *continued* (from its last checkpoint) when the cap is raised and no plan.json
exists yet, so a calibration is extended rather than redone. If a run still ends at the cap
without reaching F_s, every run's R_i is re-read from its recorded losses at F_s' = the
highest of the runs' lowest smoothed losses (the lowest level every run reached); plan.json
records F_s, F_s', the rule and which runs reached F_s.

What plan.json reports beside the plan, to judge whether Algorithm 2 had a fair chance:
`fit` (per calibration run: observed and predicted rounds to F_s', relative error, the row
residual of Eq. 21; `fedlora.system.planner.calibration_fit`), `degeneracy` (all k_n = 1 or every
q_n at a bound; `fedlora.system.planner.plan_degeneracy`). After the main run, `plan_outcome`
compares the plan's predicted rounds to F_s' with the rounds the run took (its smoothed
training loss, the same rule as the calibration); the entry puts it into summary.json.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.toml_io import dump_toml
from fedlora.errors import ConfigError
from fedlora.federation.calibration_plan import client_arrays, plan_from_calibration
from fedlora.federation.methods.proposed import Plan, plan_file
from fedlora.federation.methods.proposed_replan import outcome, probe_settings
from fedlora.federation.metrics_file import METRICS_FILE, read_metrics
from fedlora.federation.rundir import write_run_dir
from fedlora.federation.runfiles import CLIENTS_FILE, PLAN_FILE, read_clients, read_plan, write_plan
from fedlora.files import atomic_write, remove_own_file

AUTO_LOSS_FRACTION = 0.5
SMOOTHING_ROUNDS = 3
CALIBRATION_EVAL_LIMIT = 8  # calibration runs decide on the training loss; eval is not used


class RunOne(Protocol):
    """Runs (or resumes) one calibration run in `run_dir`, calling `stop(line)` after every
    round (True ends it), and writes its metrics.jsonl, clients.csv and summary.json: the
    entry's in-process run (`fedlora.federation.run`), a stand-in in the tests."""

    def __call__(
        self,
        cfg: ExperimentConfig,
        run_dir: Path,
        *,
        resume: bool,
        stop: Callable[[dict[str, Any]], bool],
    ) -> Any: ...


def calibration_settings(gamma: int) -> list[tuple[float, int]]:
    """The four (q, k) pairs of the calibration runs: {0.3, 0.15} × {γ, ⌈γ/4⌉}, the same as
    the in-run probes (`fedlora.federation.methods.proposed_replan.probe_settings`).

    With γ < 4 the second k is still distinct from γ (k = 1 for γ in 2..4); γ = 1 has a
    single sketch size and cannot identify D.
    """
    return probe_settings(gamma)


def smoothed_losses(losses: Sequence[float | None], window: int = SMOOTHING_ROUNDS) -> list:
    """Trailing mean of the last `window` non-empty rounds' losses, one value per round.

    A round without participants (None) repeats the previous value (None before the first).
    """
    out: list[float | None] = []
    seen: list[float] = []
    for loss in losses:
        if loss is not None:
            seen.append(float(loss))
        out.append(float(np.mean(seen[-window:])) if seen else None)
    return out


def rounds_to_loss(
    losses: Sequence[float | None], target: float, window: int = SMOOTHING_ROUNDS
) -> int | None:
    """R: the first round (1-based) whose smoothed loss is <= target; None if never."""
    for i, value in enumerate(smoothed_losses(losses, window)):
        if value is not None and value <= target:
            return i + 1
    return None


def auto_calibration_loss(first_loss: float, fraction: float = AUTO_LOSS_FRACTION) -> float:
    """F_s = fraction · L_0 (planner.calibration_loss_fraction; see the module docstring)."""
    return fraction * float(first_loss)


def _read_losses(metrics_path: Path) -> tuple[list[float | None], float]:
    """Per-round training losses (rounds 1..) and the last simulated time of a run."""
    losses: list[float | None] = []
    sim_time_s = 0.0
    for line in read_metrics(metrics_path, warn=None):  # the run directory's one rule
        sim_time_s = float(line.get("sim_time_s", sim_time_s))
        if line.get("round", 0) >= 1:
            losses.append(line.get("train_loss"))
    return losses, sim_time_s


def calibration_config(cfg: ExperimentConfig, q: float, k: int) -> ExperimentConfig:
    """One calibration run: `sketched` with every client at (q, k), same seed and network."""
    n = cfg.data.n_clients
    cap = cfg.planner.calibration_rounds
    return cfg.replace(
        method=dataclasses.replace(cfg.method, name="sketched", q=(q,) * n, k=(k,) * n),
        training=dataclasses.replace(
            cfg.training,
            rounds=cap,
            eval_every=cap,
            eval_every_s=0.0,  # calibration decides on the training loss: no timed evals
            target_accuracy=0.0,
            target_loss=0.0,
            time_budget_s=0.0,
            checkpoint_every=max(1, min(cfg.training.checkpoint_every, cap)),
        ),
        data=dataclasses.replace(cfg.data, eval_limit=CALIBRATION_EVAL_LIMIT),
        # its own run, whose ε is not the planned run's: the budget does not stop it
        planner=dataclasses.replace(cfg.planner, max_epsilon=0.0),
    )


def _calibrate(
    cfg: ExperimentConfig, run_dir: Path, *, run_one: RunOne, log
) -> tuple[list[dict[str, Any]], float, float]:
    """Run (or resume, or reuse) the four calibration runs; returns their records, F_s, F_s'.

    Under the lock of `run_dir` (the entry's), which holds them in run_dir/calibration."""
    fixed = cfg.planner.calibration_loss or None
    fraction = cfg.planner.calibration_loss_fraction
    target: dict[str, float | None] = {"loss": fixed}
    records = []
    for i, (q, k) in enumerate(calibration_settings(cfg.lora.rank)):
        sub = run_dir / "calibration" / f"run-{i}-q{q:g}-k{k}"
        metrics = sub / METRICS_FILE
        ccfg = calibration_config(cfg, q, k)

        def stop(line: dict[str, Any], metrics: Path = metrics) -> bool:
            losses, _ = _read_losses(metrics)
            if target["loss"] is None:
                first = next((x for x in losses if x is not None), None)
                if first is None:
                    return False
                target["loss"] = auto_calibration_loss(first, fraction)
                log(
                    f"calibration loss F_s = {target['loss']:.4f} ({fraction:g} x first round's loss)"
                )
            return rounds_to_loss(losses, target["loss"]) is not None

        if (sub / "summary.json").exists() and _extendable(sub, metrics, target, fraction, ccfg):
            # the cap was raised after this run stopped at the old one short of F_s: go on
            atomic_write(sub / "config.toml", dump_toml(ccfg).encode())
            remove_own_file(sub / "summary.json")
            log(f"calibration run {i + 1}/4: continued to at most {ccfg.training.rounds} rounds")
            run_one(ccfg, sub, resume=True, stop=stop)
        elif not (sub / "summary.json").exists():
            resume = (sub / "config.toml").exists()
            if not resume:
                write_run_dir(ccfg, sub)
            log(f"calibration run {i + 1}/4: q = {q:g}, k = {k} (at most {ccfg.training.rounds})")
            run_one(ccfg, sub, resume=resume, stop=stop)
        losses, sim_time_s = _read_losses(metrics)
        if target["loss"] is None:  # a reused run 0: recompute F_s from its recorded losses
            first = next((x for x in losses if x is not None), None)
            if first is None:
                raise ConfigError(
                    f"calibration run {sub}: no round had participants; raise "
                    "planner.calibration_rounds"
                )
            target["loss"] = auto_calibration_loss(first, fraction)
        records.append(
            {
                "q": q,
                "k": k,
                "dir": str(sub),
                "losses": losses,
                "sim_time_s": sim_time_s,
                "reached": rounds_to_loss(losses, float(target["loss"])) is not None,
            }
        )
    f_s = float(target["loss"])
    lowest = [
        min((x for x in smoothed_losses(r["losses"]) if x is not None), default=math.inf)
        for r in records
    ]
    f_used = max(f_s, max(lowest))
    if not math.isfinite(f_used):
        raise ConfigError(
            "calibration: a run had no participant in any round; raise planner.calibration_rounds"
        )
    for r in records:
        r["rounds"] = rounds_to_loss(r["losses"], f_used)
    return records, f_s, f_used


def _extendable(
    sub: Path, metrics: Path, target: dict[str, float | None], fraction: float, ccfg
) -> bool:
    """A finished calibration run that stopped at a cap below today's without reaching F_s."""
    losses, _ = _read_losses(metrics)
    if len(losses) >= ccfg.training.rounds:
        return False
    level = target["loss"]
    if level is None:  # run 0 decides F_s
        first = next((x for x in losses if x is not None), None)
        if first is None:
            return True
        level = auto_calibration_loss(first, fraction)
    return rounds_to_loss(losses, level) is None


def prepare_proposed(
    cfg: ExperimentConfig, run_dir: Path, *, run_one: RunOne, log=print
) -> tuple[ExperimentConfig, Plan | None]:
    """Calibrate and plan (or read back `run_dir`/plan.json); returns the config to train
    with (its time budget extended by the calibration unless planner.calibration_in_budget)
    and the plan. `cfg` has its device and dtype resolved (the calibration runs' config.toml
    record them); `run_one` runs each calibration run (`RunOne`).

    With method.q and method.k both naming one existing .json file (e.g. the output of
    `fedlora plan`), that plan is used as given (the plan is None: `make_method` reads the
    file) and no calibration runs.
    """
    if plan_file(cfg.method):
        return cfg, None
    if cfg.planner.calibration == "in-run":  # the run's own first rounds are the probes
        q, k = probe_settings(cfg.lora.rank, cfg.planner.probe_q)[
            0
        ]  # round 1's; the in-run planner sets each
        n, probes = cfg.data.n_clients, 4 * cfg.planner.probe_rounds
        if cfg.training.rounds <= probes:
            log(
                f"warning: training.rounds = {cfg.training.rounds} <= the {probes} probe rounds "
                "(planner.probe_rounds x 4): the run ends before it has a plan"
            )
        return cfg, Plan(q=(q,) * n, k=(k,) * n, calibration_s=0.0, in_run=True)
    plan_path = Path(run_dir) / PLAN_FILE
    if plan_path.exists():
        record = read_plan(plan_path)
        q, k, calibration_s = record.q, record.k, record.calibration_s
    else:
        records, f_s, f_used = _calibrate(cfg, Path(run_dir), run_one=run_one, log=log)
        clients = client_arrays(read_clients(Path(records[0]["dir"]) / CLIENTS_FILE))
        planned = plan_from_calibration(cfg, clients, records)
        calibration_s = float(sum(r["sim_time_s"] for r in records))
        saved = {
            **planned,
            "calibration": {
                "loss_target": f_s,
                "loss_used": f_used,
                "loss_rule": calibration_rule(cfg),
                "smoothing_rounds": SMOOTHING_ROUNDS,
                "max_rounds": cfg.planner.calibration_rounds,
                "sim_time_s": calibration_s,
                "runs": [
                    {k: r[k] for k in ("q", "k", "rounds", "sim_time_s", "dir", "reached")}
                    | {"rounds_run": len(r["losses"])}
                    for r in records
                ],
            },
        }
        write_plan(run_dir, saved)
        q, k = tuple(saved["q"]), tuple(saved["k"])
        c = saved["constants"]
        log(
            f"plan: A={c['A']:.4g} B={c['B']:.4g} C={c['C']:.4g} D={c['D']:.4g}; "
            f"mean q = {np.mean(saved['q']):.3f}, mean k = {np.mean(saved['k']):.1f}; "
            f"calibration {calibration_s:.1f} s simulated -> {plan_path}"
        )
        if saved["degeneracy"]["degenerate"]:
            log("plan is DEGENERATE: " + "; ".join(saved["degeneracy"]["reasons"]))
    training = cfg.training
    if training.time_budget_s and not cfg.planner.calibration_in_budget:
        # the budget starts after the calibration: train as long as the other methods
        training = dataclasses.replace(
            training, time_budget_s=training.time_budget_s + calibration_s
        )
    plan = Plan(q=q, k=k, calibration_s=calibration_s)
    return cfg.replace(training=training), plan


def calibration_rule(cfg: ExperimentConfig) -> str:
    """The calibration rule in words, as recorded in plan.json."""
    p = cfg.planner
    level = (
        f"F_s = planner.calibration_loss = {p.calibration_loss:g}"
        if p.calibration_loss
        else f"F_s = {p.calibration_loss_fraction:g} x the first round's train loss of run 1"
    )
    return (
        f"{level}; each run until its {SMOOTHING_ROUNDS}-round trailing mean train loss "
        f"<= F_s or {p.calibration_rounds} rounds; if a run never reaches F_s, every R_i "
        "is re-read at F_s' = the highest of the runs' lowest smoothed losses"
    )


def plan_outcome(run_dir: str | Path) -> dict[str, Any] | None:
    """Predicted vs observed rounds to the calibration loss for a finished `proposed` run.

    Reads run_dir/plan.json and metrics.jsonl; None when there is no plan.json (a run with a
    given plan file). `observed_rounds` is the first round whose smoothed training loss is
    <= F_s' (the level the constants were fitted at), None if the run never got there
    (`rounds_run` is then a lower bound).
    """
    run_dir = Path(run_dir)
    path = run_dir / PLAN_FILE
    if not path.is_file():
        return None
    saved = dict(read_plan(path).fields)
    losses, _ = _read_losses(run_dir / METRICS_FILE)
    if saved.get("calibration", {}).get("mode") == "in-run":
        return outcome(saved, rounds_run=len(losses))
    level = float(saved["calibration"]["loss_used"])
    degeneracy = saved.get("degeneracy", {})
    return {
        "loss_used": level,
        "predicted_rounds": saved.get("expected_rounds"),
        "observed_rounds": rounds_to_loss(losses, level),
        "rounds_run": len(losses),
        "degenerate": degeneracy.get("degenerate"),
        "degenerate_reasons": degeneracy.get("reasons", []),
        "calibration": [
            {
                "q": r["q"],
                "k": r["k"],
                "observed_rounds": f["observed_rounds"],
                "predicted_rounds": f["predicted_rounds"],
                "reached_f_s": r.get("reached"),
            }
            for r, f in zip(saved["calibration"]["runs"], saved.get("fit", []))
        ],
        "calibration_sim_time_s": saved["calibration"]["sim_time_s"],
    }
