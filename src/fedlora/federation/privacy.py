"""Client-level differential privacy of a run (docs/privacy.md): the round's steps that ask
the run's privacy mechanism (`fedlora.federation.privacy_mechanisms`; none of them is named
here).

`make_privacy` attaches the mechanism of ``privacy.mode`` (with its ``privacy.clipping`` rule)
to a method as ``method.privacy``; a method's `server_step` calls its ``clip`` before and its
``noise`` after `aggregate`. Around each round:

    prepare_round  the clipping rule's state as the last round left it (a resume)
    budget_stop    whether the next round would take a client's ε past planner.max_epsilon
    spent_rdp      the RDP every client has spent so far (an in-run plan keeps the rest)
    account_round  the round in the run's `PrivacyLedger` (kept in `Progress`, so checkpoints
                   carry it; rounds the ledger misses were released without noise) and the
                   metrics line's fields the mechanism names (`log_fields`): ``epsilon``
                   (every client's ε(δ) after the round), the norms ‖w_n Δ_n‖ the round's
                   `clip` saw before clipping (``dp_update_norms``, their median
                   ``dp_update_norm_median``, the share above C ``dp_clipped_fraction``) and
                   the clipping rule's own (adaptive: ``dp_clip``, ``dp_unclipped_fraction``)
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.federation.privacy_mechanisms.base import (
    PrivacyMechanism,
    clip_fields,
    finite_or_none,
)
from fedlora.federation.privacy_mechanisms.registry import make_mechanism
from fedlora.system.privacy_ledger import PrivacyLedger

__all__ = [
    "account_round",
    "budget_stop",
    "clip_fields",
    "finite_or_none",
    "make_privacy",
    "rounds_epsilons",
    "spent_rdp",
]


def make_privacy(cfg: ExperimentConfig, method_cls: Any) -> PrivacyMechanism | None:
    """The run's privacy mechanism (`method_cls`: the class of ``method.name``), or None with
    ``privacy.mode = "none"``."""
    return make_mechanism(cfg, method_cls)


def restore_ledger(n_clients: int, sigma: float, progress: Any) -> PrivacyLedger:
    """The run's ledger from `progress` (``privacy_ledger``), with the rounds it misses (run
    with ``privacy.mode = "none"`` before a resume into DP) as rounds released without noise.
    `sigma`: the σ an older fedlora's ledger, which did not record it, was computed with."""
    ledger = PrivacyLedger.restore(
        n_clients, progress.privacy_ledger, legacy_sigma=sigma, legacy_rounds=progress.round
    )
    ledger.record_unprotected(progress.round - ledger.rounds)
    return ledger


def prepare_round(method: Any, progress: Any) -> None:
    """Before a round: the clipping rule's state as the last round left it (adaptive: its
    clip bound, after a resume)."""
    dp = getattr(method, "privacy", None)
    if dp is not None:
        dp.clipping.resume(progress)


def budget_stop(method: Any, progress: Any) -> str | None:
    """Why the run must stop before the next round: it would take some client's ε(δ) past
    its ``planner.max_epsilon`` (a mechanism that `accepts_budget`; the round at the method's
    current rates); None while every client stays within its budget, or without a budget."""
    dp = getattr(method, "privacy", None)
    if dp is None or not dp.budget:
        return None
    ledger = restore_ledger(dp.n_clients, dp.sigma, progress)
    dp.account(ledger, method, None)
    eps = ledger.epsilons(dp.delta)
    budgets = np.broadcast_to(np.asarray(dp.budget, dtype=float), (dp.n_clients,))
    over = [i for i in range(dp.n_clients) if not eps[i] <= budgets[i]]
    if not over:
        return None
    i = max(over, key=lambda j: eps[j] - budgets[j])
    return (
        f"privacy budget: round {progress.round + 1} would take client {i}'s ε(δ) to "
        f"{eps[i]:.4g} > planner.max_epsilon = {budgets[i]:g}; the run stops within it"
    )


def spent_rdp(method: Any, progress: Any) -> np.ndarray | None:
    """(N, orders) the RDP every client has spent in the rounds so far (the run's ledger in
    `progress`), for a plan that must keep what is left of planner.max_epsilon; None without
    a mechanism that accepts a budget, or without a budget."""
    dp = getattr(method, "privacy", None)
    if dp is None or not dp.budget or not dp.accepts_budget:
        return None
    return restore_ledger(dp.n_clients, dp.sigma, progress).rdp()


def account_round(method: Any, sent: Any, progress: Any) -> dict[str, Any]:
    """After a round: the round in the ledger of `progress` (``privacy_ledger``) and the
    metrics line's fields (the mechanism's `round_fields`; ``epsilon`` is null where it is
    not finite: σ = 0, or rounds released without noise), the clipping rule's state in
    `progress`. `sent`: the plan of the tasks whose updates arrived. {} without privacy."""
    dp = getattr(method, "privacy", None)
    if dp is None:
        return {}
    ledger = restore_ledger(dp.n_clients, dp.sigma, progress)
    dp.account(ledger, method, sent)
    progress.privacy_ledger = ledger.to_dict()
    norms, dp.norms = dp.norms, []  # this round's, and none carried to the next
    fields = dp.round_fields(ledger, method, norms)
    dp.clipping.save(progress)
    return fields


def rounds_epsilons(
    cfg: ExperimentConfig, method_cls: Any, rates: list[float]
) -> list[float] | None:
    """Every client's ε(privacy.delta) after rounds at the sampling rates `rates` (one q for
    every client per round), accounted as the run's mechanism would (its `account` into a
    fresh `PrivacyLedger`); None without a mechanism that accepts a budget."""
    dp = make_privacy(cfg, method_cls)
    if dp is None or not dp.accepts_budget:
        return None
    ledger = PrivacyLedger(dp.n_clients)
    for q in rates:
        dp.account(ledger, SimpleNamespace(q=np.full(dp.n_clients, float(q))), None)
    return ledger.epsilons(dp.delta)
