"""The federated round engine: Algorithm 1 end to end with a simulated wireless clock.

One run, top to bottom (`run_rounds`, the one round loop; `run_in_process` runs it in this
process, called by the run's entry `fedlora.federation.run` once that has checked the inputs,
resolved the device, locked and written the run directory; the Flower ServerApp runs it with
its nodes training):

    setup      config → run directory, model + LoRA slots, data partition, client profiles,
               method (`fedlora.federation.runstate.build_run`); resume from a checkpoint
    round 0    the untrained adapter evaluated, before any time passes
    per round  plan (who, which sketch) → local training (a `Trainer`: client-batched slots
               here, the Flower nodes there) → aggregate → round time from the exact bits
               sent (`fedlora.federation.clock`) → evaluate every E rounds → append one line
               to metrics.jsonl → checkpoint every C rounds → stop rules
    finish     final checkpoint, adapter (PEFT format), summary.json

Randomness: every draw of round r comes from a generator derived from (seed, stream, r, ...)
(`fedlora.system.seeding.derive_rng`), so a resumed run replays exactly the draws of an
uninterrupted one and a Flower client can rebuild its own batches.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.federation.checkpoints import load_checkpoint, save_checkpoint
from fedlora.federation.machine_log import MACHINE_FILE, machine_facts, record_stretch
from fedlora.federation.methods.base import RoundContext, RoundPlan
from fedlora.federation.methods.proposed import Plan
from fedlora.federation.metrics_file import append_metrics, restore_metrics
from fedlora.federation.privacy import account_round, budget_stop, prepare_round, spent_rdp
from fedlora.federation.profiles import write_clients_csv
from fedlora.federation.progress import (
    Progress,
    Reporter,
    end_reason,
    stop_before_round,
    summarize,
)
from fedlora.federation.round_steps import (
    apply_aggregate,
    close_round,
    evaluate_global,
    round_header,
)
from fedlora.federation.runfiles import write_summary
from fedlora.federation.runmarker import admit_to_manifest
from fedlora.federation.runstate import (
    Run,
    build_run,
    checkpoint_state,
    restore_state,
    to_numpy,
)
from fedlora.federation.scoring import check_predictions
from fedlora.federation.tracked_run import Trackers, open_trackers
from fedlora.federation.trainer import (
    SlotTrainer,
    Trained,
    Trainer,
    TrainingDiverged,
)
from fedlora.files import remove_own_file
from fedlora.llm.device import Resolution, synchronize
from fedlora.system.seeding import derive_rng

Log = Callable[[str], Any]


def run_in_process(
    runtime: Resolution,
    run_dir: Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    log: Log | None = None,
    stop: Callable[[dict[str, Any]], bool] | None = None,
    plan: Plan | None = None,
    finish: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) one federated experiment in `run_dir`, training in this process;
    returns the summary. The caller holds the lock of `run_dir`, checked the inputs and
    resolved the device and dtype (`runtime`): this function does none of it again.

    `stop(line)` is called after every round's metrics line is written; True ends the run
    (stop_reason "stop_condition"; `proposed` uses it to end calibration runs at F_s).
    `plan`: Algorithm 2's plan of a `proposed` run (`fedlora.federation.calibration`); the
    run's clock starts at its calibration time. `finish(summary)` may add to the summary
    before summary.json is written.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    wall_start = time.perf_counter()
    run = build_run(runtime, run_dir, log=log, plan=plan)
    return run_rounds(
        run,
        SlotTrainer(run),
        resume=resume,
        log=log,
        reporter=Reporter(quiet),
        stop=stop,
        calibration_s=plan.calibration_s if plan is not None else 0.0,
        finish=finish,
        wall_start=wall_start,
    )


def run_rounds(
    run: Run,
    trainer: Trainer,
    *,
    resume: bool,
    log: Log,
    wall_start: float,
    reporter: Reporter | None = None,
    stop: Callable[[dict[str, Any]], bool] | None = None,
    calibration_s: float | None = 0.0,
    finish: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The one round loop over a built run: resume, round 0, the rounds with `trainer`
    training, the stop rules, checkpoints, the final adapter and summary.json.

    `calibration_s` starts the clock and is recorded as `calibration_sim_time_s` (None: a
    runtime without calibration, the key is left out).
    """
    cfg, run_dir = run.cfg, run.run_dir
    metrics_path = run_dir / "metrics.jsonl"
    progress = _start_progress(run, trainer, resume=resume, log=log, calibration_s=calibration_s)
    write_clients_csv(run_dir, run.fed, run.profiles)
    next_step = 0 if progress.metrics_lines == 0 else progress.round + 1
    trackers = open_trackers(cfg, run_dir, resume=resume, next_step=next_step)
    # which machine computes from here (after the last check that can refuse the resume)
    admit_to_manifest(run_dir, MACHINE_FILE)  # a run begun by an older fedlora
    facts = machine_facts(run.device, trains_here=trainer.trains_here)
    record_stretch(run_dir, progress.round, facts, fresh=not resume)
    if progress.metrics_lines == 0:  # round 0: the untrained adapter, before any time passes
        append_metrics(metrics_path, line0 := _round_zero(run, trainer, progress, calibration_s))
        trackers.log(line0)
        progress.metrics_lines = 1

    def checkpoint() -> None:
        save_checkpoint(run_dir, checkpoint_state(run, progress) | trainer.state_dict())

    if reporter is not None:
        reporter.start(cfg.training.rounds, progress.round)
    try:
        stop_reason = _round_loop(run, trainer, progress, trackers, reporter, stop, log, checkpoint)
    except TrainingDiverged as e:
        raise TrainingDiverged(
            f"{e}{_noise_hint(run)}. The run stopped; its last good checkpoint is kept in "
            f"{run_dir / 'checkpoints'}"
        ) from None
    finally:
        if reporter is not None:
            reporter.close()
        if sys.exc_info()[0] is not None:
            trackers.finish(run_dir, failed=True)
    checkpoint()
    run.lora.export_peft(run_dir / "adapter", base_model_name_or_path=cfg.model.name)
    summary = summarize(cfg, progress, stop_reason, wall_start)
    if calibration_s is not None:
        summary["calibration_sim_time_s"] = calibration_s
    summary.update(trainer.summary_fields())
    if finish is not None:
        finish(summary)
    write_summary(run_dir, summary)
    trackers.finish(run_dir)
    return summary


def _start_progress(
    run: Run, trainer: Trainer, *, resume: bool, log: Log, calibration_s: float | None
) -> Progress:
    """Where the run starts: restored from its newest checkpoint (metrics.jsonl cut back to
    it) on resume, else round 0 with metrics.jsonl removed; the clock starts after the
    calibration either way."""
    run_dir = run.run_dir
    metrics_path = run_dir / "metrics.jsonl"
    progress = Progress(sim_time_s=calibration_s or 0.0)  # the calibration's clock counts
    if resume:
        check_predictions(run_dir)  # a damaged predictions.jsonl is refused before any work
        state = load_checkpoint(run_dir, warn=log)
        if state is not None:
            progress = restore_state(run, state)
            trainer.load_state_dict(state)
            log(f"resuming {run_dir} after round {progress.round}")
        else:
            log(f"no checkpoint in {run_dir}: starting from round 0")
        restore_metrics(metrics_path, state, warn=log)
    else:
        remove_own_file(metrics_path)
    progress.clock_start_s = calibration_s or 0.0  # also on resume (older checkpoints lack it)
    return progress


def _round_loop(
    run: Run,
    trainer: Trainer,
    progress: Progress,
    trackers: Trackers,
    reporter: Reporter | None,
    stop: Callable[[dict[str, Any]], bool] | None,
    log: Log,
    checkpoint: Callable[[], None],
) -> str:
    """The rounds until a stop rule, the privacy budget, `stop` or training.rounds ends them:
    hooks, plan, train, record, report, checkpoint. Returns the stop reason."""
    cfg = run.cfg
    metrics_path = run.run_dir / "metrics.jsonl"
    hooks = RoundContext(  # the method's hooks
        cfg, run.fed.a, run.profiles, run.run_dir, log, lambda: spent_rdp(run.method, progress)
    )
    noted = False  # the privacy noise's line (`noise_note`) was logged
    while progress.round < cfg.training.rounds:
        early = stop_before_round(cfg, progress)
        if early:
            return early
        run.method.before_round(hooks, progress.round)
        prepare_round(run.method, progress)  # adaptive clipping's C after a resume
        spent = budget_stop(run.method, progress)  # at the round's q (after before_round)
        if spent:
            log(spent)
            return "privacy_budget"
        plan = plan_next_round(run, progress)
        synchronize(run.device)  # on a GPU, compute_s counts the round's queued work too
        t0 = time.perf_counter()
        line = _one_round(run, trainer, plan, progress)
        synchronize(run.device)
        compute_s = time.perf_counter() - t0
        if not noted and run.method.privacy is not None:  # once per invocation
            note = run.method.privacy.noise_note(run.method)
            noted = note is not None
            if noted:
                log(note)
        run.method.after_round(hooks, progress.round, line)
        record_round(metrics_path, progress, line, compute_s)
        trainer.report(line)
        trackers.log(line)
        if reporter is not None:
            reporter.update(line, progress)
        if stop is not None and stop(line):
            return "stop_condition"
        if progress.round % cfg.training.checkpoint_every == 0:
            checkpoint()
    return end_reason(cfg, progress)


def _noise_hint(run: Run) -> str:
    """Under DP, the noise a divergence may come from, with the fields that set it."""
    dp = run.method.privacy
    if dp is None or dp.noise_std == 0:
        return ""
    return (
        f" (the privacy noise has standard deviation {dp.noise_std:g} per adapter entry: "
        "privacy.noise_multiplier x privacy.clip_norm)"
    )


def _round_zero(
    run: Run, trainer: Trainer, progress: Progress, calibration_s: float | None
) -> dict[str, Any]:
    """Metrics line 0: the untrained adapter's evaluation."""
    evaluation = evaluate_global(run, progress, 0)
    calibration = {} if calibration_s is None else {"calibration_sim_time_s": calibration_s}
    return {
        "round": 0,
        "participants": [],
        "n_participants": 0,
        "k": [],
        "round_time_s": 0.0,
        "sim_time_s": progress.sim_time_s,
        **calibration,
        "uplink_bits": 0,
        "downlink_bits": 0,
        "train_loss": None,
        **evaluation,
        "compute_s": 0.0,
        **trainer.line_fields(None),
    }


def plan_next_round(run: Run, progress: Progress) -> RoundPlan:
    """The method's plan for the next round, from the round's derived generators."""
    seed, r = run.cfg.training.seed, progress.round
    return run.method.plan_round(r, derive_rng(seed, "sampling", r), derive_rng(seed, "sketch", r))


def record_round(
    metrics_path: Path, progress: Progress, line: dict[str, Any], compute_s: float
) -> None:
    """Append a finished round's metrics line and advance the progress past it."""
    line["compute_s"] = compute_s
    progress.compute_s += compute_s
    append_metrics(metrics_path, line)
    progress.metrics_lines += 1
    progress.round += 1


def _one_round(run: Run, trainer: Trainer, plan: RoundPlan, progress: Progress) -> dict[str, Any]:
    """Train, aggregate what arrived, advance the clock by who actually sent."""
    line = round_header(plan)
    train_loss: float | None = None
    trained: Trained | None = None
    cost_plan = plan
    if plan.tasks:
        global_state = to_numpy(run.lora.global_state())
        trained = trainer.train(plan, global_state)
        cost_plan = trained.plan
        if trained.states:
            apply_aggregate(run, trained.plan, global_state, trained.states)
            train_loss = float(np.mean(trained.losses))
    else:
        progress.empty_rounds += 1
    if run.method.privacy is not None and run.method.privacy.noise_alone(trained):
        apply_aggregate(run, RoundPlan(plan.round, ()), to_numpy(run.lora.global_state()), [])
    close_round(run, cost_plan, progress, line, train_loss)
    if trained is not None and trained.states and run.method.logs_client_losses:
        line["client_losses"] = [
            [t.client, float(x)] for t, x in zip(trained.plan.tasks, trained.losses)
        ]
    line.update(trainer.line_fields(trained), **account_round(run.method, cost_plan, progress))
    return line
