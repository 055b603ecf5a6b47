"""Central DP (``privacy.mode = "central"``): the server clips each weighted update to C and
adds N(0, (σC)²) once to every entry of the aggregated factors, also in a round without
participants when clients are sampled independently (whether a round is empty depends on who
was sampled). Every client is accounted each round at its sampling rate: q_n (independent,
the Poisson-subsampled Gaussian) or m/N (uniform). The planner's privacy budget
(``planner.max_epsilon``) accounts the same way, so it is this mechanism's.

The noise of round r comes from the run's stream (seed, "privacy", r), so a resumed run draws
the same noise; σ = 0 draws none.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlora.federation.privacy_mechanisms.base import Adapter, PrivacyMechanism, factor_keys
from fedlora.federation.privacy_mechanisms.registry import register_privacy
from fedlora.system.privacy import noise_over_signal
from fedlora.system.privacy_ledger import PrivacyLedger
from fedlora.system.seeding import derive_rng

DEFAULT_FACTORS = "AB"  # what a round without participants noises (independent sampling)


@register_privacy("central")
class CentralPrivacy(PrivacyMechanism):
    """The server's noise on the clipped, weighted sum."""

    accepts_budget = True
    noised_entries = 0  # d: the entries the last noised round's noise went to (`noise_note`)

    def noise(self, global_state: Adapter, new_state: Adapter, plan: Any) -> Adapter:
        """The aggregate plus N(0, (σC)²) on every entry of the factors the round aggregates
        (after the clipping rule's own release); `new_state` itself with σ = 0."""
        new_state = super().noise(global_state, new_state, plan)
        if self.sum_sigma == 0:
            return new_state
        factors = "".join(sorted({f for t in plan.tasks for f in t.trains})) or DEFAULT_FACTORS
        rng = derive_rng(self.seed, "privacy", plan.round)
        out = dict(new_state)
        keys = sorted(factor_keys(global_state, factors))
        self.noised_entries = sum(int(new_state[k].size) for k in keys)
        for k in keys:
            x = new_state[k]
            out[k] = (x + rng.normal(0.0, self.noise_std, size=x.shape)).astype(x.dtype)
        return out

    def noise_note(self, method: Any) -> str | None:
        """After a noised round: the noise's norm against the clipped signal's most,
        z·√d/m (`fedlora.system.privacy.noise_over_signal`) with d the entries the round
        noised and m the expected participants; None before any noise."""
        d = self.noised_entries
        if not d:
            return None
        m = self.expected_participants(method)
        ratio = noise_over_signal(self.sum_sigma, d, m)
        verdict = (
            "above 1: the noise outweighs everything a round's clipped updates can add; more "
            "participants a round (or fewer trained entries) lower it"
            if ratio > 1
            else "at most 1: the clipped updates can outweigh the noise"
        )
        return (
            f"privacy: noise norm σ·C·√d against at most m·C of clipped updates: z·√d/m = "
            f"{self.sum_sigma:g}·√{d:,}/{m:.4g} = {ratio:.3g} ({verdict}; docs/privacy.md)"
        )

    def noise_alone(self, trained: Any) -> bool:
        """An empty round still needs the noise when clients are sampled independently (an
        empty round is then a random outcome) and σ > 0."""
        empty = trained is None or not trained.states
        return empty and self.sigma > 0 and self.sampling == "independent"

    def account(self, ledger: PrivacyLedger, method: Any, sent: Any) -> None:
        """Every client at its q_n (independent) or m/N (uniform)."""
        if self.sampling == "independent":
            ledger.record(self.setting(), "poisson", np.asarray(method.q, dtype=float))
        else:
            ledger.record(self.setting(), "uniform", np.full(self.n_clients, self.uniform_rate))
