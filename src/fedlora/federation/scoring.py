"""Evaluation of the global adapter during a run: accuracy, eval_loss and mc_loss per eval
task (in the run's evaluation.format), the metrics-line fields they give, and the
per-question predictions file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.errors import DataError
from fedlora.federation.progress import Progress
from fedlora.federation.runstate import Run
from fedlora.files import atomic_write
from fedlora.llm.eval_stats import paired_change


def evaluate_tasks(run: Run) -> dict[str, Any]:
    """The current global adapter on every eval task's fixed subset: task -> EvalResult."""
    import torch

    from fedlora.llm.evaluation import eval_cache_for, evaluate

    ecfg = run.cfg.evaluation
    run.lora.set_clients(torch.ones(1, run.cfg.lora.rank))  # slot 0 = the global adapter
    # lora.layers = K: the eval set's frozen lower layers once per run (same results), and on
    # disk (run.disk), shared with other runs of the same model
    cache = eval_cache_for(run.model, run.lora, ecfg.cache_mb, disk=run.disk)
    return {
        task: evaluate(
            run.model,
            run.tokenizer,
            examples,
            batch_size=ecfg.batch_size,
            scoring=ecfg.scoring,
            task=task,
            cache=cache,
            fmt=ecfg.format,  # the format the run trains in (resolved by load_trainable)
        )
        for task, examples in run.fed.eval_sets.items()
    }


PREDICTIONS_FILE = "predictions.jsonl"


def write_predictions(run_dir: Path, round_index: int, results: dict[str, Any]) -> None:
    """One line per task of this evaluation in predictions.jsonl: question ids, predicted
    label index, correct (0/1; in the harness format also `correct_norm`, under acc_norm), NLL and
    mc_loss per question. Lines of this or later rounds (left by
    an interrupted run that is being resumed) are replaced."""
    path = run_dir / PREDICTIONS_FILE
    kept = []
    if path.exists():
        for raw in _read_predictions(path):
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
            "mc_loss": [round(x, 6) for x in r.mc],
            "format": r.fmt,
        }
        if r.correct_norm:  # the harness format: correct under lm-eval's acc_norm too
            line["correct_norm"] = [int(c) for c in r.correct_norm]
        kept.append(json.dumps(line))
    atomic_write(path, "".join(line + "\n" for line in kept).encode())


def _read_predictions(path: Path) -> list[str]:
    """The lines of predictions.jsonl; a DataError naming the file, the line and the remedy
    when it is not UTF-8 (fedlora writes it as ASCII JSON: someone else changed it)."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path} is not UTF-8 (line {line}, byte {e.object[e.start]:#04x}); fedlora writes "
            "it as JSON, so it was changed elsewhere: restore it, or move it away to resume "
            "without the earlier rounds' per-question predictions (metrics.jsonl keeps their "
            "scores)"
        ) from None


def check_predictions(run_dir: Path) -> None:
    """Refuse a resume whose predictions.jsonl cannot be read back, before any work is done
    (each evaluation rewrites the file from its earlier lines)."""
    path = Path(run_dir) / PREDICTIONS_FILE
    if path.exists():
        _read_predictions(path)


def eval_fields(
    run: Run,
    progress: Progress,
    round_index: int,
    results: dict[str, Any],
    *,
    predictions: bool = True,
) -> dict:
    """The metrics-line fields of an evaluation beside the accuracy (eval_loss, intervals,
    majority-label and chance scores, n); updates the loss in `progress` and writes the
    per-question predictions (unless `predictions` is False: results without per-question
    answers, the mean over `local`'s clients)."""
    loss = mean_over_tasks({t: r.loss for t, r in results.items()})
    if progress.initial_eval_loss is None:
        progress.initial_eval_loss = loss
    progress.last_eval_loss = loss
    best = progress.best_eval_loss
    progress.best_eval_loss = loss if best is None else min(best, loss)
    target = run.cfg.training.target_loss
    if target and loss <= target and progress.time_to_target_loss_s is None:
        progress.time_to_target_loss_s = progress.sim_time_s
    mc = mean_over_tasks({t: r.mc_loss for t, r in results.items()})
    if progress.initial_mc_loss is None:
        progress.initial_mc_loss = mc
        lengths = getattr(run.fed, "lengths", None)
        progress.train_lengths = None if lengths is None else dict(lengths.__dict__)
    progress.last_mc_loss = mc
    progress.best_mc_loss = mc if progress.best_mc_loss is None else min(progress.best_mc_loss, mc)
    target = run.cfg.training.target_mc_loss
    if target and mc <= target and progress.time_to_target_mc_loss_s is None:
        progress.time_to_target_mc_loss_s = progress.sim_time_s
    details = {
        t: {
            "accuracy": r.accuracy,
            "ci95": list(r.ci95),
            "n": r.n,
            "majority": r.majority,
            "chance": r.chance,
            "loss": r.loss,
            "loss_ci95": list(r.loss_ci95),
            "acc_norm": _or_none(r.acc_norm),  # None in the llm-adapters format
            "acc_norm_ci95": [_or_none(x) for x in r.acc_norm_ci95],
            "mc_loss": r.mc_loss,
            "mc_loss_ci95": list(r.mc_loss_ci95),
            "mc_chance": r.mc_chance,
            "format": r.fmt,
        }
        for t, r in results.items()
    }
    correct = {t: [int(c) for c in r.correct] for t, r in results.items()}
    if progress.initial_eval is None:
        progress.initial_eval = details
        progress.initial_correct = correct
    elif progress.initial_correct:  # later evaluations: paired with round 0's on each task
        progress.last_paired = {
            t: paired_change(progress.initial_correct[t], c)
            for t, c in correct.items()
            if c and len(progress.initial_correct.get(t, ())) == len(c)
        }
    progress.last_eval = details
    if run.cfg.evaluation.predictions and predictions:
        write_predictions(run.run_dir, round_index, results)
    response = instruct_fields(run)  # held-out instruction records: {} without them
    return {
        "eval_loss": loss,
        "eval_losses": {t: r.loss for t, r in results.items()},
        "eval_ci95": {t: list(r.ci95) for t, r in results.items()},
        "eval_n": {t: r.n for t, r in results.items()},
        "eval_majority": {t: r.majority for t, r in results.items()},
        "eval_chance": {t: r.chance for t, r in results.items()},
        "eval_scoring": next(iter(results.values())).scoring,  # acc with harness
        "eval_format": run.cfg.evaluation.format,
        "eval_acc_norm": {t: _or_none(r.acc_norm) for t, r in results.items()},
        "eval_mc_loss": mc,
        "eval_mc_losses": {t: r.mc_loss for t, r in results.items()},
        "eval_mc_loss_ci95": {t: list(r.mc_loss_ci95) for t, r in results.items()},
        "eval_mc_chance": {t: r.mc_chance for t, r in results.items()},
        **response,
    }


def instruct_fields(run: Run) -> dict[str, Any]:
    """``eval_response``: the held-out instruction sets' response loss and perplexity with
    their intervals (`fedlora.llm.instruct.response_loss`); {} when the run has none."""
    held_out = getattr(run.fed, "instruct_eval", None)
    if not held_out:
        return {}
    from fedlora.llm.instruct import response_fields

    return response_fields(
        run.model,
        run.tokenizer,
        held_out,
        max_len=run.cfg.data.max_seq_len,
        batch_size=run.cfg.evaluation.batch_size,
    )


def _or_none(x: float) -> float | None:
    """NaN (a metric the format does not define) as JSON null."""
    return None if math.isnan(x) else x


def mean_over_tasks(values: dict[str, float]) -> float:
    return float(np.mean(list(values.values())))
