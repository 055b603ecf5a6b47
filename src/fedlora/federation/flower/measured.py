"""Measured client profiles from a Flower deployment.

Every ``train`` reply carries the node's own measurements (`fedlora.federation.flower.
client_app`): ``train-s``, the local training time of the H steps, and ``upload-params`` /
``upload-bytes``, the adapter it sends back. The ServerApp appends one row per reply to
``<run dir>/node_times.csv``; `fit_profiles` turns them into the profile rows that
``network.profiles_file`` and `fedlora plan` read (docs/network.md):

    tau_full_s = the median of the client's measured train_s over the rounds it trained
    t_full     = upload_params × network.bits_per_param / SE_n   (s·Hz)

Assumptions (docs/flower.md): a node trains the full-shape slot whatever its sketch size k
(the unused ranks are masked, not removed), so its measured time is τ_n at k = γ, and the
median over rounds discounts a round slowed by something else on the device; the reply
carries the full adapter (γ ranks), so upload_params is the full payload, charged on the air
at the run's ``network.bits_per_param`` as the engine's clock does (the wire format is
fp32: ``upload_bytes``); a loopback link has no radio, so the spectral efficiency SE_n
(bit/s/Hz) is the run's simulated channel (``clients.csv``) or one value the user gives.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config.toml_io import read_user_file
from fedlora.errors import ConfigError, DataError, shown
from fedlora.files import append_file

NODE_TIMES = "node_times.csv"
NODE_TIMES_COLUMNS = (
    "round",
    "client",
    "node_id",
    "rank_used",
    "local_steps",
    "train_s",
    "upload_params",
    "upload_bytes",
)


def measured_row(cfg: Any, plan: Any, index: int, node_id: int, metrics: Any) -> dict[str, Any]:
    """One node_times.csv row from task `index` of `plan` and its reply's metrics."""
    task = plan.tasks[index]
    return {
        "round": plan.round + 1,
        "client": task.client,
        "node_id": node_id,
        "rank_used": task.rank_used,
        "local_steps": cfg.training.local_steps,
        "train_s": float(metrics["train-s"]),
        "upload_params": int(metrics["upload-params"]),
        "upload_bytes": int(metrics["upload-bytes"]),
    }


def append_node_times(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Append a round's rows to node_times.csv (header on first write). A resumed run may
    append a replayed round again; `read_node_times` keeps the last row per (round, client)."""
    path = run_dir / NODE_TIMES
    lines = [] if path.exists() else [",".join(NODE_TIMES_COLUMNS)]
    lines += [",".join(repr(row[c]) for c in NODE_TIMES_COLUMNS) for row in rows]
    append_file(path, "".join(x + "\n" for x in lines).encode("utf-8"))  # never through a link


# what each column of node_times.csv may hold: (integer?, lowest, lowest excluded?)
_COLUMN_RULES = {
    "round": (True, 1, False),
    "client": (True, 0, False),
    "node_id": (True, None, False),
    "rank_used": (True, 1, False),
    "local_steps": (True, 1, False),
    "train_s": (False, 0, True),
    "upload_params": (True, 1, False),
    "upload_bytes": (True, 0, False),
}


def _value(path: Path, line: int, column: str, raw: Any, n_clients: int | None) -> float:
    """One cell of node_times.csv as a number, or a DataError naming the file, the line,
    the column, the value and what is allowed."""
    integer, lo, lo_open = _COLUMN_RULES[column]
    hi = n_clients - 1 if column == "client" and n_clients is not None else None
    allowed = "an integer" if integer else "a number"
    if lo is not None:
        allowed += f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        allowed += f" and <= {hi} (the run's data.n_clients = {n_clients})"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    ok = math.isfinite(value) and (not integer or value.is_integer())
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        what = "missing" if raw is None else f"{shown(raw)} is invalid"
        raise DataError(
            f"{path}: line {line}: {column} {'' if raw is None else '= '}{what}: {allowed}"
        )
    return value


def read_node_times(run_dir: Path, n_clients: int | None = None) -> list[dict[str, float]]:
    """node_times.csv's rows (numbers), the last one per (round, client); DataError when the
    run has none (not a Flower run, or one from before fedlora measured), or naming the
    line and the column of a value that no node reports (a client outside 0..n_clients-1,
    a time that is not finite and > 0, ...)."""
    path = run_dir / NODE_TIMES
    if not path.exists():
        raise DataError(
            f"{path} does not exist: measured profiles come from a run on Flower "
            "(fedlora flower run / deploy) whose nodes report their times"
        )
    try:
        data = read_user_file(path, NODE_TIMES)
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path} is not UTF-8 text (line {line}, byte 0x{data[e.start]:02x}): fedlora "
            "writes it as CSV; restore it, or run the deployment again"
        ) from None
    rows: dict[tuple[int, int], dict[str, float]] = {}
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in NODE_TIMES_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise DataError(f"{path}: line 1 lacks the column(s) {', '.join(missing)}")
    try:
        for raw in reader:
            n = reader.line_num
            row = {c: _value(path, n, c, raw.get(c), n_clients) for c in NODE_TIMES_COLUMNS}
            rows[(int(row["round"]), int(row["client"]))] = row
    except csv.Error as e:
        raise DataError(f"{path}: line {reader.line_num} is not CSV ({e})") from None
    return [rows[key] for key in sorted(rows)]


def fit_profiles(
    rows: list[dict[str, float]],
    n_clients: int,
    bits_per_param: int,
    spectral_efficiency: np.ndarray,
    *,
    source: str = "node_times.csv",
) -> list[dict[str, float]]:
    """One profile row per client (tau_full_s, t_full, and what they came from).

    `spectral_efficiency`: (n_clients,) bit/s/Hz. A client without a measurement is a
    DataError (it never trained: sample it in a longer run)."""
    se = np.asarray(spectral_efficiency, dtype=float)  # (N,)
    missing = [n for n in range(n_clients) if not any(int(r["client"]) == n for r in rows)]
    if missing:
        raise DataError(
            f"{source}: no measurement for client(s) {missing}: every client must have "
            "trained at least once (more rounds, or a larger method.q)"
        )
    bad = [n for n in range(n_clients) if not (math.isfinite(se[n]) and se[n] > 0)]
    if bad:
        raise ConfigError(
            f"spectral efficiency of client(s) {bad} is unknown or not positive: give "
            "--spectral-efficiency (bit/s/Hz)"
        )
    out = []
    for n in range(n_clients):
        mine = [r for r in rows if int(r["client"]) == n]
        train_s = np.array([r["train_s"] for r in mine])  # (rounds,)
        params = max(r["upload_params"] for r in mine)
        out.append(
            {
                "tau_full_s": float(np.median(train_s)),
                "t_full": float(params * bits_per_param / se[n]),
                "rounds_measured": len(mine),
                "train_s_min": float(train_s.min()),
                "train_s_max": float(train_s.max()),
                "upload_params": int(params),
                "upload_bytes": int(max(r["upload_bytes"] for r in mine)),
                "spectral_efficiency_used": float(se[n]),
            }
        )
    return out
