"""Adaptive clipping (``privacy.clipping = "adaptive"``, Andrew et al. 2021): C follows a
target quantile γ of the norms ‖w_n Δ_n‖. Each round also releases the count of unclipped
updates, Σ_n (b_n − 1/2) with b_n = 1[‖w_n Δ_n‖ <= C], plus N(0, σ_b²) (a central mechanism:
once, by the server, also in an empty round of independent sampling; a local one: each
participant on its own bit); b̃ = that / E[m] + 1/2 moves C to C·exp(−η(b̃ − γ)) for the next
round. The sum's noise multiplier is σ_Δ = (z^-2 − (2σ_b)^-2)^-1/2
(`fedlora.system.privacy.sum_noise_multiplier`), so the pair is accounted as one Gaussian
mechanism at the configured z. The count's noise comes from the run's "privacy_count" stream
(round r: (seed, privacy_count, r); a local client's: (seed, privacy_count, r, n + 1)).

Its settings: ``privacy.target_quantile`` γ, ``privacy.clip_learning_rate`` η,
``privacy.clip_count_noise`` σ_b; its metrics fields ``dp_clip`` (the round's C) and
``dp_unclipped_fraction`` (b̃); the next C is checkpointed in ``progress.dp_clip_norm``.
"""

from __future__ import annotations

from typing import Any

from fedlora.config.checks import check_number
from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import bad_value
from fedlora.federation.privacy_mechanisms.base import ClippingRule, PrivacyMechanism
from fedlora.federation.privacy_mechanisms.registry import register_clipping
from fedlora.system.privacy import next_clip, sum_noise_multiplier
from fedlora.system.seeding import derive_rng

MAX_CLIP_LEARNING_RATE = 10.0


@register_clipping("adaptive")
class AdaptiveClipping(ClippingRule):
    """C moved every round towards the target quantile of the update norms."""

    log_fields = ("dp_clip", "dp_unclipped_fraction")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """Quantile in (0, 1), learning rate in (0, 10], count noise > 0 that leaves the sum
        some of the noise (> noise_multiplier / 2); a mechanism to clip for."""
        p = cfg.privacy
        check_number(
            "privacy.target_quantile", p.target_quantile, lo=0, hi=1, lo_open=True, hi_open=True
        )
        check_number(
            "privacy.clip_learning_rate",
            p.clip_learning_rate,
            lo=0,
            hi=MAX_CLIP_LEARNING_RATE,
            lo_open=True,
        )
        check_number("privacy.clip_count_noise", p.clip_count_noise, lo=0, lo_open=True)
        if not p.enabled:
            raise bad_value(
                "privacy.clipping",
                p.clipping,
                "must be 'fixed' with privacy.mode = 'none' (nothing is clipped)",
            )
        z, sb = p.noise_multiplier, p.clip_count_noise
        if z > 0 and not 2 * sb > z:  # σ_sum = (z^-2 - (2σ_b)^-2)^-1/2 needs (2σ_b)^-2 < z^-2
            raise bad_value(
                "privacy.clip_count_noise",
                sb,
                f"must be > privacy.noise_multiplier / 2 = {z / 2:g}: the count's noise spends "
                "(2σ_b)^-2 of the round's budget z^-2 and would leave none for the sum",
            )

    def __init__(self, cfg: ExperimentConfig, *, local: bool) -> None:
        super().__init__(cfg, local=local)
        p = cfg.privacy
        self.count_noise = float(p.clip_count_noise)
        self.target_quantile = float(p.target_quantile)
        self.clip_lr = float(p.clip_learning_rate)
        self.count: float | None = None  # the round's noised Σ(b_n − 1/2); None: not released

    def sum_multiplier(self, z: float) -> float:
        return sum_noise_multiplier(z, self.count_noise)

    def start_round(self) -> None:
        self.count = None

    def observe(self, norm: float, round_: int, client: int) -> None:
        """Add b_n − 1/2 to the round's count; local: with the client's own noise."""
        bit = (1.0 if norm <= self.clip_norm else 0.0) - 0.5
        if self.local:
            bit += derive_rng(self.seed, "privacy_count", round_, client + 1).normal(
                0.0, self.count_noise
            )
        self.count = (self.count or 0.0) + bit

    def release(self, round_: int) -> None:
        """Central: the server's noise on the count (also in an empty round)."""
        if not self.local:
            rng = derive_rng(self.seed, "privacy_count", round_)
            self.count = (self.count or 0.0) + float(rng.normal(0.0, self.count_noise))

    def adapt(self, mechanism: PrivacyMechanism, method: Any) -> dict[str, Any]:
        """The round's C and noised unclipped share b̃ (None: nothing released), and C moved
        for the next round."""
        used, count, self.count = self.clip_norm, self.count, None
        if count is None:
            return {"dp_clip": used, "dp_unclipped_fraction": None}
        fraction = count / mechanism.expected_participants(method) + 0.5
        self.clip_norm = next_clip(used, fraction, self.target_quantile, self.clip_lr)
        return {"dp_clip": used, "dp_unclipped_fraction": fraction}

    def resume(self, progress: Any) -> None:
        if progress.dp_clip_norm is not None:
            self.clip_norm = float(progress.dp_clip_norm)

    def save(self, progress: Any) -> None:
        progress.dp_clip_norm = self.clip_norm

    @classmethod
    def summary_fields(cls, cfg: ExperimentConfig, progress: Any) -> dict[str, Any]:
        """The C the last round left and the sum's noise multiplier σ_Δ."""
        p = cfg.privacy
        return {
            "final_clip_norm": progress.dp_clip_norm,
            "sum_noise_multiplier": sum_noise_multiplier(p.noise_multiplier, p.clip_count_noise),
        }
