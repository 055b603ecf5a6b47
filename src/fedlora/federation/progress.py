"""What a run's loop carries from round to round (`Progress`, saved in checkpoints), its stop
rules, its progress display, and the summary it ends with (summary.json, the terminal lines)."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.federation.privacy import restore_ledger
from fedlora.federation.privacy_mechanisms.base import finite_or_none
from fedlora.federation.privacy_mechanisms.registry import clipping_class


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
    initial_mc_loss: float | None = None  # mean over tasks of mc_loss
    last_mc_loss: float | None = None
    best_mc_loss: float | None = None
    time_to_target_mc_loss_s: float | None = None
    train_lengths: dict[str, Any] | None = None  # harness: training tokens p50/p99, dropped
    initial_eval: dict[str, Any] | None = None  # per task: accuracy, ci95, n, majority, ...
    # per task, the untrained adapter's correctness on each question (0/1): the paired
    # comparison of the final evaluation with round 0 (gain, McNemar p) needs it
    initial_correct: dict[str, list[int]] | None = None
    last_paired: dict[str, Any] | None = None  # per task: paired_change(round 0, last)
    last_eval: dict[str, Any] | None = None
    # where training's clock started: a calibration's simulated time (0 without one); the
    # eval_every_s grid is laid from here, so that every method's evaluations fall at the
    # same times after its start
    clock_start_s: float = 0.0
    # privacy.mode set: every client's privacy events and the rounds' settings so far
    # (fedlora.system.privacy_ledger; a list from an older fedlora)
    privacy_ledger: dict | list | None = None
    # a clipping rule that moves the bound (adaptive): the one the next round uses
    dp_clip_norm: float | None = None
    # `local`: the last evaluation's per-client accuracies and their spread
    # (fedlora.federation.client_eval.client_fields)
    last_clients: dict[str, Any] | None = None


class Reporter:
    """A progress bar, or plain log lines with --quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.bar = None

    def start(self, total: int, initial: int) -> None:
        """Rounds `initial` (done before a resume) to `total`."""
        if not self.quiet:
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
            "mc_loss": "-" if progress.last_mc_loss is None else f"{progress.last_mc_loss:.3f}",
        }
        if line.get("epsilon"):  # privacy: the largest client ε so far
            text["eps"] = _largest(line["epsilon"])
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


def stop_before_round(cfg: ExperimentConfig, progress: Progress) -> str | None:
    """The reason to stop before the next round (target reached, time budget spent), if any."""
    if target_reached(cfg, progress):
        return "target_accuracy"
    if target_loss_reached(cfg, progress):
        return "target_loss"
    if target_mc_loss_reached(cfg, progress):
        return "target_mc_loss"
    budget = cfg.training.time_budget_s
    if budget and progress.sim_time_s >= budget:
        return "time_budget"
    if accuracy_fell(cfg, progress):
        return ACCURACY_DROP
    return None


ACCURACY_DROP = "accuracy_drop"  # the stop reason of training.stop_accuracy_drop
# accuracies are counts over questions: a drop of exactly training.stop_accuracy_drop (its
# float round-off included) does not stop the run; only one of more than it
DROP_TOLERANCE = 1e-9


def accuracy_fell(cfg: ExperimentConfig, progress: Progress) -> bool:
    """The last evaluation's mean accuracy is more than training.stop_accuracy_drop below
    round 0's (never when the setting is 0 or either evaluation is missing)."""
    drop = cfg.training.stop_accuracy_drop
    first, last = progress.initial_accuracy, progress.last_accuracy
    if not drop or first is None or last is None:
        return False
    return first - last > drop + DROP_TOLERANCE


def target_reached(cfg: ExperimentConfig, progress: Progress) -> bool:
    target = cfg.training.target_accuracy
    return bool(target) and progress.last_accuracy is not None and progress.last_accuracy >= target


def target_loss_reached(cfg: ExperimentConfig, progress: Progress) -> bool:
    target = cfg.training.target_loss
    return (
        bool(target) and progress.last_eval_loss is not None and progress.last_eval_loss <= target
    )


def target_mc_loss_reached(cfg: ExperimentConfig, progress: Progress) -> bool:
    target = cfg.training.target_mc_loss
    return bool(target) and progress.last_mc_loss is not None and progress.last_mc_loss <= target


def end_reason(cfg: ExperimentConfig, progress: Progress) -> str:
    """The stop reason of a run that used all its rounds: a target its last evaluation
    reached, else max_rounds."""
    for reason, reached in (
        ("target_accuracy", target_reached),
        ("target_loss", target_loss_reached),
        ("target_mc_loss", target_mc_loss_reached),
    ):
        if reached(cfg, progress):
            return reason
    return "max_rounds"


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
        "initial_mc_loss": progress.initial_mc_loss,
        "final_mc_loss": progress.last_mc_loss,
        "best_mc_loss": progress.best_mc_loss,
        "target_mc_loss": cfg.training.target_mc_loss or None,
        "time_to_target_mc_loss_s": progress.time_to_target_mc_loss_s,
        "train_lengths": progress.train_lengths,
        "initial_eval": progress.initial_eval,
        "final_eval": progress.last_eval,
        "paired_eval": progress.last_paired,  # per task: gain, its interval, McNemar p
        "wall_s": time.perf_counter() - wall_start,
        "method": cfg.method.name,
        "seed": cfg.training.seed,
        **_privacy_summary(cfg, progress),
        **({"clients": progress.last_clients} if progress.last_clients else {}),
    }


def _privacy_summary(cfg: ExperimentConfig, progress: Progress) -> dict[str, Any]:
    """summary.json's ``privacy``: the settings, every client's final ε(δ) composed over the
    rounds as they ran (null: not finite), the largest (``largest_epsilon``: spent) beside
    the budget (``epsilon_budget``: planner.max_epsilon, null without one), the rounds
    released without noise and the ledger's ``history`` of settings; nothing without
    privacy."""
    p = cfg.privacy
    if not p.enabled:
        return {}
    ledger = restore_ledger(cfg.data.n_clients, p.noise_multiplier, progress)
    eps = finite_or_none(ledger.epsilons(p.delta))
    budget = cfg.planner.max_epsilon
    out = {
        "mode": p.mode,
        "clipping": p.clipping,
        "clip_norm": p.clip_norm,
        "noise_multiplier": p.noise_multiplier,
        "delta": p.delta,
        "epsilon": eps,
        "largest_epsilon": None if None in eps else max(eps, default=0.0),
        "epsilon_budget": (list(budget) if isinstance(budget, tuple) else budget) or None,
        "unprotected_rounds": ledger.unprotected_rounds,
        "history": ledger.segments,
    }
    out.update(clipping_class(p.clipping).summary_fields(cfg, progress))  # adaptive's C, σ_Δ
    return {"privacy": out}


def _largest(eps: list[float | None]) -> str:
    return "inf" if None in eps else f"{max(eps):.2f}"


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
    if summary.get("privacy"):
        lines.append(_describe_privacy(summary["privacy"]))
    for task, s in ((summary.get("clients") or {}).get("spread") or {}).items():
        lines.append(
            f"{task} over the clients' own adapters: mean {pct(s['mean'])}, sd "
            f"{100 * s['sd']:.1f} points, best client {s['best_client']} {pct(s['max'])}, "
            f"worst client {s['worst_client']} {pct(s['min'])}"
        )
    lines.extend(describe_eval(summary))
    return "\n".join(lines)


def _describe_privacy(p: dict[str, Any]) -> str:
    """The privacy line: the settings, the largest client ε (and whose), the median, the
    budget; why ε is infinite when it is."""
    eps = p["epsilon"]
    text = f"privacy: {p['mode']}, σ = {p['noise_multiplier']:g}, clip {p['clip_norm']:g}, "
    if None in eps or not eps:
        return text + f"δ = {p['delta']:g}: ε = inf ({_why_infinite(p)})"
    worst = int(np.argmax(eps))
    budget = p.get("epsilon_budget")
    within = ""
    if budget is not None:
        b = budget[worst] if isinstance(budget, list) else budget
        within = f" (budget planner.max_epsilon = {b:g})"
    return text + (
        f"δ = {p['delta']:g}: ε max {eps[worst]:.3g} (client {worst}){within}, "
        f"median {float(np.median(eps)):.3g}"
    )


def _why_infinite(p: dict[str, Any]) -> str:
    """The rounds that released without noise, or σ = 0."""
    bare = [s["rounds"] for s in p.get("history") or [] if s["mode"] == "none"]
    if bare:
        spans = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in bare)
        return f"rounds {spans} released the adapter without noise (privacy.mode = 'none')"
    return "σ = 0: no guarantee"


def _known(x: Any) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def describe_eval(summary: dict[str, Any]) -> list[str]:
    """Per eval task: accuracy (and acc_norm in the harness format) before -> after with 95%
    Wilson intervals beside the most-frequent-label and chance scores; mc_loss before ->
    after with its interval and chance; eval_loss before -> after; the targets."""

    def acc(d: dict[str, Any], key: str = "accuracy", ci: str = "ci95") -> str:
        lo, hi = d[ci]
        return f"{100 * d[key]:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"

    def mc(d: dict[str, Any]) -> str:
        lo, hi = d["mc_loss_ci95"]
        return f"{d['mc_loss']:.4f} [{lo:.4f}, {hi:.4f}]"

    def norm(d: dict[str, Any]) -> str:
        return acc(d, "acc_norm", "acc_norm_ci95")

    def loss(d: dict[str, Any]) -> str:
        return f"{d['loss']:.4f}"

    def change(b: dict[str, Any] | None, d: dict[str, Any], show: Any, key: str = "loss") -> str:
        return f"{show(b)} -> {show(d)}" if b and _known(b.get(key)) else show(d)

    before, after = summary.get("initial_eval") or {}, summary.get("final_eval") or {}
    lines = []
    if summary.get("train_lengths"):
        t = summary["train_lengths"]
        lines.append(
            f"training examples (harness format): {t['n'] - t['dropped']} of {t['n']} "
            f"(dropped {t['dropped']} > {t['max_len']} tokens); tokens p99 {t['p99']:.0f}"
        )
    for task, d in after.items():
        b = before.get(task)
        fmt = d.get("format", "llm-adapters")
        text = (
            f"{task} (n = {d['n']}) in the {fmt} format: accuracy {change(b, d, acc, 'accuracy')}"
        )
        if _known(d.get("acc_norm")):
            text += f"; acc_norm {change(b, d, norm, 'acc_norm')}"
        text += f"; most-frequent label {100 * d['majority']:.1f}%, chance {100 * d['chance']:.1f}%"
        if _known(d.get("mc_loss")):
            text += f"; mc_loss {change(b, d, mc, 'mc_loss')} (chance {d['mc_chance']:.4f})"
        text += f"; eval_loss {change(b, d, loss)}"
        lines.append(text)
        pair = (summary.get("paired_eval") or {}).get(task)
        if pair:
            lo, hi = pair["gain_ci95"]
            lines.append(
                f"  {task} paired on the same {d['n']} questions: {100 * pair['gain']:+.1f} points "
                f"[{100 * lo:+.1f}, {100 * hi:+.1f}], {pair['gained']} gained / {pair['lost']} "
                f"lost, exact McNemar p = {pair['mcnemar_p']:.2g}"
            )
    for key, name in (("loss", "eval_loss"), ("mc_loss", "mc_loss")):
        if summary.get(f"target_{key}"):
            ttl = summary.get(f"time_to_target_{key}_s")
            lines.append(
                f"time to {name} <= {summary[f'target_{key}']:g}: "
                + ("not reached" if ttl is None else f"{ttl:.1f} s")
            )
    return lines
