"""The run directory's record files, owned here: each written so that a crash leaves it whole,
and read back by one rule: one reader and one writer per file.

- every whole file is written by `fedlora.files.atomic_write` (a temporary file next to the
  target, fsynced, renamed over it): a reader sees the old content or the new, never half.
- clients.csv (`ClientRow`), plan.json (`PlanRecord`) and summary.json (`RunSummary`): frozen
  records, written and read by `write_*` / `read_*`.
- `os_error_message` is the one-line message for a failed write (a full disk named as such).

metrics.jsonl, appended to every round, is `fedlora.federation.metrics_file`'s.
"""

from __future__ import annotations

import csv
import errno
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fedlora.errors import DataError
from fedlora.files import atomic_write

CLIENTS_FILE = "clients.csv"
PLAN_FILE = "plan.json"
SUMMARY_FILE = "summary.json"


def os_error_message(e: OSError) -> str:
    """One line for an OSError; a full disk is named as such."""
    where = f" {e.filename!r}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left on device while writing{where}: free some space, then run again "
            "(--resume DIR continues a run that had started)"
        )
    return f"{e.strerror or e}:{where}" if where else f"{e.strerror or e}"


# ----------------------------------------------------------------------------- clients.csv


@dataclass(frozen=True)
class ClientRow:
    """One row of clients.csv: a client's example count, data weight a_n and profile
    (`fedlora.system.client_profiles.ClientProfiles`; the channel columns are NaN for given
    profiles)."""

    client: int
    n_examples: int
    a: float
    tau_full_s: float
    t_full: float
    distance_m: float = math.nan
    path_loss_db: float = math.nan
    snr_db: float = math.nan  # mean SNR over the reference band f_tot
    spectral_efficiency: float = math.nan


CLIENT_COLUMNS = tuple(f.name for f in fields(ClientRow))
_REQUIRED_CLIENT_COLUMNS = CLIENT_COLUMNS[:5]  # older runs may lack the channel columns


def write_clients(run_dir: Path, rows: Sequence[ClientRow]) -> None:
    """run_dir/clients.csv, one row per client (floats as repr: they read back exactly)."""
    lines = [",".join(CLIENT_COLUMNS)]
    for row in rows:
        values = (
            repr(float(v)) if f.type == "float" else str(int(v))
            for f, v in zip(fields(ClientRow), astuple(row), strict=True)
        )
        lines.append(",".join(values))
    atomic_write(Path(run_dir) / CLIENTS_FILE, ("\n".join(lines) + "\n").encode())


def read_clients(path: Path) -> list[ClientRow]:
    """The rows of a run's clients.csv; a missing file, column or number is a DataError naming
    the file (and the row and column)."""
    text = read_run_text(path, "clients file")
    rows = list(csv.DictReader(text.splitlines()))
    header = list(rows[0]) if rows else []
    missing = [c for c in _REQUIRED_CLIENT_COLUMNS if c not in header]
    if not rows or missing:
        raise DataError(
            f"clients file {str(path)!r} has no client rows with columns "
            f"{', '.join(_REQUIRED_CLIENT_COLUMNS)}"
            + (f" (missing: {', '.join(missing)})" if rows else "")
        )
    out = []
    for i, raw in enumerate(rows):
        values: dict[str, Any] = {}
        for f in fields(ClientRow):
            if f.name not in header:
                continue
            try:
                values[f.name] = float(raw[f.name]) if f.type == "float" else int(raw[f.name])
            except (TypeError, ValueError):
                raise DataError(
                    f"clients file {str(path)!r}: row {i + 1}: {f.name} = {raw[f.name]!r} is not "
                    f"{'a number' if f.type == 'float' else 'an integer'}"
                ) from None
        out.append(ClientRow(**values))
    return out


# ----------------------------------------------------------------------------- plan.json


@dataclass(frozen=True)
class PlanRecord:
    """plan.json of a `proposed` run as far as every reader needs it: the plan in force (q, k)
    and the simulated time its calibration took; `fields` is the whole JSON object (the
    calibration runs or the in-run fits, constants, degeneracy: the reports' nested detail)."""

    q: tuple[float, ...]
    k: tuple[int, ...]
    calibration_mode: str  # "calibration" (four calibration runs first) or "in-run"
    calibration_s: float
    fields: Mapping[str, Any]


def write_plan(run_dir: Path, plan: Mapping[str, Any]) -> Path:
    """run_dir/plan.json (indented JSON) from its fields; returns its path."""
    path = Path(run_dir) / PLAN_FILE
    atomic_write(path, (json.dumps(plan, indent=2) + "\n").encode())
    return path


def read_plan(path: Path) -> PlanRecord:
    """A plan.json back; a damaged one is a DataError naming the file and the field."""
    data = _read_json_object(path, "plan file")
    calibration, field = data.get("calibration"), "calibration"
    try:
        if not isinstance(calibration, dict):
            raise TypeError
        field = "q"
        q = tuple(float(x) for x in data["q"])
        field = "k"
        k = tuple(int(x) for x in data["k"])
        field = "calibration.sim_time_s"
        calibration_s = float(calibration.get("sim_time_s", 0.0))
    except (KeyError, TypeError, ValueError):
        raise DataError(
            f"plan file {str(path)!r}: field {field} is missing or not what fedlora writes "
            "(q and k: lists of numbers; calibration: an object)"
        ) from None
    mode = str(calibration.get("mode", "calibration"))
    return PlanRecord(q, k, mode, calibration_s, MappingProxyType(data))


# ----------------------------------------------------------------------------- summary.json


@dataclass(frozen=True)
class RunSummary:
    """summary.json as the readers use it: a finished run's totals, or a failed run's `error`
    (written by a suite: error, method, seed). `fields` is the whole JSON object."""

    method: str | None
    seed: int | None
    error: str | None
    stop_reason: str | None
    rounds: int | None
    sim_time_s: float | None
    wall_s: float | None
    compute_s: float | None
    total_uplink_bits: float | None
    empty_rounds: int | None
    plan: Mapping[str, Any] | None  # Algorithm 2's outcome of a `proposed` run
    fields: Mapping[str, Any]

    def replace_fields(self, **values: Any) -> RunSummary:
        """The summary with some fields replaced (a re-clocked run's `sim_time_s`)."""
        return summary_from_dict({**self.fields, **values}, "summary")


_SUMMARY_TYPES = {
    "method": str,
    "seed": int,
    "error": str,
    "stop_reason": str,
    "rounds": int,
    "sim_time_s": float,
    "wall_s": float,
    "compute_s": float,
    "total_uplink_bits": float,
    "empty_rounds": int,
    "plan": dict,
}


def summary_from_dict(data: Mapping[str, Any], source: str) -> RunSummary:
    """A RunSummary from summary.json's object; a field of the wrong type is a DataError."""
    values: dict[str, Any] = {}
    for key, kind in _SUMMARY_TYPES.items():
        value = data.get(key)
        numeric = kind in (int, float) and isinstance(value, (int, float))
        if value is not None and (
            isinstance(value, bool) or not (numeric or isinstance(value, kind))
        ):
            raise DataError(
                f"{source}: {key} = {value!r} is not what fedlora writes ({kind.__name__})"
            )
        values[key] = (
            None if value is None else kind(value) if kind is not dict else MappingProxyType(value)
        )
    return RunSummary(**values, fields=MappingProxyType(dict(data)))


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    """run_dir/summary.json (indented JSON), atomically."""
    atomic_write(Path(run_dir) / SUMMARY_FILE, (json.dumps(summary, indent=2) + "\n").encode())


def read_summary(path: Path) -> RunSummary:
    """A summary.json back; unreadable, not JSON or mistyped: a DataError naming the file."""
    return summary_from_dict(_read_json_object(path, "summary file"), f"summary file {str(path)!r}")


def read_run_text(path: Path, what: str) -> str:
    """A run file's text; unreadable or non-UTF-8: a DataError naming `what` and the file."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise DataError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start})") from None


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(read_run_text(path, what))
    except ValueError as e:
        raise DataError(f"{what} {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DataError(f"{what} {str(path)!r} is not a JSON object")
    return data
