"""The privacy trace of a run, as `fedlora report` draws it (privacy_trace.png): per round,
the largest client ε(δ) spent so far, and the clip bound C beside the participants' median
update norm ‖w_n Δ_n‖ before clipping. Adaptive clipping logs each round's C (`dp_clip`); a
fixed bound is the run's `privacy.clip_norm`. Read from metrics.jsonl and config.toml only.

An ε that is not finite (σ = 0, or rounds released without noise) is null in metrics.jsonl;
the largest ε of such a round is infinite and drawn as a gap, never as a number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.studies.figures import pyplot, save_figure
from fedlora.studies.runs import RunRecord

TRACE_FILE = "privacy_trace.png"


@dataclass(frozen=True)
class PrivacyTrace:
    """One run's rounds (1, 2, …) with, per round, the largest client ε(δ) so far (None:
    infinite), the clip bound C of the round and the participants' median update norm (None:
    no participant)."""

    rounds: list[int]
    largest_epsilon: list[float | None]
    clip: list[float | None]
    median_norm: list[float | None]


def largest_epsilon(epsilons: Sequence[float | None]) -> float | None:
    """The largest of every client's ε(δ); None (infinite) when any is null."""
    if any(e is None for e in epsilons):
        return None
    return max((float(e) for e in epsilons), default=0.0)


def privacy_trace(run: RunRecord) -> PrivacyTrace | None:
    """The trace of `run`, or None for a run without client-level DP (no round line carries
    ``epsilon``)."""
    lines = [x for x in run.lines if int(x.get("round", 0)) >= 1 and "epsilon" in x]
    if not lines:
        return None
    fixed = (run.config.get("privacy") or {}).get("clip_norm")
    return PrivacyTrace(
        rounds=[int(x["round"]) for x in lines],
        largest_epsilon=[largest_epsilon(x["epsilon"] or []) for x in lines],
        clip=[_number(x.get("dp_clip", fixed)) for x in lines],
        median_norm=[_number(x.get("dp_update_norm_median")) for x in lines],
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _nan(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]  # matplotlib leaves a gap at NaN


def plot_privacy(runs: Sequence[RunRecord], path: Path, title: str = "") -> Path | None:
    """Two panels: the largest client ε(δ) against the round, and C (solid) with the median
    update norm (dotted) on a log scale; one colour per label. None (nothing written) when no
    run used client-level DP."""
    traced = [(r, t) for r in runs if (t := privacy_trace(r)) is not None]
    if not traced:
        return None
    plt = pyplot()
    labels = list(dict.fromkeys(r.label for r, _ in traced))
    fig, (ax_eps, ax_clip) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    for run, trace in traced:
        color = plt.cm.tab10(labels.index(run.label) % 10)
        name = f"{run.label} seed {run.seed}"
        ax_eps.plot(trace.rounds, _nan(trace.largest_epsilon), color=color, label=name)
        ax_clip.plot(trace.rounds, _nan(trace.clip), color=color, label=f"{name}: C")
        ax_clip.plot(trace.rounds, _nan(trace.median_norm), color=color, linestyle=":")
    ax_eps.set_xlabel("round")
    ax_eps.set_ylabel("largest client ε(δ) so far")
    ax_eps.legend(fontsize=7)
    ax_clip.set_xlabel("round")
    ax_clip.set_ylabel("clip C (solid), median update norm (dotted)")
    if any(v is not None and v > 0 for _, t in traced for v in t.clip + t.median_norm):
        ax_clip.set_yscale("log")
    ax_clip.legend(fontsize=7)
    return save_figure(fig, path, title=title or "privacy: ε spent and the clip")
