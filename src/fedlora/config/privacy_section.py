"""The privacy section of an experiment config: client-level differential privacy (clipping,
Gaussian noise, the δ of the reported ε), and which methods it applies to.

docs/privacy.md derives the sensitivity of each method's aggregate and states the threat model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedlora.config.checks import check_choice, check_number
from fedlora.errors import ConfigError

PRIVACY_MODES = ("none", "central", "local")

# methods whose aggregate is the global adapter plus a weighted sum of client updates, and
# how each samples its participants: "independent" (client n joins with its own q_n,
# Poisson sampling) or "uniform" (m of N without replacement; m = 0: all N)
PRIVATE_SAMPLING = {
    "sketched": "independent",
    "proposed": "independent",
    "fedavg": "uniform",
    "fslora": "uniform",
    "ffalora": "uniform",
    "heterolora": "uniform",
    "rolora": "uniform",
    "fedsb": "uniform",
}

# why the other built-in methods refuse differential privacy
NOT_A_SUM = {
    "flexlora": "its aggregate is a truncated SVD of the clients' products, not a sum of "
    "their adapter updates",
    "fedstacklora": "its aggregate stacks the clients' factors side by side and merges them "
    "into the base weights, not a sum of updates",
    "fedexlora": "its aggregate adds a dense residual of the clients' products to the base "
    "weights, which clipping the adapter updates does not bound",
    "fedsalora": "its clients keep B on the device and the evaluated adapter uses their "
    "mean, released without noise",
}


@dataclass(frozen=True)
class PrivacyConfig:
    """Client-level differential privacy of the aggregate (docs/privacy.md).

    `mode`: "none"; "central" (each participant's weighted update clipped to `clip_norm`,
    Gaussian noise of standard deviation noise_multiplier·clip_norm added once to the sum by
    the server); "local" (each participant adds that noise to its own clipped update).
    `delta`: the δ at which every client's ε(δ) is reported (and planner.max_epsilon holds).
    """

    mode: str = "none"
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        check_choice("privacy.mode", self.mode, PRIVACY_MODES)
        check_number("privacy.clip_norm", self.clip_norm, lo=0, lo_open=True)
        check_number("privacy.noise_multiplier", self.noise_multiplier, lo=0)
        check_number("privacy.delta", self.delta, lo=0, hi=1, lo_open=True, hi_open=True)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


def check_private_method(privacy: PrivacyConfig, method_name: str, pruning: float) -> None:
    """ConfigError unless privacy is off or `method_name`'s aggregate is a weighted sum of
    client updates (`PRIVATE_SAMPLING`); HeteroLoRA's self-pruning (a data-dependent rank
    schedule) is refused too."""
    if not privacy.enabled:
        return
    if method_name not in PRIVATE_SAMPLING:
        why = NOT_A_SUM.get(method_name, "it is not known to aggregate a weighted sum of updates")
        raise ConfigError(
            f"privacy.mode = {privacy.mode!r} is invalid with method.name = {method_name!r}: "
            f"{why}; differential privacy needs one of {', '.join(PRIVATE_SAMPLING)} "
            "(or privacy.mode = 'none')"
        )
    if method_name == "heterolora" and pruning:
        raise ConfigError(
            f"privacy.mode = {privacy.mode!r} is invalid with method.heterolora_pruning = "
            f"{pruning!r}: the self-pruning schedule is decided from the clients' un-noised "
            "updates; set method.heterolora_pruning = 0"
        )
