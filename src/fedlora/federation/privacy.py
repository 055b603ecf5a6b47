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

    adapt  ``privacy.clipping = "adaptive"`` (Andrew et al. 2021): C follows a target quantile
           of the norms ‖w_n Δ_n‖. Each round also releases the count of unclipped updates,
           Σ_n (b_n − 1/2) with b_n = 1[‖w_n Δ_n‖ <= C], plus N(0, σ_b²) (central: once, by
           the server, also in an empty round of independent sampling; local: each
           participant on its own bit); b̃ = that / E[m] + 1/2 moves C to C·exp(−η(b̃ − γ))
           for the next round. The sum's noise multiplier is σ_Δ = (z^-2 − (2σ_b)^-2)^-1/2
           (`fedlora.system.privacy.sum_noise_multiplier`), so the pair is accounted as one
           Gaussian mechanism at the configured z.

The noise comes from the run's "privacy" stream (round r: (seed, privacy, r); a local
client's: (seed, privacy, r, n + 1)), the count's from "privacy_count" (the same ids), so a
resumed run draws the same noise; σ = 0 draws none. `account_round` adds the round, with its
settings, to the run's `PrivacyLedger` (kept in `Progress`, so checkpoints carry it; rounds the
ledger misses were released without noise) and returns the metrics line's ``epsilon``: every
client's ε(δ) after the round, with the norms ‖w_n Δ_n‖ the round's `clip` saw before
clipping (``dp_update_norms``, their median ``dp_update_norm_median`` and the share above C,
``dp_clipped_fraction``) and, adaptive, ``dp_clip`` (the round's C) and
``dp_unclipped_fraction`` (b̃). `budget_stop` says when the next round would take a client's
ε past ``planner.max_epsilon``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.system.privacy import next_clip, sum_noise_multiplier
from fedlora.system.privacy_ledger import PrivacyLedger, RoundSetting
from fedlora.system.seeding import derive_rng

Adapter = dict[str, np.ndarray]

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
    """Clipping and Gaussian noise of one run (see the module docstring). `method_cls`: the
    class of ``method.name`` (`registry.method_class`), whose `dp_sampling` and
    `normalised_weights` say how its participants are sampled and weighted."""

    def __init__(self, cfg: ExperimentConfig, method_cls: Any) -> None:
        p = cfg.privacy
        self.mode = p.mode
        self.clip_norm = float(p.clip_norm)  # C of the round (adaptive: moves every round)
        self.sigma = float(p.noise_multiplier)  # z: the accounting's noise multiplier
        self.delta = float(p.delta)
        self.adaptive = p.clipping == "adaptive"
        self.count_noise = float(p.clip_count_noise)
        self.target_quantile = float(p.target_quantile)
        self.clip_lr = float(p.clip_learning_rate)
        # the sum's own multiplier: z itself, or what the count's release leaves of it
        self.sum_sigma = (
            sum_noise_multiplier(self.sigma, self.count_noise) if self.adaptive else self.sigma
        )
        self.budget = cfg.planner.max_epsilon
        self.count: float | None = None  # the round's noised Σ(b_n − 1/2); None: not released
        self.seed = cfg.training.seed
        self.n_clients = cfg.data.n_clients
        self.sampling = method_cls.dp_sampling
        self.normalised = bool(method_cls.normalised_weights)
        m = cfg.method.clients_per_round
        self.uniform_rate = 1.0 if m == 0 else m / self.n_clients
        self.norms: list[float] = []  # ‖w_n Δ_n‖ before clipping, of the round's last `clip`

    @property
    def noise_std(self) -> float:
        """σ·C: the standard deviation of the noise on the weighted sum (per client: local);
        adaptive: σ_Δ·C."""
        return self.sum_sigma * self.clip_norm

    @property
    def sampling_kind(self) -> str:
        """The kind of the round's privacy event (`fedlora.system.privacy`)."""
        return (
            "local"
            if self.mode == "local"
            else ("poisson" if self.sampling == "independent" else "uniform")
        )

    def setting(self) -> RoundSetting:
        """What the round releases under, for the ledger."""
        return RoundSetting(self.mode, self.sigma, self.clip_norm, self.sampling_kind)

    def weights(self, plan: Any) -> np.ndarray:
        """w_n of the round's participants as the method's aggregate applies them."""
        w = np.array([t.weight for t in plan.tasks], dtype=float)
        return w / w.sum() if self.normalised and w.size else w

    def clip(self, global_state: Adapter, plan: Any, states: list[Adapter]) -> list[Adapter]:
        """Each state with its weighted update clipped to C (and, local, noised); the norms
        before clipping are kept in `norms` for the round's metrics line."""
        out = []
        self.norms = []
        self.count = None
        for task, w, state in zip(plan.tasks, self.weights(plan), states):
            keys = factor_keys(global_state, task.trains)
            delta = {k: state[k].astype(np.float64) - global_state[k] for k in keys}
            norm = w * math.sqrt(sum(float(np.sum(d * d)) for d in delta.values()))
            self.norms.append(float(norm))
            if self.adaptive:
                self._count_bit(norm <= self.clip_norm, plan.round, task.client)
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

    def _count_bit(self, unclipped: bool, round_: int, client: int) -> None:
        """Adaptive: add b_n − 1/2 to the round's count; local: with the client's own noise."""
        bit = (1.0 if unclipped else 0.0) - 0.5
        if self.mode == "local":
            bit += derive_rng(self.seed, "privacy_count", round_, client + 1).normal(
                0.0, self.count_noise
            )
        self.count = (self.count or 0.0) + bit

    def noise(self, global_state: Adapter, new_state: Adapter, plan: Any) -> Adapter:
        """ "central": the aggregate plus N(0, (σC)²) on every entry of the factors the round
        aggregates (and, adaptive, the count's noise); otherwise (or σ = 0) `new_state`."""
        if self.mode == "central" and self.adaptive:
            rng = derive_rng(self.seed, "privacy_count", plan.round)
            self.count = (self.count or 0.0) + float(rng.normal(0.0, self.count_noise))
        if self.mode != "central" or self.sum_sigma == 0:
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
        """The round in the ledger, every exposed client's event: all clients at their q_n
        (independent) or m/N (uniform) in central mode; the clients that sent, in local."""
        if self.mode == "local":
            mask = np.zeros(self.n_clients, dtype=bool)
            mask[[t.client for t in sent.tasks]] = True
            ledger.record(self.setting(), "local", np.ones(self.n_clients), mask)
        elif self.sampling == "independent":
            ledger.record(self.setting(), "poisson", np.asarray(method.q, dtype=float))
        else:
            ledger.record(self.setting(), "uniform", np.full(self.n_clients, self.uniform_rate))

    def expected_participants(self, method: Any) -> float:
        """E[m]: Σ q_n (independent) or m (uniform): public, unlike the round's own count."""
        if self.sampling == "independent":
            return float(np.sum(method.q))
        return self.uniform_rate * self.n_clients

    def adapt(self, method: Any) -> dict[str, Any]:
        """Adaptive: the round's C and noised unclipped share b̃ (None: nothing released),
        and C moved for the next round."""
        used, count, self.count = self.clip_norm, self.count, None
        if count is None:
            return {"dp_clip": used, "dp_unclipped_fraction": None}
        fraction = count / self.expected_participants(method) + 0.5
        self.clip_norm = next_clip(used, fraction, self.target_quantile, self.clip_lr)
        return {"dp_clip": used, "dp_unclipped_fraction": fraction}


def make_privacy(cfg: ExperimentConfig, method_cls: Any) -> ClientPrivacy | None:
    """The run's `ClientPrivacy` (`method_cls`: the class of ``method.name``), or None with
    ``privacy.mode = "none"``."""
    return ClientPrivacy(cfg, method_cls) if cfg.privacy.enabled else None


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
    """Before a round: an adaptive run's clip bound as the last round left it (a resume)."""
    dp = getattr(method, "privacy", None)
    if dp is not None and dp.adaptive and progress.dp_clip_norm is not None:
        dp.clip_norm = float(progress.dp_clip_norm)


def budget_stop(method: Any, progress: Any) -> str | None:
    """Why the run must stop before the next round: it would take some client's ε(δ) past
    its ``planner.max_epsilon`` (central mode; the round at the method's current rates);
    None while every client stays within its budget, or without a budget."""
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


def account_round(method: Any, sent: Any, progress: Any) -> dict[str, Any]:
    """After a round: the round in the ledger of `progress` (``privacy_ledger``) and the
    metrics line's fields: ``epsilon`` (every client's ε(δ); null where it is not finite:
    σ = 0, or rounds released without noise) and the clipping's (`clip_fields`; adaptive:
    ``dp_clip``, ``dp_unclipped_fraction``, and the next C in ``progress.dp_clip_norm``).
    `sent`: the plan of the tasks whose updates arrived. {} without privacy."""
    dp = getattr(method, "privacy", None)
    if dp is None:
        return {}
    ledger = restore_ledger(dp.n_clients, dp.sigma, progress)
    dp.account(ledger, method, sent)
    progress.privacy_ledger = ledger.to_dict()
    norms, dp.norms = dp.norms, []  # this round's, and none carried to the next
    eps = finite_or_none(ledger.epsilons(dp.delta))
    fields = {"epsilon": eps, **clip_fields(norms, dp.clip_norm)}
    if dp.adaptive:
        fields.update(dp.adapt(method))
        progress.dp_clip_norm = dp.clip_norm
    return fields


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
