"""What every privacy mechanism and clipping rule does (docs/privacy.md, "Adding a privacy
mechanism"): the verbs `fedlora.federation.privacy` and a method's `server_step` call, so that
neither names a mechanism.

A `PrivacyMechanism` (``privacy.mode``) wraps a method's aggregation as Flower's
``DifferentialPrivacyServerSideFixedClipping(strategy, ...)`` wraps a strategy:

    clip     each participant's update Δ_n = X_n − X on the factors it trains, weighted as the
             method aggregates it (w_n), scaled down to ‖w_n Δ_n‖ <= C (`perturb` may add a
             participant's own noise); a state within the bound is passed on untouched
    noise    the aggregate after `aggregate` (a central mechanism's noise)
    account  the round in the run's `PrivacyLedger`: which clients were exposed, how
    round_fields  the metrics line's fields of the round (named in `log_fields`)

A `ClippingRule` (``privacy.clipping``) says what C is each round: fixed, or moved by what
the round releases (adaptive clipping). The mechanism holds one and asks it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.system.privacy_ledger import PrivacyLedger, RoundSetting

Adapter = dict[str, np.ndarray]

CLIP_FIELDS = ("dp_update_norms", "dp_update_norm_median", "dp_clipped_fraction")


def factor_keys(state: Adapter, factors: str) -> list[str]:
    """The tensors of `factors` (letters of ``ABR``): every ``*.lora_A`` for "A", ..."""
    suffixes = tuple(f".lora_{f}" for f in factors)
    return [k for k in state if k.endswith(suffixes)]


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


class ClippingRule:
    """The clip bound C of each round (registered under its ``privacy.clipping`` name). The
    base is a fixed C = ``privacy.clip_norm`` that releases nothing."""

    name: ClassVar[str] = ""
    log_fields: ClassVar[tuple[str, ...]] = ()  # its own fields of the metrics line

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """Raise ConfigError for its own ``privacy.*`` settings (called for every run)."""

    def __init__(self, cfg: ExperimentConfig, *, local: bool) -> None:
        self.clip_norm = float(cfg.privacy.clip_norm)  # C of the round
        self.local = local  # whether the participants noise what they release
        self.seed = cfg.training.seed

    def sum_multiplier(self, z: float) -> float:
        """The noise multiplier of the clipped sum for the accounting's z."""
        return z

    def start_round(self) -> None:
        """Before the round's first participant is clipped."""

    def observe(self, norm: float, round_: int, client: int) -> None:
        """One participant's ‖w_n Δ_n‖ before clipping at the round's C."""

    def release(self, round_: int) -> None:
        """The server's part of the round's release (after every participant's)."""

    def adapt(self, mechanism: PrivacyMechanism, method: Any) -> dict[str, Any]:
        """After the round: its `log_fields`, and C moved for the next round (`mechanism`
        knows the expected participants of `method`'s rounds)."""
        return {}

    def resume(self, progress: Any) -> None:
        """Before a round: C as the last round left it (`save`), after a resume."""

    def save(self, progress: Any) -> None:
        """After a round: what `resume` needs, into `progress` (checkpointed)."""

    @classmethod
    def summary_fields(cls, cfg: ExperimentConfig, progress: Any) -> dict[str, Any]:
        """Its fields of summary.json's ``privacy``."""
        return {}


class PrivacyMechanism:
    """Client-level DP of one run (registered under its ``privacy.mode`` name). The base
    clips each weighted update to C (its `ClippingRule`'s) and adds no noise; a mechanism
    says where its noise goes (`perturb`, `noise`) and how a round is accounted (`account`).
    `method_cls`: the class of ``method.name``, whose `dp_sampling` and `normalised_weights`
    say how its participants are sampled and weighted."""

    name: ClassVar[str] = ""
    local: ClassVar[bool] = False  # each participant noises its own update
    accepts_budget: ClassVar[bool] = False  # planner.max_epsilon (the planner's accounting)
    log_fields: ClassVar[tuple[str, ...]] = ("epsilon", *CLIP_FIELDS)

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """Raise ConfigError for its own ``privacy.*`` settings (called when it runs)."""

    def __init__(self, cfg: ExperimentConfig, method_cls: Any, clipping: type[ClippingRule]):
        p = cfg.privacy
        self.clipping = clipping(cfg, local=self.local)
        self.sigma = float(p.noise_multiplier)  # z: the accounting's noise multiplier
        self.sum_sigma = self.clipping.sum_multiplier(self.sigma)  # the sum's own
        self.delta = float(p.delta)
        self.budget = cfg.planner.max_epsilon
        self.seed = cfg.training.seed
        self.n_clients = cfg.data.n_clients
        self.sampling = method_cls.dp_sampling
        self.normalised = bool(method_cls.normalised_weights)
        m = cfg.method.clients_per_round
        self.uniform_rate = 1.0 if m == 0 else m / self.n_clients
        self.norms: list[float] = []  # ‖w_n Δ_n‖ before clipping, of the round's last `clip`

    @property
    def clip_norm(self) -> float:
        """C of the round (its clipping rule's)."""
        return self.clipping.clip_norm

    @clip_norm.setter
    def clip_norm(self, value: float) -> None:
        self.clipping.clip_norm = value

    @property
    def count(self) -> float | None:
        """What the clipping rule released this round (adaptive: the noised count)."""
        return getattr(self.clipping, "count", None)

    @property
    def noise_std(self) -> float:
        """σ·C: the standard deviation of the noise on the weighted sum (per client: local)."""
        return self.sum_sigma * self.clip_norm

    @property
    def sampling_kind(self) -> str:
        """The kind of the round's privacy event (`fedlora.system.privacy`)."""
        return "poisson" if self.sampling == "independent" else "uniform"

    def setting(self) -> RoundSetting:
        """What the round releases under, for the ledger."""
        return RoundSetting(self.name, self.sigma, self.clip_norm, self.sampling_kind)

    def weights(self, plan: Any) -> np.ndarray:
        """w_n of the round's participants as the method's aggregate applies them."""
        w = np.array([t.weight for t in plan.tasks], dtype=float)
        return w / w.sum() if self.normalised and w.size else w

    def clip(self, global_state: Adapter, plan: Any, states: list[Adapter]) -> list[Adapter]:
        """Each state with its weighted update clipped to C (and `perturb`ed); the norms
        before clipping are kept in `norms` for the round's metrics line."""
        out = []
        self.norms = []
        self.clipping.start_round()
        for task, w, state in zip(plan.tasks, self.weights(plan), states):
            keys = factor_keys(global_state, task.trains)
            delta = {k: state[k].astype(np.float64) - global_state[k] for k in keys}
            norm = w * math.sqrt(sum(float(np.sum(d * d)) for d in delta.values()))
            self.norms.append(float(norm))
            self.clipping.observe(norm, plan.round, task.client)
            scale = self.clip_norm / norm if norm > self.clip_norm else 1.0
            delta = self.perturb(delta, scale, task, w, plan.round)
            if delta is None:
                out.append(state)  # within the bound: untouched
                continue
            new = dict(state)
            for k in keys:
                new[k] = (global_state[k] + delta[k]).astype(state[k].dtype)
            out.append(new)
        return out

    def perturb(
        self, delta: Adapter, scale: float, task: Any, w: float, round_: int
    ) -> Adapter | None:
        """The participant's update scaled by `scale` (None: unchanged, `scale` = 1)."""
        if scale == 1.0:
            return None
        return {k: scale * d for k, d in delta.items()}

    def noise(self, global_state: Adapter, new_state: Adapter, plan: Any) -> Adapter:
        """The aggregate as released (the base: the clipping rule's release, no noise)."""
        self.clipping.release(plan.round)
        return new_state

    def noise_note(self, method: Any) -> str | None:
        """A line on the noise against the signal, once a round was noised (the base: None)."""
        return None

    def noise_alone(self, trained: Any) -> bool:
        """True when a round whose aggregate has no update still needs the noise."""
        return False

    def account(self, ledger: PrivacyLedger, method: Any, sent: Any) -> None:
        """The round in the ledger: every exposed client's event. `sent`: the plan of the
        tasks whose updates arrived (None: the round as planned, for `budget_stop`)."""
        raise NotImplementedError

    def expected_participants(self, method: Any) -> float:
        """E[m]: Σ q_n (independent) or m (uniform): public, unlike the round's own count."""
        if self.sampling == "independent":
            return float(np.sum(method.q))
        return self.uniform_rate * self.n_clients

    def adapt(self, method: Any) -> dict[str, Any]:
        """The clipping rule's fields of the round, and C moved for the next round."""
        return self.clipping.adapt(self, method)

    def round_fields(self, ledger: PrivacyLedger, method: Any, norms: list[float]) -> dict:
        """The metrics line's fields after the round is accounted: ``epsilon`` (every client's
        ε(δ); null where it is not finite), the clipping's (`clip_fields`, at the round's C)
        and the clipping rule's (`adapt`): the names of `log_fields` and the rule's."""
        eps = finite_or_none(ledger.epsilons(self.delta))
        return {"epsilon": eps, **clip_fields(norms, self.clip_norm), **self.adapt(method)}
