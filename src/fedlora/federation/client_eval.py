"""Evaluation of every client's own adapter (`Method.evaluates_clients`: the `local`
reference): each client's adapter, kept in the run's client memory, on the same eval questions;
the mean over clients as the run's evaluation, and each client's accuracy with their spread,
best and worst on its metrics line and in summary.json.

Cost: one evaluation per client that has trained, plus one for the initial adapter that every
client that has not trained yet shares (round 0: one evaluation in all).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from fedlora.federation.runstate import Run, to_numpy, to_torch
from fedlora.federation.scoring import evaluate_tasks
from fedlora.llm.eval_stats import mean_interval

Results = dict[str, Any]  # task -> fedlora.llm.evaluation.EvalResult


def evaluate_clients(run: Run) -> tuple[Results, dict[str, Any]]:
    """Every client's adapter on every eval task: (task -> their mean as one result, the
    per-client fields `client_fields`). The global adapter is put back afterwards."""
    saved = to_numpy(run.lora.global_state())
    initial: Results | None = None  # shared by the clients that have not trained
    per_client: list[Results] = []
    try:
        for client in range(len(run.fed.client_indices)):
            if client in run.memory.kept:
                run.lora.load_global(to_torch(run.memory.restore(client)))
                per_client.append(evaluate_tasks(run))
                continue
            if initial is None:
                run.lora.load_global(to_torch(run.memory.initial))
                initial = evaluate_tasks(run)
            per_client.append(initial)
    finally:
        run.lora.load_global(to_torch(saved))
    mean = {task: mean_result([c[task] for c in per_client]) for task in per_client[0]}
    return mean, client_fields(per_client)


def mean_result(results: list[Any]) -> Any:
    """The mean over clients of their results on one task's questions, as one EvalResult:
    accuracy, acc_norm, eval_loss and mc_loss averaged over clients, with the normal 95%
    interval over questions of each question's mean over clients. No per-question answers
    (`correct`, `predictions` empty): the mean has none, so no predictions.jsonl line and no
    paired comparison with round 0. All clients sharing one result (round 0): that result's
    numbers and intervals unchanged."""
    first = results[0]
    clear = {"predictions": [], "correct": [], "correct_norm": []}
    if all(r is first for r in results):
        return replace(first, **clear)

    def per_question(attr: str) -> np.ndarray:
        return np.mean([np.asarray(getattr(r, attr), dtype=float) for r in results], axis=0)

    def interval(attr: str) -> tuple[float, float]:
        if not getattr(first, attr):
            return (float("nan"), float("nan"))
        return mean_interval(per_question(attr).tolist())[1]

    def mean_of(attr: str) -> float:
        return float(np.mean([getattr(r, attr) for r in results]))

    lo, hi = interval("correct")
    norm_lo, norm_hi = interval("correct_norm")
    return replace(
        first,
        accuracy=mean_of("accuracy"),
        ci95=(max(0.0, lo), min(1.0, hi)),
        seconds=float(sum(r.seconds for r in results)),
        loss=mean_of("loss"),
        loss_ci95=interval("nll"),
        acc_norm=mean_of("acc_norm"),
        acc_norm_ci95=(max(0.0, norm_lo), min(1.0, norm_hi)),
        mc_loss=mean_of("mc_loss"),
        mc_loss_ci95=interval("mc"),
        nll=per_question("nll").tolist(),
        mc=per_question("mc").tolist(),
        **clear,
    )


def client_fields(per_client: list[Results]) -> dict[str, Any]:
    """Per task: every client's accuracy (client order), their standard deviation, and the
    best and worst client (ties: the lowest index)."""
    accuracy = {t: [float(c[t].accuracy) for c in per_client] for t in per_client[0]}
    spread = {}
    for task, accs in accuracy.items():
        a = np.asarray(accs)
        best, worst = int(np.argmax(a)), int(np.argmin(a))
        spread[task] = {
            "mean": float(a.mean()),
            "sd": float(a.std(ddof=1)) if a.size > 1 else 0.0,
            "min": float(a[worst]),
            "max": float(a[best]),
            "best_client": best,
            "worst_client": worst,
        }
    return {"accuracy": accuracy, "spread": spread}
