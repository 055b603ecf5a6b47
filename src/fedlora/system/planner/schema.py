"""The PROBLEM.json structure (docs/planner.md) → (PlanProblem, PlanOptions): unknown keys,
missing keys and wrong types are refused with the key's path. Reading the file is
`fedlora.files.load_problem`'s job (no I/O here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value, suggest_key
from fedlora.system.planner.problem import (
    Constants,
    Observation,
    PlanOptions,
    PlanProblem,
    positive_number,
)

_TOP_KEYS = ("gamma", "f_tot", "clients", "constants", "calibration", "options")
_CLIENT_KEYS = ("a", "tau_full_s", "t_full")
_OPTION_KEYS = tuple(f.name for f in dataclasses.fields(PlanOptions))


def _unknown(where: str, key: str, valid: Sequence[str]) -> ConfigError:
    return ConfigError(f"{where}: unknown key {key!r}{suggest_key(key, valid)}")


def problem_from_dict(
    raw: Any, *, source: str = "problem", overrides: dict[str, Any] | None = None
) -> tuple[PlanProblem, PlanOptions]:
    """Build (PlanProblem, PlanOptions) from the PROBLEM.json structure (docs/planner.md).
    `overrides` replace option fields (e.g. the CLI's --solver)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    for key in raw:
        if key not in _TOP_KEYS:
            raise _unknown(source, key, _TOP_KEYS)
    opts_raw = raw.get("options", {})
    if not isinstance(opts_raw, dict):
        raise bad_value("options", opts_raw, "a JSON object")
    for key in opts_raw:
        if key not in _OPTION_KEYS:
            raise _unknown(f"{source}: options", key, _OPTION_KEYS)
    options = PlanOptions(**{**opts_raw, **(overrides or {})})
    for key in ("gamma", "f_tot", "clients"):
        if key not in raw:
            raise ConfigError(f"{source}: missing key {key!r}")
    cols = _client_columns(raw["clients"], source)
    a = np.asarray(cols["a"])
    if options.normalize_a:
        a = PlanProblem.normalized_weights(a)
    constants = _constants(raw["constants"], source) if raw.get("constants") is not None else None
    calibration = _calibration(raw)
    gamma = raw["gamma"]
    if isinstance(gamma, float) and gamma.is_integer():
        raise bad_value("gamma", gamma, "an integer (write it without a decimal point)")
    problem = PlanProblem(
        gamma=gamma,
        f_tot=raw["f_tot"],
        a=a,
        tau_full_s=np.asarray(cols["tau_full_s"]),
        t_full=np.asarray(cols["t_full"]),
        constants=constants,
        calibration=tuple(calibration),
    )
    return problem, options


def _client_columns(clients: Any, source: str) -> dict[str, list[float]]:
    """The `clients` list as columns a, tau_full_s, t_full: each row an object with exactly
    those keys, each value finite and > 0."""
    if not isinstance(clients, list):
        raise bad_value("clients", clients, "a list of objects with a, tau_full_s, t_full")
    if not clients:
        raise bad_value("clients", clients, "at least one client")
    cols: dict[str, list[float]] = {c: [] for c in _CLIENT_KEYS}
    for i, row in enumerate(clients):
        if not isinstance(row, dict):
            raise bad_value(f"clients[{i}]", row, "an object with a, tau_full_s, t_full")
        for key in row:
            if key not in _CLIENT_KEYS:
                raise _unknown(f"{source}: clients[{i}]", key, _CLIENT_KEYS)
        for c in _CLIENT_KEYS:
            if c not in row:
                raise ConfigError(f"{source}: clients[{i}] has no {c!r}")
            cols[c].append(positive_number(f"clients[{i}].{c}", row[c], "must be finite and > 0"))
    return cols


def _constants(cr: Any, source: str) -> Constants:
    """The `constants` object: exactly the keys A, B, C, D."""
    if not isinstance(cr, dict):
        raise bad_value("constants", cr, "an object with A, B, C, D")
    for key in cr:
        if key not in ("A", "B", "C", "D"):
            raise _unknown(f"{source}: constants", key, ("A", "B", "C", "D"))
    missing = [x for x in "ABCD" if x not in cr]
    if missing:
        raise ConfigError(f"{source}: constants lacks {', '.join(missing)}")
    return Constants(cr["A"], cr["B"], cr["C"], cr["D"])


def _calibration(raw: dict[str, Any]) -> list[Observation]:
    """The `calibration` list (optional): runs {"q": [...], "k": [...], "rounds": R}."""
    calibration: list[Observation] = []
    if not isinstance(raw.get("calibration") or [], list):
        raise bad_value("calibration", raw["calibration"], "a list of calibration runs")
    for i, ob in enumerate(raw.get("calibration") or []):
        if not isinstance(ob, dict) or set(ob) != {"q", "k", "rounds"}:
            raise bad_value(
                f"calibration[{i}]", ob, 'an object {"q": [...], "k": [...], "rounds": R}'
            )
        for name in ("q", "k"):
            if not isinstance(ob[name], list) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in ob[name]
            ):
                raise bad_value(f"calibration[{i}].{name}", ob[name], "a list of numbers")
        if any(not isinstance(v, int) for v in ob["k"]):
            raise bad_value(f"calibration[{i}].k", ob["k"], "a list of integers")
        calibration.append(
            Observation(np.asarray(ob["q"], dtype=float), np.asarray(ob["k"]), ob["rounds"])
        )
    return calibration
