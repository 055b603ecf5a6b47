"""The federated round engine: Algorithm 1 end to end with a simulated wireless clock.

One run, top to bottom:

    setup      config → run directory, model + LoRA slots, data partition, client profiles, method
    per round  plan (who, which sketch) → local training (client-batched, `slots` at a time)
               → aggregate → round time from the exact bits sent → evaluate every E rounds
               → append one line to metrics.jsonl → checkpoint every C rounds
    finish     final adapter (PEFT format), summary.json

Randomness: every draw of round r comes from a generator derived from (seed, stream, r, ...)
(`fedlora.system.seeding.derive_rng`), so a resumed run replays exactly the draws of an
uninterrupted one and a Flower client can rebuild its own batches.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config import ExperimentConfig
from fedlora.errors import FedloraError
from fedlora.federation.methods import Method, Plan, RoundPlan, make_method
from fedlora.federation.profiles import build_profiles, write_clients_csv

# Run directories, checkpoints and metrics files live in fedlora.federation.rundir; re-exported here
# because the Flower ServerApp and older callers import them from the engine.
from fedlora.federation.rundir import (
    append_metrics,
    atomic_write,
    checkpoint_paths,  # noqa: F401
    load_checkpoint,
    load_run_config,  # noqa: F401
    prepare_run_dir,  # noqa: F401
    restore_metrics,
    run_dir_for,  # noqa: F401
    run_dir_lock,
    save_checkpoint,
    truncate_metrics,  # noqa: F401
)
from fedlora.llm.device import resolve_runtime, synchronize
from fedlora.system.network import (
    ClientProfiles,
    rayleigh_gains,
    round_time,
    spectral_efficiency,
)
from fedlora.system.seeding import derive_rng, derive_seed


class TrainingDiverged(FedloraError):
    """A non-finite training loss: the run stops and keeps its last good checkpoint."""


# ----------------------------------------------------------------------------- network


@dataclass
class RoundCost:
    round_time_s: float
    uplink_bits: int
    downlink_bits: int
    bandwidth_hz: list[float]
    downlink_s: float = 0.0  # the broadcast's share of round_time_s (0 when the downlink is free)


def round_cost(
    cfg: ExperimentConfig,
    profiles: ClientProfiles,
    plan: RoundPlan,
    method: Method,
    shapes: dict[str, tuple[int, int]],
    round_index: int,
) -> RoundCost:
    """Round time from the exact payload of every participant (PAPER_NOTES #4–#6, #15).

    τ_n = tau_full_s · comp_factor(k_n). t_n = t_full · (payload bits / full-adapter bits)
    for comm_cost = exact (scaled by the faded spectral efficiency with Rayleigh fading), or
    t_full · comm_factor(k_n) for the paper's `quadratic` / the `linear` model.
    """
    net, gamma = cfg.network, cfg.lora.rank
    if not plan.tasks:
        return RoundCost(0.0, 0, 0, [])
    clients = np.array(plan.participants)
    ranks = np.array([t.rank_used for t in plan.tasks])
    payloads = [method.payload(t, shapes, plan) for t in plan.tasks]
    up_bits = np.array([p.uplink_params for p in payloads], dtype=float) * net.bits_per_param
    down_bits = np.array([p.downlink_params for p in payloads], dtype=float) * net.bits_per_param
    full_bits = gamma * sum(o + i for o, i in shapes.values()) * net.bits_per_param
    efficiency = None
    if net.fading == "rayleigh" and profiles.has_channel:
        gains = rayleigh_gains(profiles.n, derive_rng(cfg.training.seed, "fading", round_index))
        gains = np.maximum(gains, net.fading_floor)  # the outage floor (0: none)
        faded = spectral_efficiency(profiles.snr_db, gains)[clients]
        efficiency = (profiles.spectral_efficiency[clients], faded)
    round_time_s, f = round_time(
        profiles.tau_full_s[clients],
        profiles.t_full[clients],
        ranks,
        gamma,
        comm_cost=net.comm_cost,
        comp_cost=net.comp_cost,
        rho=net.rho,
        f_tot_hz=net.f_tot_hz,
        uplink_bits=up_bits,
        full_bits=full_bits,
        efficiency=efficiency,
    )
    downlink_s = 0.0
    if net.downlink_rate_bps > 0:  # a broadcast before local training: the largest download
        downlink_s = float(down_bits.max()) / net.downlink_rate_bps
    return RoundCost(
        round_time_s + downlink_s,
        int(up_bits.sum()),
        int(down_bits.sum()),
        f.tolist(),
        downlink_s,
    )


# ----------------------------------------------------------------------------- setup


@dataclass
class Run:
    """Everything a run holds in memory between rounds."""

    cfg: ExperimentConfig
    run_dir: Path
    model: Any
    tokenizer: Any
    lora: Any
    fed: Any
    profiles: ClientProfiles
    method: Method
    shapes: dict[str, tuple[int, int]]
    base_delta: dict[str, np.ndarray] = field(default_factory=dict)
    device: str = "cpu"  # where the model, the slots, batches and the layer cache live
    slots_per_pass: int = 0  # clients per forward/backward; 0 = training.slots


def build_run(cfg: ExperimentConfig, run_dir: Path, log=print, plan: Plan | None = None) -> Run:
    """Model, LoRA slots, federated data, client profiles and the method of one run."""
    from fedlora.llm.data import build_federated_data
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.models import load_model

    resolved = resolve_runtime(cfg)  # sets the threads; auto device/dtype made concrete
    cfg = resolved.cfg
    log(f"model: {cfg.model.name} on {resolved.describe()}")
    model, tokenizer = load_model(
        cfg.model.name,
        dtype=cfg.model.dtype,
        cache_dir=cfg.model.cache_dir or None,
        device=cfg.model.device,
    )
    lora = inject_lora(
        model, cfg.lora, slots=cfg.training.slots, seed=derive_seed(cfg.training.seed, "init")
    )
    shapes = lora.layer_shapes()
    fed = build_federated_data(cfg.data, tokenizer, seed=cfg.training.seed)
    full_bits = cfg.lora.rank * sum(o + i for o, i in shapes.values()) * cfg.network.bits_per_param
    profiles = build_profiles(cfg, full_bits)
    method = make_method(
        cfg,
        fed.a,
        derive_rng(cfg.training.seed, "strategy"),
        tau_full_s=profiles.tau_full_s,
        plan=plan,
    )
    run = Run(cfg, run_dir, model, tokenizer, lora, fed, profiles, method, shapes)
    run.device = cfg.model.device
    run.slots_per_pass = device_slots_per_pass(run, log)
    return run


def device_slots_per_pass(run: Run, log=print) -> int:
    """training.slots, capped on a CUDA GPU by what half its free memory holds (an
    over-estimate of one slot's activations, `fedlora.llm.device.activation_bytes_per_slot`)."""
    requested = run.cfg.training.slots
    if not run.device.startswith("cuda"):
        return requested
    import torch

    from fedlora.llm.device import activation_bytes_per_slot, slots_for_memory
    from fedlora.llm.lora import layer_index

    free_bytes, _ = torch.cuda.mem_get_info(run.device)
    n_layers = int(run.model.config.num_hidden_layers)
    lowest = min((i for n in run.lora.names if (i := layer_index(n)) is not None), default=0)
    per_slot = activation_bytes_per_slot(
        run.model.config,
        batch_size=run.cfg.training.batch_size,
        seq_len=run.cfg.data.max_seq_len,
        trained_layers=n_layers - lowest,
        dtype_bytes=2 if run.cfg.model.dtype == "bf16" else 4,
    )
    slots = slots_for_memory(requested, free_bytes, per_slot)
    if slots < requested:
        log(
            f"training.slots = {requested}: {slots} per pass fit in half of the "
            f"{free_bytes / 2**30:.1f} GiB free on {run.device}"
        )
    return slots


# ----------------------------------------------------------------------------- one round


def to_numpy(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def to_torch(state: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


def train_participants(run: Run, plan: RoundPlan) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """Local training of every participant, `slots` clients per forward/backward.

    Returns each participant's final adapter (in plan order) and its mean loss over H steps.
    """
    import torch

    from fedlora.llm.data import client_batches
    from fedlora.llm.train import TrainingError, layer_cache_for, local_train, step_sizes_for

    cfg, seed, r = run.cfg, run.cfg.training.seed, plan.round
    pad_id = run.tokenizer.pad_token_id
    # lora.layers = K: frozen lower layers once per example, kept across rounds (exact)
    cache = layer_cache_for(
        run.model, run.lora, cfg.training.layer_cache_mb, cfg.training.layer_cache_dtype
    )
    states: list[dict[str, np.ndarray]] = []
    losses: list[float] = []
    tasks = list(plan.tasks)
    per_pass = run.slots_per_pass or cfg.training.slots
    for start in range(0, len(tasks), per_pass):
        chunk = tasks[start : start + per_pass]
        scales = torch.tensor(np.stack([t.scale for t in chunk]), dtype=torch.float32)  # (c, γ)
        run.lora.set_clients(scales)
        batches = [
            client_batches(
                run.fed,
                t.client,
                cfg.training.local_steps,
                cfg.training.batch_size,
                derive_rng(seed, "data", r, t.client),
                pad_id,
            )
            for t in chunk
        ]
        torch.manual_seed(derive_seed(seed, "torch", r, start))
        try:
            chunk_losses = local_train(
                run.model,
                run.lora,
                batches,
                step_sizes_for(cfg.training, scales.numpy()),
                autocast_bf16=cfg.model.dtype == "bf16",
                cache=cache,
                momentum=cfg.training.momentum,
            )  # (c, H)
        except TrainingError as e:
            clients = [t.client for t in chunk]
            raise TrainingDiverged(f"round {r + 1}, clients {clients}: {e}") from None
        for i in range(len(chunk)):
            states.append(to_numpy(run.lora.slot_state(i)))
        losses.extend(np.asarray(chunk_losses).mean(axis=1).tolist())
    return states, np.array(losses)


def restore_state(run: Run, state: dict[str, Any]) -> Progress:
    """Put a checkpoint's global adapter, merged base delta and method state back into `run`;
    its progress. Shared by the engine and the Flower ServerApp."""
    run.lora.load_global(state["global"])
    run.base_delta = state.get("base_delta") or {}
    if run.base_delta:
        run.lora.add_to_base(to_torch(run.base_delta))
    run.method.load_state_dict(state.get("method", {}))
    return Progress(**state["progress"])


def evaluate_tasks(run: Run) -> dict[str, Any]:
    """The current global adapter on every eval task's fixed subset: task -> EvalResult."""
    import torch

    from fedlora.llm.evaluation import eval_cache_for, evaluate

    ecfg = run.cfg.evaluation
    run.lora.set_clients(torch.ones(1, run.cfg.lora.rank))  # slot 0 = the global adapter
    # lora.layers = K: the eval set's frozen lower layers once per run (same results)
    cache = eval_cache_for(run.model, run.lora, ecfg.cache_mb)
    return {
        task: evaluate(
            run.model,
            run.tokenizer,
            examples,
            batch_size=ecfg.batch_size,
            scoring=ecfg.scoring,
            task=task,
            cache=cache,
        )
        for task, examples in run.fed.eval_sets.items()
    }


def evaluate_global(run: Run) -> dict[str, float]:
    """Accuracy of the current global adapter on every eval task's fixed subset."""
    return {task: r.accuracy for task, r in evaluate_tasks(run).items()}


PREDICTIONS_FILE = "predictions.jsonl"


def write_predictions(run_dir: Path, round_index: int, results: dict[str, Any]) -> None:
    """One line per task of this evaluation in predictions.jsonl: question ids, predicted
    label index, correct (0/1) and NLL per question. Lines of this or later rounds (left by
    an interrupted run that is being resumed) are replaced."""
    path = run_dir / PREDICTIONS_FILE
    kept = []
    if path.exists():
        for raw in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(raw)["round"] < round_index:
                    kept.append(raw)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn line of a killed run
    for task, r in results.items():
        line = {
            "round": round_index,
            "task": task,
            "scoring": r.scoring,
            "ids": r.ids,
            "pred": r.predictions,
            "correct": [int(c) for c in r.correct],
            "nll": [round(x, 6) for x in r.nll],
        }
        kept.append(json.dumps(line))
    atomic_write(path, "".join(line + "\n" for line in kept).encode())


def eval_fields(run: Run, progress: Progress, round_index: int, results: dict[str, Any]) -> dict:
    """The metrics-line fields of an evaluation beside the accuracy (eval_loss, intervals,
    majority-label and chance scores, n); updates the loss in `progress` and writes the
    per-question predictions."""
    loss = mean_over_tasks({t: r.loss for t, r in results.items()})
    if progress.initial_eval_loss is None:
        progress.initial_eval_loss = loss
    progress.last_eval_loss = loss
    best = progress.best_eval_loss
    progress.best_eval_loss = loss if best is None else min(best, loss)
    target = run.cfg.training.target_loss
    if target and loss <= target and progress.time_to_target_loss_s is None:
        progress.time_to_target_loss_s = progress.sim_time_s
    details = {
        t: {
            "accuracy": r.accuracy,
            "ci95": list(r.ci95),
            "n": r.n,
            "majority": r.majority,
            "chance": r.chance,
            "loss": r.loss,
            "loss_ci95": list(r.loss_ci95),
        }
        for t, r in results.items()
    }
    if progress.initial_eval is None:
        progress.initial_eval = details
    progress.last_eval = details
    if run.cfg.evaluation.predictions:
        write_predictions(run.run_dir, round_index, results)
    return {
        "eval_loss": loss,
        "eval_losses": {t: r.loss for t, r in results.items()},
        "eval_ci95": {t: list(r.ci95) for t, r in results.items()},
        "eval_n": {t: r.n for t, r in results.items()},
        "eval_majority": {t: r.majority for t, r in results.items()},
        "eval_chance": {t: r.chance for t, r in results.items()},
        "eval_scoring": run.cfg.evaluation.scoring,
    }


# ----------------------------------------------------------------------------- the loop


@dataclass
class Progress:
    """What the loop carries from round to round (and saves in checkpoints)."""

    round: int = 0  # rounds completed
    sim_time_s: float = 0.0
    metrics_lines: int = 0
    initial_accuracy: float | None = None
    last_accuracy: float | None = None
    best_accuracy: float | None = None
    time_to_target_s: float | None = None
    uplink_bits: int = 0
    downlink_bits: int = 0
    empty_rounds: int = 0
    compute_s: float = 0.0
    initial_eval_loss: float | None = None
    last_eval_loss: float | None = None
    best_eval_loss: float | None = None
    time_to_target_loss_s: float | None = None
    initial_eval: dict[str, Any] | None = None  # per task: accuracy, ci95, n, majority, ...
    last_eval: dict[str, Any] | None = None


def mean_over_tasks(values: dict[str, float]) -> float:
    return float(np.mean(list(values.values())))


class _Reporter:
    """A progress bar, or plain log lines with --quiet."""

    def __init__(self, total: int, initial: int, quiet: bool) -> None:
        self.quiet = quiet
        self.bar = None
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc="rounds", unit="round", file=sys.stderr
            )

    def update(self, line: dict[str, Any], progress: Progress) -> None:
        acc = progress.last_accuracy
        text = {
            "clock": f"{progress.sim_time_s:.0f}s",
            "loss": "-" if line["train_loss"] is None else f"{line['train_loss']:.3f}",
            "acc": "-" if acc is None else f"{acc:.3f}",
        }
        if self.bar is not None:
            self.bar.set_postfix(text, refresh=False)
            self.bar.update(1)
        elif "eval_accuracy" in line or line["round"] == 1:
            print(
                f"round {line['round']}: n={line['n_participants']} "
                + " ".join(f"{k}={v}" for k, v in text.items()),
                file=sys.stderr,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def checkpoint_state(run: Run, progress: Progress) -> dict[str, Any]:
    return {
        "round": progress.round,
        "progress": progress.__dict__.copy(),
        "global": run.lora.global_state(),
        "base_delta": run.base_delta,
        "method": run.method.state_dict(),
        "seed": run.cfg.training.seed,
        "rng": "derived from (seed, stream, round): see fedlora.federation.engine.derive_rng",
    }


def run_experiment(
    cfg: ExperimentConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    log=None,
    stop: Callable[[dict[str, Any]], bool] | None = None,
    plan: Plan | None = None,
    finish: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) one federated experiment in `run_dir`; returns the summary.

    `stop(line)` is called after every round's metrics line is written; True ends the run
    (stop_reason "stop_condition"; `proposed` uses it to end calibration runs at F_s).
    `plan`: Algorithm 2's plan of a `proposed` run (`fedlora.studies.calibration`); the run's
    clock starts at its calibration time. `finish(summary)` may add to the summary before
    summary.json is written.
    """
    with run_dir_lock(run_dir):  # a second process on the same directory is refused
        return _run_experiment(
            cfg, run_dir, resume=resume, quiet=quiet, log=log, stop=stop, plan=plan, finish=finish
        )


def _run_experiment(
    cfg: ExperimentConfig,
    run_dir: Path,
    *,
    resume: bool,
    quiet: bool,
    log: Callable[[str], Any] | None,
    stop: Callable[[dict[str, Any]], bool] | None,
    plan: Plan | None,
    finish: Callable[[dict[str, Any]], None] | None,
) -> dict[str, Any]:
    from fedlora.federation.preflight import check_inputs

    log = log or (lambda msg: print(msg, file=sys.stderr))
    check_inputs(cfg)  # bad inputs fail here, before the model loads
    wall_start = time.perf_counter()
    calibration_s = plan.calibration_s if plan is not None else 0.0
    run = build_run(cfg, run_dir, log=log, plan=plan)
    metrics_path = run_dir / "metrics.jsonl"
    progress = Progress(sim_time_s=calibration_s)  # the calibration's clock counts

    if resume:
        state = load_checkpoint(run_dir, warn=log)
        if state is not None:
            progress = restore_state(run, state)
            log(f"resuming {run_dir} after round {progress.round}")
        else:
            log(f"no checkpoint in {run_dir}: starting from round 0")
        restore_metrics(metrics_path, state, warn=log)
    else:
        metrics_path.unlink(missing_ok=True)
    write_clients_csv(run_dir, run.fed, run.profiles)

    if progress.metrics_lines == 0:  # round 0: the untrained adapter, before any time passes
        results = evaluate_tasks(run)
        accs = {task: r.accuracy for task, r in results.items()}
        progress.initial_accuracy = progress.last_accuracy = mean_over_tasks(accs)
        progress.best_accuracy = progress.initial_accuracy
        line0 = {
            "round": 0,
            "participants": [],
            "n_participants": 0,
            "k": [],
            "round_time_s": 0.0,
            "sim_time_s": progress.sim_time_s,
            "calibration_sim_time_s": calibration_s,
            "uplink_bits": 0,
            "downlink_bits": 0,
            "train_loss": None,
            "eval_accuracy": progress.initial_accuracy,
            "eval": accs,
            **eval_fields(run, progress, 0, results),
            "compute_s": 0.0,
        }
        append_metrics(metrics_path, line0)
        progress.metrics_lines = 1

    tcfg = cfg.training
    stop_reason = "max_rounds"
    reporter = _Reporter(tcfg.rounds, progress.round, quiet)
    try:
        while progress.round < tcfg.rounds:
            early = stop_before_round(cfg, progress)
            if early:
                stop_reason = early
                break
            plan = plan_next_round(run, progress)
            synchronize(run.device)  # on a GPU, compute_s counts the round's queued work too
            t0 = time.perf_counter()
            line = _one_round(run, plan, progress)
            synchronize(run.device)
            record_round(metrics_path, progress, line, time.perf_counter() - t0)
            reporter.update(line, progress)
            if stop is not None and stop(line):
                stop_reason = "stop_condition"
                break
            if progress.round % tcfg.checkpoint_every == 0:
                save_checkpoint(run_dir, checkpoint_state(run, progress))
        else:
            if target_reached(cfg, progress):
                stop_reason = "target_accuracy"
            elif target_loss_reached(cfg, progress):
                stop_reason = "target_loss"
    except TrainingDiverged as e:
        reporter.close()
        raise TrainingDiverged(
            f"{e}. The run stopped; its last good checkpoint is kept in {run_dir / 'checkpoints'}"
        ) from None
    reporter.close()
    save_checkpoint(run_dir, checkpoint_state(run, progress))
    run.lora.export_peft(run_dir / "adapter", base_model_name_or_path=cfg.model.name)
    summary = summarize(cfg, progress, stop_reason, wall_start)
    summary["calibration_sim_time_s"] = calibration_s
    if finish is not None:
        finish(summary)
    atomic_write(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    return summary


def stop_before_round(cfg: ExperimentConfig, progress: Progress) -> str | None:
    """The reason to stop before the next round (target reached, time budget spent), if any."""
    if target_reached(cfg, progress):
        return "target_accuracy"
    if target_loss_reached(cfg, progress):
        return "target_loss"
    budget = cfg.training.time_budget_s
    if budget and progress.sim_time_s >= budget:
        return "time_budget"
    return None


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


def summarize(
    cfg: ExperimentConfig, progress: Progress, stop_reason: str, wall_start: float
) -> dict[str, Any]:
    """The fields of summary.json every runtime writes (the engine's and Flower's)."""
    return {
        "stop_reason": stop_reason,
        "rounds": progress.round,
        "sim_time_s": progress.sim_time_s,
        "initial_accuracy": progress.initial_accuracy,
        "final_accuracy": progress.last_accuracy,
        "best_accuracy": progress.best_accuracy,
        "target_accuracy": cfg.training.target_accuracy or None,
        "time_to_target_s": progress.time_to_target_s,
        "total_uplink_bits": progress.uplink_bits,
        "total_downlink_bits": progress.downlink_bits,
        "empty_rounds": progress.empty_rounds,
        "compute_s": progress.compute_s,
        "initial_eval_loss": progress.initial_eval_loss,
        "final_eval_loss": progress.last_eval_loss,
        "best_eval_loss": progress.best_eval_loss,
        "target_loss": cfg.training.target_loss or None,
        "time_to_target_loss_s": progress.time_to_target_loss_s,
        "initial_eval": progress.initial_eval,
        "final_eval": progress.last_eval,
        "wall_s": time.perf_counter() - wall_start,
        "method": cfg.method.name,
        "seed": cfg.training.seed,
    }


def target_reached(cfg: ExperimentConfig, progress: Progress) -> bool:
    target = cfg.training.target_accuracy
    return bool(target) and progress.last_accuracy is not None and progress.last_accuracy >= target


def target_loss_reached(cfg: ExperimentConfig, progress: Progress) -> bool:
    target = cfg.training.target_loss
    return (
        bool(target) and progress.last_eval_loss is not None and progress.last_eval_loss <= target
    )


def round_header(plan: RoundPlan) -> dict[str, Any]:
    """The first fields of a round's metrics line: who was asked to train, with which k."""
    return {
        "round": plan.round + 1,
        "participants": plan.participants,
        "n_participants": len(plan.tasks),
        "k": [t.rank_used for t in plan.tasks],
    }


def apply_aggregate(
    run: Run, plan: RoundPlan, global_state: dict[str, np.ndarray], states: list
) -> None:
    """The method's aggregate becomes the global adapter (and, for FedStackLoRA, the base)."""
    agg = run.method.aggregate(global_state, plan, states)
    run.lora.load_global(to_torch(agg.global_state))
    if agg.base_delta:
        run.lora.add_to_base(to_torch(agg.base_delta))
        for name, delta in agg.base_delta.items():
            run.base_delta[name] = run.base_delta.get(name, 0) + delta


def close_round(
    run: Run,
    cost_plan: RoundPlan,
    progress: Progress,
    line: dict[str, Any],
    train_loss: float | None,
) -> dict[str, Any]:
    """Advance the clock by the round time of `cost_plan` (who actually sent), record the
    bits and the loss, and evaluate every E rounds, when the clock passes a multiple of
    training.eval_every_s, at the round that spends the time budget and at the last round."""
    cfg, r = run.cfg, cost_plan.round
    cost = round_cost(cfg, run.profiles, cost_plan, run.method, run.shapes, r)
    before_s = progress.sim_time_s
    progress.sim_time_s += cost.round_time_s
    progress.uplink_bits += cost.uplink_bits
    progress.downlink_bits += cost.downlink_bits
    line.update(
        round_time_s=cost.round_time_s,
        downlink_s=cost.downlink_s,
        sim_time_s=progress.sim_time_s,
        uplink_bits=cost.uplink_bits,
        downlink_bits=cost.downlink_bits,
        train_loss=train_loss,
    )
    last = r + 1 == cfg.training.rounds or _crossed_budget(cfg, before_s, progress.sim_time_s)
    if (r + 1) % cfg.training.eval_every == 0 or last or _eval_due_s(cfg, before_s, progress):
        results = evaluate_tasks(run)
        accs = {task: res.accuracy for task, res in results.items()}
        acc = mean_over_tasks(accs)
        line.update(eval_accuracy=acc, eval=accs, **eval_fields(run, progress, r + 1, results))
        progress.last_accuracy = acc
        progress.best_accuracy = max(progress.best_accuracy or 0.0, acc)
        target = cfg.training.target_accuracy
        if target and acc >= target and progress.time_to_target_s is None:
            progress.time_to_target_s = progress.sim_time_s
    return line


def _crossed_budget(cfg: ExperimentConfig, before_s: float, after_s: float) -> bool:
    """This round spent the time budget: the run's last round, evaluated so that every run
    has an evaluation at the common budget."""
    budget = cfg.training.time_budget_s
    return bool(budget) and before_s < budget <= after_s


def _eval_due_s(cfg: ExperimentConfig, before_s: float, progress: Progress) -> bool:
    """training.eval_every_s: this round's clock passed a multiple of it."""
    every = cfg.training.eval_every_s
    return bool(every) and math.floor(progress.sim_time_s / every) > math.floor(before_s / every)


def _one_round(run: Run, plan: RoundPlan, progress: Progress) -> dict[str, Any]:
    line = round_header(plan)
    train_loss: float | None = None
    if plan.tasks:
        states, losses = train_participants(run, plan)
        apply_aggregate(run, plan, to_numpy(run.lora.global_state()), states)
        train_loss = float(losses.mean())
    else:
        progress.empty_rounds += 1
    return close_round(run, plan, progress, line, train_loss)


def describe(summary: dict[str, Any]) -> str:
    """A few lines for the terminal."""

    def pct(x: float | None) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"

    lines = [
        f"rounds: {summary['rounds']} ({summary['stop_reason']}), "
        f"simulated wall-clock: {summary['sim_time_s']:.1f} s, compute: {summary['compute_s']:.0f} s",
        f"accuracy: {pct(summary['initial_accuracy'])} before -> {pct(summary['final_accuracy'])} "
        f"final (best {pct(summary['best_accuracy'])})",
        f"uplink: {summary['total_uplink_bits'] / 8e6:.1f} MB, empty rounds: {summary['empty_rounds']}",
    ]
    if summary.get("target_accuracy"):
        ttt = summary["time_to_target_s"]
        lines.append(
            f"time to {pct(summary['target_accuracy'])}: "
            + ("not reached" if ttt is None else f"{ttt:.1f} s")
        )
    lines.extend(describe_eval(summary))
    return "\n".join(lines)


def describe_eval(summary: dict[str, Any]) -> list[str]:
    """Per eval task: accuracy before -> after with 95% Wilson intervals beside the
    most-frequent-label and chance scores; eval_loss before -> after (and its target)."""

    def acc(d: dict[str, Any]) -> str:
        lo, hi = d["ci95"]
        return f"{100 * d['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"

    before, after = summary.get("initial_eval") or {}, summary.get("final_eval") or {}
    lines = []
    for task, d in after.items():
        b = before.get(task)
        loss_before = f"{b['loss']:.4f} -> " if b else ""
        lines.append(
            f"{task} (n = {d['n']}): accuracy {acc(b) + ' -> ' if b else ''}{acc(d)}; "
            f"most-frequent label {100 * d['majority']:.1f}%, chance {100 * d['chance']:.1f}%; "
            f"eval_loss {loss_before}{d['loss']:.4f}"
        )
    if summary.get("target_loss"):
        ttl = summary.get("time_to_target_loss_s")
        lines.append(
            f"time to eval_loss <= {summary['target_loss']:g}: "
            + ("not reached" if ttl is None else f"{ttl:.1f} s")
        )
    return lines


# Names before issue 11 (code in flight may still use them; remove once none does).
_to_numpy = to_numpy
_to_torch = to_torch
_mean = mean_over_tasks
_checkpoint_state = checkpoint_state
_target_reached = target_reached
_target_loss_reached = target_loss_reached
