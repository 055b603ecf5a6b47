"""Federated methods: one short file each, the same verbs (see `base.Method`).

`make_method(cfg, a, rng)` builds the method named by ``cfg.method.name``.
"""

from __future__ import annotations

import numpy as np

from fedlora.config import ExperimentConfig
from fedlora.errors import ConfigError
from fedlora.federation.methods.base import Aggregation, ClientTask, Method, Payload, RoundPlan
from fedlora.federation.methods.fedavg import FedAvg
from fedlora.federation.methods.fedstacklora import FedStackLoRA
from fedlora.federation.methods.flexlora import FlexLoRA
from fedlora.federation.methods.fslora import FSLoRA
from fedlora.federation.methods.heterolora import HeteroLoRA
from fedlora.federation.methods.proposed import Plan, Proposed, plan_file
from fedlora.federation.methods.ranks import resolve_ranks
from fedlora.federation.methods.sketched import Sketched
from fedlora.federation.methods.strategies import resolve_k, resolve_q

__all__ = ["Aggregation", "ClientTask", "Method", "Payload", "Plan", "RoundPlan", "make_method"]


def make_method(
    cfg: ExperimentConfig,
    a: np.ndarray,
    rng: np.random.Generator,
    *,
    tau_full_s: np.ndarray | None = None,
    plan: Plan | None = None,
) -> Method:
    """The method of ``cfg.method.name`` for clients with data weights `a`.

    `rng` draws strategy-based k vectors (seeded by the run, so they are reproducible).
    `tau_full_s` (the clients' profiles) gives ``method.ranks = "capability"``; without it the
    profiles are rebuilt from the config (their compute times do not depend on the model).
    `plan` (Algorithm 2's, `fedlora.studies.calibration`) gives `proposed` its q and k;
    without one, method.q and method.k must name one plan file.
    """
    m, gamma = cfg.method, cfg.lora.rank
    if m.name in BASELINES:
        if tau_full_s is None and m.ranks == "capability":
            tau_full_s = _profile_tau(cfg)
        ranks = resolve_ranks(m.ranks, n=a.size, gamma=gamma, rng=rng, tau_full_s=tau_full_s)
        per_round = m.clients_per_round
        if m.name == "fslora":
            if m.fslora_k == "reference":  # FSLoRA's code: k_n uniform on [4, γ] (γ < 4: γ)
                ranks = rng.integers(min(4, gamma), gamma + 1, size=a.size)
            return FSLoRA(k=ranks, gamma=gamma, clients_per_round=per_round)
        if m.name == "heterolora":
            return HeteroLoRA(
                a=a,
                ranks=ranks,
                gamma=gamma,
                clients_per_round=per_round,
                pruning=m.heterolora_pruning,
            )
        if m.name == "flexlora":
            return FlexLoRA(
                a=a,
                ranks=ranks,
                gamma=gamma,
                clients_per_round=per_round,
                seed=cfg.training.seed,
            )
        return FedStackLoRA(
            a=a,
            ranks=ranks,
            gamma=gamma,
            scaling=cfg.lora.alpha / gamma,
            seed=cfg.training.seed,
            clients_per_round=per_round,
        )
    if m.name == "proposed":  # q, k from the plan, or from the plan file in method.q/k
        q_spec, k_spec = (list(plan.q), list(plan.k)) if plan is not None else (m.q, m.k)
        if plan is None and not plan_file(m):
            raise ConfigError(
                f"method.name = 'proposed' with method.q = {m.q!r}, method.k = {m.k!r} needs "
                "Algorithm 2's plan: run it with `fedlora run` / `fedlora compare`, or set "
                "method.q and method.k to one plan JSON file"
            )
        q = resolve_q(q_spec, a=a, q_fixed=m.q_fixed)
        k = resolve_k(k_spec, n=a.size, gamma=gamma, rng=rng)
        method = Proposed(a=a, q=q, k=k, gamma=gamma)
        method.in_run = plan is not None and plan.in_run
        return method
    if m.name == "sketched":
        q = resolve_q(m.q, a=a, q_fixed=m.q_fixed)
        k = resolve_k(m.k, n=a.size, gamma=gamma, rng=rng)
        return Sketched(a=a, q=q, k=k, gamma=gamma)
    if m.name == "fedavg":
        return FedAvg(a=a, gamma=gamma, clients_per_round=m.clients_per_round)
    raise ConfigError(f"method.name = {m.name!r} is not available yet in this build")


BASELINES = ("fslora", "heterolora", "fedstacklora", "flexlora")


def _profile_tau(cfg: ExperimentConfig) -> np.ndarray:
    """The clients' compute times τ_n as the engine builds them (independent of payload bits)."""
    from fedlora.federation.profiles import build_profiles

    return build_profiles(cfg, full_payload_bits=1.0).tau_full_s
