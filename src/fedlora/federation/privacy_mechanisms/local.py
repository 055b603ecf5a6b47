"""Local DP (``privacy.mode = "local"``): each participant clips its weighted update to C and
adds N(0, (σC)²) to it on the components it sends, before sending; the server adds nothing.
A round exposes only the clients that sent, each as the Gaussian mechanism (rate 1, any two
of a client's data sets 2C apart: `fedlora.system.privacy`'s "local" event).

Client n's noise in round r comes from the run's stream (seed, "privacy", r, n + 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlora.federation.privacy_mechanisms.base import Adapter, PrivacyMechanism
from fedlora.federation.privacy_mechanisms.registry import register_privacy
from fedlora.system.privacy_ledger import PrivacyLedger
from fedlora.system.seeding import derive_rng


def component_mask(name: str, shape: tuple[int, ...], active: np.ndarray) -> np.ndarray:
    """1 on the entries of a LoRA tensor that a participant with active rank components
    `active` (γ,) bool sends: rows of A (γ, in), columns of B (out, γ), R (γ, γ) both."""
    a = active.astype(np.float64)
    if name.endswith(".lora_A"):
        return np.broadcast_to(a[:, None], shape)
    if name.endswith(".lora_B"):
        return np.broadcast_to(a[None, :], shape)
    return np.broadcast_to(np.outer(a, a), shape)


@register_privacy("local")
class LocalPrivacy(PrivacyMechanism):
    """Each participant's own noise on its clipped, weighted update."""

    local = True

    @property
    def sampling_kind(self) -> str:
        return "local"

    def perturb(
        self, delta: Adapter, scale: float, task: Any, w: float, round_: int
    ) -> Adapter | None:
        """The clipped update plus the participant's noise on the components it sends (the
        noise divided by w_n: the aggregate weights it back to N(0, (σC)²))."""
        if self.sigma == 0:
            return super().perturb(delta, scale, task, w, round_)
        rng = derive_rng(self.seed, "privacy", round_, task.client + 1)
        active = np.asarray(task.scale) != 0
        out = {}
        for k, d in delta.items():
            noise = rng.normal(0.0, self.noise_std, size=d.shape)
            out[k] = scale * d + component_mask(k, d.shape, active) * noise / w
        return out

    def account(self, ledger: PrivacyLedger, method: Any, sent: Any) -> None:
        """The clients that sent, each exposed once at rate 1."""
        mask = np.zeros(self.n_clients, dtype=bool)
        mask[[t.client for t in sent.tasks]] = True
        ledger.record(self.setting(), "local", np.ones(self.n_clients), mask)
