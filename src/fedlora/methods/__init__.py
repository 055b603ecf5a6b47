"""Federated methods: one short file each, the same verbs (see `base.Method`).

`make_method(cfg, a, rng)` builds the method named by ``cfg.method.name``.
"""

from __future__ import annotations

import numpy as np

from fedlora.config import ExperimentConfig
from fedlora.errors import ConfigError
from fedlora.methods.base import Aggregation, ClientTask, Method, Payload, RoundPlan
from fedlora.methods.fedavg import FedAvg
from fedlora.methods.sketched import Sketched
from fedlora.methods.strategies import resolve_k, resolve_q

__all__ = ["Aggregation", "ClientTask", "Method", "Payload", "RoundPlan", "make_method"]


def make_method(cfg: ExperimentConfig, a: np.ndarray, rng: np.random.Generator) -> Method:
    """The method of ``cfg.method.name`` for clients with data weights `a`.

    `rng` draws strategy-based k vectors (seeded by the run, so they are reproducible).
    """
    m, gamma = cfg.method, cfg.lora.rank
    if m.name == "sketched":
        q = resolve_q(m.q, a=a, q_fixed=m.q_fixed)
        k = resolve_k(m.k, n=a.size, gamma=gamma, rng=rng)
        return Sketched(a=a, q=q, k=k, gamma=gamma)
    if m.name == "fedavg":
        return FedAvg(a=a, gamma=gamma, clients_per_round=m.clients_per_round)
    raise ConfigError(f"method.name = {m.name!r} is not available yet in this build")
