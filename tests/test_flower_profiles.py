"""Measured profiles from a Flower deployment: the nodes' reported training times and upload
sizes (node_times.csv) fitted into a profile file (`fedlora profiles fit`)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError, DataError
from fedlora.federation.flower.deploy import LocalDeployment, wait_for_file
from fedlora.federation.flower.measured import (
    append_node_times,
    fit_profiles,
    read_node_times,
)
from fedlora.files import load_profiles
from flower_cases import REPO, needs_data, read_metrics, write_config


def _row(rnd: int, client: int, train_s: float, params: int = 100) -> dict:
    return {"round": rnd, "client": client, "node_id": 7 + client, "rank_used": 4,
            "local_steps": 2, "train_s": train_s, "upload_params": params,
            "upload_bytes": 4 * params}  # fmt: skip


def test_fit_by_hand(tmp_path: Path) -> None:
    # client 0: median of 1, 5, 2 = 2; client 1: median of 3, 4 = 3.5
    append_node_times(tmp_path, [_row(1, 0, 1.0), _row(1, 1, 3.0)])
    append_node_times(tmp_path, [_row(2, 0, 9.0), _row(2, 1, 4.0)])
    append_node_times(tmp_path, [_row(2, 0, 5.0)])  # a resumed run replays round 2: kept last
    append_node_times(tmp_path, [_row(3, 0, 2.0)])
    rows = read_node_times(tmp_path)
    assert [(r["round"], r["client"], r["train_s"]) for r in rows] == [
        (1, 0, 1.0), (1, 1, 3.0), (2, 0, 5.0), (2, 1, 4.0), (3, 0, 2.0)
    ]  # fmt: skip
    fitted = fit_profiles(rows, 2, 16, np.array([2.0, 4.0]))
    assert [f["tau_full_s"] for f in fitted] == [2.0, 3.5]
    assert [f["t_full"] for f in fitted] == [100 * 16 / 2.0, 100 * 16 / 4.0]
    assert [f["rounds_measured"] for f in fitted] == [3, 2]
    with pytest.raises(DataError, match=r"client\(s\) \[2\]"):
        fit_profiles(rows, 3, 16, np.array([2.0, 4.0, 1.0]))
    with pytest.raises(ConfigError, match="--spectral-efficiency"):
        fit_profiles(rows, 2, 16, np.array([2.0, np.nan]))


def test_fit_refuses_a_run_without_measurements(tmp_path: Path, capsys) -> None:
    with pytest.raises(DataError, match="node_times.csv does not exist"):
        read_node_times(tmp_path)
    assert main(["profiles", "fit", str(tmp_path), "-o", str(tmp_path / "p.txt")]) == 2
    assert "--output" in capsys.readouterr().err
    assert main(["profiles", "fit", str(tmp_path / "none"), "-o", str(tmp_path / "p.csv")]) == 2
    assert "RUN_DIR" in capsys.readouterr().err


@pytest.mark.slow
@needs_data
def test_slowed_node_is_measured_slower(tmp_path: Path, capsys) -> None:
    # Prepare: two nodes, node 0 slowed by 0.4 s per local step (H = 2: +0.8 s a round)
    path = write_config(tmp_path, rounds=2, q='"full"')
    with path.open("a") as f:  # and the trackers work on Flower's loop too
        f.write('[output]\ntrackers = ["tensorboard"]\n')
    out = tmp_path / "flower-run"
    slow = [{"step-delay-s": 0.4}, {"step-delay-s": 0.0}]
    with LocalDeployment(2, tmp_path / "deploy", node_config=slow) as dep:
        dep.submit(REPO, {"fedlora-config": str(path), "out-dir": str(out)})
        wait_for_file(out / "summary.json", 900, alive=[dep.superlink], error=out / "error.txt")
    assert [x["round"] for x in read_metrics(out)] == [0, 1, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("sim_time_s")] == [0, 1, 2]
    rows = read_node_times(out)
    assert [(int(r["round"]), int(r["client"])) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["train_s"] >= 0.8 for r in rows if r["client"] == 0)
    # Execute: the profile file, read back as network.profiles_file reads it
    capsys.readouterr()
    assert main(["profiles", "fit", str(out), "-o", str(tmp_path / "profiles.csv")]) == 0
    profiles = load_profiles(tmp_path / "profiles.csv")
    # Assert: the slowed node is the slower one; t_full from the run's channel and payload
    assert profiles.tau_full_s[0] > profiles.tau_full_s[1] + 0.5
    with (out / "clients.csv").open() as f:
        channel = list(csv.DictReader(f))
    params = rows[0]["upload_params"]
    from safetensors.numpy import load_file

    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert params == sum(a.size for a in adapter.values())  # the full adapter (γ ranks)
    for n in range(2):
        se = float(channel[n]["spectral_efficiency"])
        assert profiles.t_full[n] == pytest.approx(params * 16 / se, rel=1e-12)
