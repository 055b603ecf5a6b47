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

from fedlora.errors import ConfigError, DataError

NODE_TIMES = "node_times.csv"
NODE_TIMES_COLUMNS = (
    "round", "client", "node_id", "rank_used", "local_steps", "train_s", "upload_params",
    "upload_bytes",
)  # fmt: skip


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
    new = not path.exists()
    with path.open("a", encoding="utf-8") as f:
        if new:
            f.write(",".join(NODE_TIMES_COLUMNS) + "\n")
        for row in rows:
            f.write(",".join(repr(row[c]) for c in NODE_TIMES_COLUMNS) + "\n")


def read_node_times(run_dir: Path) -> list[dict[str, float]]:
    """node_times.csv's rows (numbers), the last one per (round, client); DataError when the
    run has none (not a Flower run, or one from before fedlora measured)."""
    path = run_dir / NODE_TIMES
    if not path.is_file():
        raise DataError(
            f"{path} does not exist: measured profiles come from a run on Flower "
            "(fedlora flower run / deploy) whose nodes report their times"
        )
    rows: dict[tuple[int, int], dict[str, float]] = {}
    with path.open(encoding="utf-8") as f:
        for n, raw in enumerate(csv.DictReader(f), start=2):
            try:
                row = {c: float(raw[c]) for c in NODE_TIMES_COLUMNS}
            except (KeyError, TypeError, ValueError):
                raise DataError(f"{path}: line {n} is not a row of {NODE_TIMES_COLUMNS}") from None
            rows[(int(row["round"]), int(row["client"]))] = row
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
