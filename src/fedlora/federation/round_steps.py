"""The steps of one round that the round loop (`fedlora.federation.engine`) composes around
the training: the metrics line's header, the method's aggregate made the global adapter,
the clock advanced by who actually sent (`fedlora.federation.clock`) and the evaluation
schedule (every E rounds, every `training.eval_every_s` of simulated time, at the round that
spends the time budget, at the last round)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.federation.client_eval import evaluate_clients
from fedlora.federation.clock import round_cost
from fedlora.federation.methods.base import RoundPlan
from fedlora.federation.progress import Progress
from fedlora.federation.runstate import Run, to_torch
from fedlora.federation.scoring import eval_fields, evaluate_tasks, mean_over_tasks

__all__ = ["round_header", "apply_aggregate", "close_round", "evaluate_global"]


def round_header(plan: RoundPlan) -> dict[str, Any]:
    """The first fields of a round's metrics line: who was asked to train, with which k (and,
    for tasks of their own length, how many local steps)."""
    line = {
        "round": plan.round + 1,
        "participants": plan.participants,
        "n_participants": len(plan.tasks),
        "k": [t.rank_used for t in plan.tasks],
    }
    if any(t.steps for t in plan.tasks):  # tasks of their own length (`centralized`)
        line["steps"] = [t.steps for t in plan.tasks]
    return line


def apply_aggregate(
    run: Run, plan: RoundPlan, global_state: dict[str, np.ndarray], states: list
) -> None:
    """The method's aggregate becomes the global adapter (and, for FedStackLoRA, the base)."""
    agg = run.method.server_step(global_state, plan, states)  # aggregate + server optimizer
    if run.memory:  # clients keep a part (FedSA-LoRA's B): evaluate with its mean Σ a_n X_n
        agg.global_state = {**agg.global_state, **run.memory.mean(run.fed.a)}
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
    cost = round_cost(
        run.profiles,
        cost_plan,
        run.method,
        run.shapes,
        r,
        net=cfg.network,
        gamma=cfg.lora.rank,
        seed=cfg.training.seed,
        local_steps=cfg.training.local_steps,
    )
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
        line.update(evaluate_global(run, progress, r + 1))
        target = cfg.training.target_accuracy
        if target and progress.last_accuracy >= target and progress.time_to_target_s is None:
            progress.time_to_target_s = progress.sim_time_s
    return line


def evaluate_global(run: Run, progress: Progress, round_no: int) -> dict[str, Any]:
    """Evaluate the global adapter (or, for `local`, every client's own adapter and their mean:
    `fedlora.federation.client_eval`): its metrics-line fields (accuracy per task and mean,
    eval_loss, intervals), with the accuracy's initial/last/best kept in `progress`."""
    clients: dict[str, Any] = {}
    if run.method.evaluates_clients:
        results, clients = evaluate_clients(run)
        progress.last_clients = clients
    else:
        results = evaluate_tasks(run)
    accs = {task: res.accuracy for task, res in results.items()}
    acc = mean_over_tasks(accs)
    if progress.initial_accuracy is None:
        progress.initial_accuracy = acc
    progress.last_accuracy = acc
    progress.best_accuracy = max(progress.best_accuracy or 0.0, acc)
    fields = eval_fields(run, progress, round_no, results, predictions=not clients)
    if clients:  # each client's accuracy, their spread, best and worst
        fields.update(eval_clients=clients["accuracy"], eval_clients_spread=clients["spread"])
    return {"eval_accuracy": acc, "eval": accs, **fields}


def _crossed_budget(cfg: ExperimentConfig, before_s: float, after_s: float) -> bool:
    """This round spent the time budget: the run's last round, evaluated so that every run
    has an evaluation at the common budget."""
    budget = cfg.training.time_budget_s
    return bool(budget) and before_s < budget <= after_s


def _eval_due_s(cfg: ExperimentConfig, before_s: float, progress: Progress) -> bool:
    """training.eval_every_s: this round's clock passed a multiple of it, counted from the
    clock's start (after a calibration, whose time would otherwise shift the grid)."""
    every = cfg.training.eval_every_s
    start = progress.clock_start_s
    return bool(every) and (
        math.floor((progress.sim_time_s - start) / every) > math.floor((before_s - start) / every)
    )
