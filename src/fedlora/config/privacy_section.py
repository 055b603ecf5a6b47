"""The privacy section of an experiment config: client-level differential privacy (clipping,
Gaussian noise, the δ of the reported ε) and secure aggregation on Flower (SecAgg+).

Which names ``privacy.mode`` and ``privacy.clipping`` accept, and each one's own settings, are
the privacy registries' (`fedlora.federation.privacy_mechanisms`: one class per mechanism and
per clipping rule); which methods they apply to is each method's own fact
(`Method.dp_sampling`, `dp_refusal`, `check_privacy`). Both are checked where a config becomes
a run (`check_method_config`), which this layer cannot see; here only the types and the
bounds every mechanism shares. docs/privacy.md derives the sensitivity of each method's
aggregate and states the threat model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedlora.config.checks import check_int, check_number
from fedlora.errors import ConfigError, bad_value

NO_PRIVACY = "none"  # privacy.mode without a mechanism; the others: the privacy registry's

# Bounds that keep every ε, noise and quantization meaningful (docs/privacy.md): σ outside
# SIGMA_RANGE is 0 or astronomically large to the accountant (fedlora.system.privacy); noise
# of standard deviation above MAX_NOISE_STD per adapter entry swamps any adapter and
# overflows half-precision sums (fp16's largest number is 65504); a clip bound above
# MAX_CLIP_NORM is reached by no update; SecAgg+'s rounding step 2c/2^22 above 2.4e-4
# (c > 500) is as large as a LoRA update's typical entry, which rounds to 0 or one step.
# (the config layer sits below fedlora.system: SIGMA_RANGE is also there, tested equal)
SIGMA_RANGE = (0.01, 1e4)
MAX_NOISE_STD = 1e3
MAX_CLIP_NORM = 1e12
MAX_SECAGG_CLIPPING_RANGE = 500.0

# SecAgg+'s fixed quantization: every entry becomes an integer in [0, 2^22]; the masked sum is
# taken modulo 2^32, so up to 2^32 / 2^22 - 1 = 1023 participants sum without wrapping around
SECAGG_QUANTIZATION_RANGE = 2**22
SECAGG_MODULUS_RANGE = 2**32
SECAGG_MAX_CLIENTS = SECAGG_MODULUS_RANGE // SECAGG_QUANTIZATION_RANGE - 1


@dataclass(frozen=True)
class PrivacyConfig:
    """Client-level differential privacy of the aggregate (docs/privacy.md).

    `mode`: "none", or a registered privacy mechanism (built in: "central", each
    participant's weighted update clipped to `clip_norm`, Gaussian noise of standard deviation
    noise_multiplier·clip_norm added once to the sum by the server; "local", each participant
    adds that noise to its own clipped update).
    `delta`: the δ at which every client's ε(δ) is reported (and planner.max_epsilon holds).
    `secure_aggregation`: on Flower, the server learns only the sum of the round's weighted
    updates (SecAgg+); a round with fewer than `secagg_threshold` participants is skipped.
    `secagg_clipping_range`: c, every entry of a weighted update is clipped to [-c, c] and
    quantized to 2^22 levels across that range (docs/privacy.md, "Secure aggregation").
    `clipping`: a registered clipping rule: "fixed" (C = clip_norm) or "adaptive" (Andrew et
    al. 2021, `fedlora.federation.privacy_mechanisms.adaptive`: C starts at
    clip_norm and follows the `target_quantile` of the update norms with learning rate
    `clip_learning_rate`; the count of unclipped updates is released with noise of standard
    deviation `clip_count_noise`, and the sum's noise multiplier is what that leaves of
    noise_multiplier, `fedlora.system.privacy.sum_noise_multiplier`).
    """

    mode: str = "none"
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    secure_aggregation: bool = False
    secagg_threshold: int = 2
    secagg_clipping_range: float = 1.0
    clipping: str = "fixed"
    target_quantile: float = 0.5
    clip_learning_rate: float = 0.2
    clip_count_noise: float = 5.0

    def __post_init__(self) -> None:
        _check_name("privacy.mode", self.mode)
        check_number("privacy.clip_norm", self.clip_norm, lo=0, hi=MAX_CLIP_NORM, lo_open=True)
        check_number("privacy.noise_multiplier", self.noise_multiplier, lo=0)
        _check_sigma(self.noise_multiplier)
        check_number("privacy.delta", self.delta, lo=0, hi=1, lo_open=True, hi_open=True)
        if self.noise_multiplier * self.clip_norm > MAX_NOISE_STD:
            raise ConfigError(
                f"privacy.clip_norm = {self.clip_norm!r} with privacy.noise_multiplier = "
                f"{self.noise_multiplier!r}: the noise's standard deviation σ·C = "
                f"{self.noise_multiplier * self.clip_norm:g} per adapter entry must be <= "
                f"{MAX_NOISE_STD:g} (more swamps any adapter); choose C near the update norms "
                "(dp_update_norms)"
            )
        _check_clipping(self)
        if not isinstance(self.secure_aggregation, bool):
            raise bad_value("privacy.secure_aggregation", self.secure_aggregation, "true or false")
        check_int("privacy.secagg_threshold", self.secagg_threshold, lo=2, hi=SECAGG_MAX_CLIENTS)
        check_number(
            "privacy.secagg_clipping_range",
            self.secagg_clipping_range,
            lo=0,
            hi=MAX_SECAGG_CLIPPING_RANGE,
            lo_open=True,
        )
        if self.secure_aggregation and self.enabled:
            raise ConfigError(
                f"privacy.secure_aggregation = true is invalid with privacy.mode = "
                f"{self.mode!r}: clipping each update needs the server to see it, and the "
                "nodes do not clip on their own yet; use one of the two"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != NO_PRIVACY


def _check_sigma(sigma: float) -> None:
    lo, hi = SIGMA_RANGE
    if sigma != 0 and not lo <= sigma <= hi:
        raise bad_value(
            "privacy.noise_multiplier",
            sigma,
            f"must be 0 (no noise: ε = inf) or in [{lo:g}, {hi:g}]: outside it every ε is 0 or "
            "astronomically large to the accountant",
        )


def _check_name(field: str, name: Any, what: str = "a privacy mechanism") -> None:
    """A mechanism's or clipping rule's name: an identifier (which ones exist: the registry)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise bad_value(field, name, f"{what}'s name (an identifier)")


def _check_clipping(p: PrivacyConfig) -> None:
    """The clipping rule's name and its settings' types (their ranges: the rule's own
    `check_config`, adaptive clipping's)."""
    _check_name("privacy.clipping", p.clipping, "a clipping rule")
    for field in ("target_quantile", "clip_learning_rate", "clip_count_noise"):
        check_number(f"privacy.{field}", getattr(p, field))


def check_in_process_privacy(cfg: Any) -> None:
    """ConfigError for what only the Flower runtime can do: ``privacy.secure_aggregation``
    (in one process the server holds every client's update anyway)."""
    if cfg.privacy.secure_aggregation:
        raise ConfigError(
            "privacy.secure_aggregation = true is invalid for an in-process run: it is a "
            "Flower-only setting (the server sees only the sum of the nodes' masked updates); "
            "use `fedlora flower simulate` or `fedlora flower run-local`, or set "
            "privacy.secure_aggregation = false"
        )
