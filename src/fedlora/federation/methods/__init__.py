"""Federated methods: one short file each, the same verbs (see `base.Method`).

Every module of this folder is imported here, so each method registers itself
(`registry.register_method`); third-party methods come from the ``fedlora.methods``
entry-point group. `make_method(cfg, a, rng)` builds the method named by ``cfg.method.name``.
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.federation.methods.base import Method, MethodContext
from fedlora.federation.methods.proposed import Plan
from fedlora.federation.methods.registry import check_method_config
from fedlora.federation.methods.server_opt import ServerOptimizer
from fedlora.federation.privacy import make_privacy

for _module in pkgutil.iter_modules(__path__):  # a method is one file: its decorator runs
    importlib.import_module(f"{__name__}.{_module.name}")


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
    `plan` (Algorithm 2's, `fedlora.federation.calibration`) gives `proposed` its q and k;
    without one, method.q and method.k must name one plan JSON file.
    """
    cls = check_method_config(cfg)
    if tau_full_s is None and cfg.method.ranks == "capability":
        from fedlora.federation.profiles import build_profiles

        # the clients' compute times as the engine builds them (independent of payload bits)
        tau_full_s = build_profiles(cfg, full_payload_bits=1.0).tau_full_s
    ctx = MethodContext(
        cfg, np.asarray(a), rng, tau_full_s=tau_full_s, plan=plan, options=cls.read_options(cfg)
    )
    method = cls.from_config(ctx)
    server_opt = ServerOptimizer.from_config(cfg.method)
    method.server_opt = None if server_opt.is_identity else server_opt
    method.privacy = make_privacy(cfg, cls)  # None unless privacy.mode is set
    return method
