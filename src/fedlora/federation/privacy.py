"""Client-level differential privacy on the adapter tensors (docs/privacy.md).

`ClientPrivacy` is what a method's `server_step` calls around its `aggregate` when
``privacy.mode`` is not "none" (`make_privacy` attaches it as ``method.privacy``):

    clip   each participant's update Δ_n = X_n − X on the factors it trains, weighted as the
           method aggregates it (w_n = a_n/q_n for independent sampling, 1/m for FSLoRA,
           a_n/Σ_K a for the normalised means), is scaled down to ‖w_n Δ_n‖ <= C; a state
           within the bound is passed on untouched (the same array), so a bound no update
           reaches changes nothing, bit for bit. "local": the participant then adds
           N(0, (σC)²) to w_n Δ_n on the components it sends.
    noise  "central": N(0, (σC)²) on every entry of the aggregated factors, once per round,
           also in a round without participants when clients are sampled independently
           (whether a round is empty depends on who was sampled).

The noise comes from the run's "privacy" stream (round r: (seed, privacy, r); a local
client's: (seed, privacy, r, n + 1)), so a resumed run draws the same noise; σ = 0 draws none.
`account_round` adds the round to every client's ledger (kept in `Progress`, so checkpoints
carry it) and returns the metrics line's ``epsilon``: every client's ε(δ) after the round,
with the norms ‖w_n Δ_n‖ the round's `clip` saw before clipping (``dp_update_norms``, their
median ``dp_update_norm_median`` and the share above C, ``dp_clipped_fraction``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.privacy_section import PRIVATE_SAMPLING
from fedlora.system.privacy import PrivacyLedger
from fedlora.system.seeding import derive_rng

Adapter = dict[str, np.ndarray]

# methods whose aggregate divides the data weights by their sum over the round's participants
NORMALISED = ("fedavg", "ffalora", "heterolora", "rolora", "fedsb")
DEFAULT_FACTORS = "AB"  # what a round without participants noises (independent sampling)


def factor_keys(state: Adapter, factors: str) -> list[str]:
    """The tensors of `factors` (letters of ``ABR``): every ``*.lora_A`` for "A", ..."""
    suffixes = tuple(f".lora_{f}" for f in factors)
    return [k for k in state if k.endswith(suffixes)]


def _component_mask(name: str, shape: tuple[int, ...], active: np.ndarray) -> np.ndarray:
    """1 on the entries of a LoRA tensor that a participant with active rank components
    `active` (γ,) bool sends: rows of A (γ, in), columns of B (out, γ), R (γ, γ) both."""
    a = active.astype(np.float64)
    if name.endswith(".lora_A"):
        return np.broadcast_to(a[:, None], shape)
    if name.endswith(".lora_B"):
        return np.broadcast_to(a[None, :], shape)
    return np.broadcast_to(np.outer(a, a), shape)


class ClientPrivacy:
    """Clipping and Gaussian noise of one run (see the module docstring)."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        p = cfg.privacy
        self.mode = p.mode
        self.clip_norm = float(p.clip_norm)
        self.sigma = float(p.noise_multiplier)
        self.delta = float(p.delta)
        self.seed = cfg.training.seed
        self.n_clients = cfg.data.n_clients
        self.method = cfg.method.name
        self.sampling = PRIVATE_SAMPLING[cfg.method.name]
        m = cfg.method.clients_per_round
        self.uniform_rate = 1.0 if m == 0 else m / self.n_clients
        self.norms: list[float] = []  # ‖w_n Δ_n‖ before clipping, of the round's last `clip`

    @property
    def noise_std(self) -> float:
        """σ·C: the standard deviation of the noise on the weighted sum (per client: local)."""
        return self.sigma * self.clip_norm

    def weights(self, plan: Any) -> np.ndarray:
        """w_n of the round's participants as the method's aggregate applies them."""
        w = np.array([t.weight for t in plan.tasks], dtype=float)
        return w / w.sum() if self.method in NORMALISED and w.size else w

    def clip(self, global_state: Adapter, plan: Any, states: list[Adapter]) -> list[Adapter]:
        """Each state with its weighted update clipped to C (and, local, noised); the norms
        before clipping are kept in `norms` for the round's metrics line."""
        out = []
        self.norms = []
        for task, w, state in zip(plan.tasks, self.weights(plan), states):
            keys = factor_keys(global_state, task.trains)
            delta = {k: state[k].astype(np.float64) - global_state[k] for k in keys}
            norm = w * math.sqrt(sum(float(np.sum(d * d)) for d in delta.values()))
            self.norms.append(float(norm))
            scale = self.clip_norm / norm if norm > self.clip_norm else 1.0
            if scale == 1.0 and not (self.mode == "local" and self.sigma > 0):
                out.append(state)  # within the bound: untouched
                continue
            if self.mode == "local" and self.sigma > 0:
                rng = derive_rng(self.seed, "privacy", plan.round, task.client + 1)
                active = np.asarray(task.scale) != 0
                for k in keys:
                    noise = rng.normal(0.0, self.noise_std, size=delta[k].shape)
                    mask = _component_mask(k, delta[k].shape, active)
                    delta[k] = scale * delta[k] + mask * noise / w
            else:
                delta = {k: scale * d for k, d in delta.items()}
            new = dict(state)
            for k in keys:
                new[k] = (global_state[k] + delta[k]).astype(state[k].dtype)
            out.append(new)
        return out

    def noise(self, global_state: Adapter, new_state: Adapter, plan: Any) -> Adapter:
        """ "central": the aggregate plus N(0, (σC)²) on every entry of the factors the round
        aggregates; otherwise (or σ = 0) `new_state` itself."""
        if self.mode != "central" or self.sigma == 0:
            return new_state
        factors = "".join(sorted({f for t in plan.tasks for f in t.trains})) or DEFAULT_FACTORS
        rng = derive_rng(self.seed, "privacy", plan.round)
        out = dict(new_state)
        for k in sorted(factor_keys(global_state, factors)):
            x = new_state[k]
            out[k] = (x + rng.normal(0.0, self.noise_std, size=x.shape)).astype(x.dtype)
        return out

    def noise_alone(self, trained: Any) -> bool:
        """True when a round whose aggregate has no update still needs the noise: central
        noise, σ > 0, clients sampled independently (a round may be empty by chance)."""
        empty = trained is None or not trained.states
        return (
            empty and self.mode == "central" and self.sigma > 0 and self.sampling == "independent"
        )

    def account(self, ledger: PrivacyLedger, method: Any, sent: Any) -> None:
        """The round in every exposed client's ledger: all clients at their q_n (independent)
        or m/N (uniform) in central mode; the clients that sent, in local mode."""
        if self.mode == "local":
            mask = np.zeros(self.n_clients, dtype=bool)
            mask[[t.client for t in sent.tasks]] = True
            ledger.record("local", np.ones(self.n_clients), mask)
        elif self.sampling == "independent":
            ledger.record("poisson", np.asarray(method.q, dtype=float))
        else:
            ledger.record("uniform", np.full(self.n_clients, self.uniform_rate))


def make_privacy(cfg: ExperimentConfig) -> ClientPrivacy | None:
    """The run's `ClientPrivacy`, or None with ``privacy.mode = "none"``."""
    return ClientPrivacy(cfg) if cfg.privacy.enabled else None


def account_round(method: Any, sent: Any, progress: Any) -> dict[str, Any]:
    """After a round: the round in the ledger of `progress` (``privacy_ledger``) and the
    metrics line's fields: ``epsilon`` (every client's ε(δ); null where it is not finite,
    σ = 0) and the clipping's (`clip_fields`). `sent`: the plan of the tasks whose updates
    arrived. {} without privacy."""
    dp = getattr(method, "privacy", None)
    if dp is None:
        return {}
    ledger = PrivacyLedger(dp.n_clients, progress.privacy_ledger)
    dp.account(ledger, method, sent)
    progress.privacy_ledger = ledger.to_list()
    norms, dp.norms = dp.norms, []  # this round's, and none carried to the next
    eps = finite_or_none(ledger.epsilons(dp.sigma, dp.delta))
    return {"epsilon": eps, **clip_fields(norms, dp.clip_norm)}


def clip_fields(norms: list[float], clip_norm: float) -> dict[str, Any]:
    """The metrics line's clipping fields of one round: ``dp_update_norms`` (every
    participant's ‖w_n Δ_n‖ before clipping, in the plan's order), ``dp_update_norm_median``
    (their median) and ``dp_clipped_fraction`` (the share above `clip_norm`, which were
    clipped); both null in a round without participants."""
    if not norms:
        return {"dp_update_norms": [], "dp_update_norm_median": None, "dp_clipped_fraction": None}
    return {
        "dp_update_norms": list(norms),
        "dp_update_norm_median": float(np.median(norms)),
        "dp_clipped_fraction": sum(n > clip_norm for n in norms) / len(norms),
    }


def finite_or_none(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]
