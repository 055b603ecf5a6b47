"""The local step sizes η_n: one η for every client (paper Eq. 4), or per client from its
sketch (``training.sketch_step = "scaled"``), as `local_train` takes them; and the round's η
under ``training.lr_schedule`` (`round_lr`). numpy only.

``training.lr`` and ``training.sketch_step`` are checked once, by `TrainingConfig`'s
``__post_init__``; the round path (`step_sizes_for`) trusts them. `client_step_sizes` checks
its arguments for callers holding unchecked values; `check_step_sizes` is `local_train`'s
check of its own ``lr`` argument (the llm layer's entry).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value

__all__ = [
    "ADAMW_SKETCH_STEP_POWER",
    "SKETCH_STEP_POWER",
    "check_step_sizes",
    "client_step_sizes",
    "round_lr",
    "sketch_step_power",
    "step_sizes_for",
]

# training.sketch_step = "scaled": client n steps with η·(k_n/γ)^p. A sketch scales its k
# rank components by s = γ/k in the forward pass, so each component's gradient carries s and
# its effect on ΔW = (α/r)·B·diag(s)·A another s: s² per component. The k components' updates
# are nearly orthogonal (random init, in_features ≫ γ), so their norms add in quadrature:
# E‖ΔW‖² ∝ s⁴·k = γ⁴/k³ and the RMS size ∝ k^(-3/2). p = 3/2 cancels it (docs/methods.md).
SKETCH_STEP_POWER = 1.5
# Under AdamW the update of each element is about η whatever its gradient's size (m/√v), so
# the s the gradient carries cancels; its effect on ΔW keeps one s: E‖ΔW‖² ∝ s²·k = γ²/k, an
# RMS size ∝ k^(-1/2). p = 1/2 cancels it (docs/models.md, "Client optimizers").
ADAMW_SKETCH_STEP_POWER = 0.5


def sketch_step_power(optimizer: str = "sgd") -> float:
    """The power p of ``training.sketch_step = "scaled"``'s η·(k_n/γ)^p for an optimizer."""
    return ADAMW_SKETCH_STEP_POWER if optimizer == "adamw" else SKETCH_STEP_POWER


def client_step_sizes(
    lr: float, scales: np.ndarray, sketch_step: str = "paper", optimizer: str = "sgd"
) -> np.ndarray:
    """Each client's local step size η_n (c,), float64, from its (c, γ) rank scale vector.

    "paper": η for everyone (Eq. 4). "scaled": η·s_n^(-p) with s_n = max(scale_n), the
    sketch's γ/k_n (so η·(k_n/γ)^p; p = 3/2 for SGD, 1/2 for AdamW: `sketch_step_power`); a
    full adapter or a rank truncation (s_n = 1) keeps η. Checks its arguments (ConfigError
    naming the field); the run's path is `step_sizes_for`.
    """
    from fedlora.config.training_section import OPTIMIZERS, SKETCH_STEPS

    if sketch_step not in SKETCH_STEPS:
        raise bad_value("training.sketch_step", sketch_step, ", ".join(SKETCH_STEPS))
    if optimizer not in OPTIMIZERS:
        raise bad_value("training.optimizer", optimizer, ", ".join(OPTIMIZERS))
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (np.isfinite(lr) and lr > 0):
        raise bad_value("training.lr", lr, "a finite number > 0")
    scales = np.asarray(scales, dtype=np.float64)
    if scales.ndim != 2 or scales.shape[0] == 0:
        raise ConfigError(f"scales must be (c, γ) with c >= 1, got shape {scales.shape}")
    if not np.all(np.isfinite(scales) & (scales >= 0)):
        raise ConfigError(f"scales must be finite and >= 0, got {scales.tolist()}")
    if sketch_step == "paper":
        return np.full(scales.shape[0], float(lr))
    return _scaled_step_sizes(lr, scales, sketch_step_power(optimizer))


def _scaled_step_sizes(lr: float, scales: np.ndarray, power: float) -> np.ndarray:
    """η·s_n^(-power) per row of the (c, γ) float64 `scales` (s_n = the row's max)."""
    s = scales.max(axis=1)  # (c,)
    # a client with no active component (all scales 0) trains nothing: it keeps η
    return float(lr) * np.where(s > 0, s, 1.0) ** (-power)


def step_sizes_for(
    lr: float, sketch_step: str, scales: np.ndarray, optimizer: Any = None
) -> float | np.ndarray:
    """What `local_train` gets as `lr`: the scalar η for sketch_step = "paper" (the plain
    path, bit for bit), else η_n per client (c,) as `client_step_sizes` gives them.

    `optimizer`: the object `local_train` steps with (a `SlotAdamW`, built once from
    ``training.optimizer``; None = SGD); its `sketch_step_power` is the p of η·(k_n/γ)^p.
    Trusts `lr` and `sketch_step` (``training.lr``, ``training.sketch_step``: checked by
    `TrainingConfig`) and `scales` (the round plan's (c, γ) scale vectors)."""
    if sketch_step == "paper":
        return lr
    assert sketch_step == "scaled", sketch_step
    scales = np.asarray(scales, dtype=np.float64)
    assert scales.ndim == 2 and scales.shape[0] > 0, scales.shape
    power = SKETCH_STEP_POWER if optimizer is None else optimizer.sketch_step_power
    return _scaled_step_sizes(lr, scales, power)


def round_lr(lr: float, lr_min: float, schedule: str, round_index: int, rounds: int) -> float:
    """η of round `round_index` (0-based) of `rounds` under ``training.lr_schedule``:
    "constant" gives `lr` itself (bit for bit); "cosine" gives
    lr_min + (lr − lr_min)·(1 + cos(π·r/R))/2: `lr` at the first round, falling to `lr_min`
    after the last (OpenFedLLM's and Hugging Face's cosine; reaching lr_min = 0 *at* the last
    round would make that round train nothing). Trusts its arguments (`TrainingConfig`)."""
    if schedule == "constant":
        return lr
    assert schedule == "cosine", schedule
    frac = min(max(round_index, 0), rounds) / max(rounds, 1)
    return float(lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def check_step_sizes(lr: Any, c: int) -> np.ndarray | None:
    """`local_train`'s `lr` checked: None for one scalar η (the plain path); else the (c,)
    per-client step sizes (float64)."""
    if np.ndim(lr) == 0:
        if isinstance(lr, bool) or not (
            isinstance(lr, (int, float)) and np.isfinite(lr) and lr > 0
        ):
            raise ConfigError(f"training.lr = {lr!r} is invalid: must be a finite number > 0")
        return None
    lrs = np.asarray(lr, dtype=np.float64)
    if lrs.shape != (c,) or not np.all(np.isfinite(lrs) & (lrs > 0)):
        raise ConfigError(
            f"per-client step sizes {np.asarray(lr).tolist()} are invalid: need {c} finite "
            "numbers > 0, one per active slot"
        )
    return lrs
