"""The local step sizes η_n: one η for every client (paper Eq. 4), or per client from its
sketch (``training.sketch_step = "scaled"``), as `local_train` takes them. numpy only.

``training.lr`` and ``training.sketch_step`` are checked once, by `TrainingConfig`'s
``__post_init__``; the round path (`step_sizes_for`) trusts them. `client_step_sizes` checks
its arguments for callers holding unchecked values; `check_step_sizes` is `local_train`'s
check of its own ``lr`` argument (the llm layer's entry).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value

__all__ = ["SKETCH_STEP_POWER", "client_step_sizes", "step_sizes_for", "check_step_sizes"]

# training.sketch_step = "scaled": client n steps with η·(k_n/γ)^p. A sketch scales its k
# rank components by s = γ/k in the forward pass, so each component's gradient carries s and
# its effect on ΔW = (α/r)·B·diag(s)·A another s: s² per component. The k components' updates
# are nearly orthogonal (random init, in_features ≫ γ), so their norms add in quadrature:
# E‖ΔW‖² ∝ s⁴·k = γ⁴/k³ and the RMS size ∝ k^(-3/2). p = 3/2 cancels it (docs/methods.md).
SKETCH_STEP_POWER = 1.5


def client_step_sizes(lr: float, scales: np.ndarray, sketch_step: str = "paper") -> np.ndarray:
    """Each client's local step size η_n (c,), float64, from its (c, γ) rank scale vector.

    "paper": η for everyone (Eq. 4). "scaled": η·s_n^(-3/2) with s_n = max(scale_n), the
    sketch's γ/k_n (so η·(k_n/γ)^(3/2)); a full adapter or a rank truncation (s_n = 1) keeps η.
    Checks its arguments (ConfigError naming the field); the run's path is `step_sizes_for`.
    """
    from fedlora.config.sections import SKETCH_STEPS

    if sketch_step not in SKETCH_STEPS:
        raise bad_value("training.sketch_step", sketch_step, ", ".join(SKETCH_STEPS))
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (np.isfinite(lr) and lr > 0):
        raise bad_value("training.lr", lr, "a finite number > 0")
    scales = np.asarray(scales, dtype=np.float64)
    if scales.ndim != 2 or scales.shape[0] == 0:
        raise ConfigError(f"scales must be (c, γ) with c >= 1, got shape {scales.shape}")
    if not np.all(np.isfinite(scales) & (scales >= 0)):
        raise ConfigError(f"scales must be finite and >= 0, got {scales.tolist()}")
    if sketch_step == "paper":
        return np.full(scales.shape[0], float(lr))
    return _scaled_step_sizes(lr, scales)


def _scaled_step_sizes(lr: float, scales: np.ndarray) -> np.ndarray:
    """η·s_n^(-3/2) per row of the (c, γ) float64 `scales` (s_n = the row's max)."""
    s = scales.max(axis=1)  # (c,)
    # a client with no active component (all scales 0) trains nothing: it keeps η
    return float(lr) * np.where(s > 0, s, 1.0) ** (-SKETCH_STEP_POWER)


def step_sizes_for(lr: float, sketch_step: str, scales: np.ndarray) -> float | np.ndarray:
    """What `local_train` gets as `lr`: the scalar η for sketch_step = "paper" (the plain
    path, bit for bit), else η_n per client (c,) as `client_step_sizes` gives them.

    Trusts `lr` and `sketch_step` (``training.lr``, ``training.sketch_step``: checked by
    `TrainingConfig`) and `scales` (the round plan's (c, γ) scale vectors)."""
    if sketch_step == "paper":
        return lr
    assert sketch_step == "scaled", sketch_step
    scales = np.asarray(scales, dtype=np.float64)
    assert scales.ndim == 2 and scales.shape[0] > 0, scales.shape
    return _scaled_step_sizes(lr, scales)


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
