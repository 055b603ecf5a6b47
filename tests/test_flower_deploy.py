"""fedlora.federation.flower.deploy: free loopback ports, finding a process's descendants,
and loopback deployments (LocalDeployment with the ServerApp and ClientApps): the same rounds
as the engine, a killed node as a dropout.

The slow deployment tests start two persistent fedlora workers, `flower-superlink` and two
`flower-supernode` processes on 127.0.0.1 (insecure, free ports), submit the app with
`flwr run`, and stop what they started by PID (split from test_flower.py, issue 11).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fedlora.errors import ConfigError
from fedlora.federation.flower.deploy import LocalDeployment, free_port, wait_for_file
from fedlora.federation.flower.processes import descendants
from fedlora.federation.flower.worker import LOOPBACK, check_loopback
from flower_cases import (
    REPO,
    assert_matches_engine,
    needs_data,
    read_metrics,
    write_config,
)

# ----------------------------------------------------------------------------- fast


def test_free_port_is_on_loopback_and_bindable() -> None:

    port = free_port()
    with socket.socket() as s:
        s.bind((LOOPBACK, port))
    check_loopback(f"{LOOPBACK}:{port}", "superlink")


def test_descendants_finds_grandchildren() -> None:
    # Prepare: sh -> sleep (a child of the shell)
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while not descendants(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Execute
        below = descendants(proc.pid)
        # Assert
        assert len(below) == 1
        assert "sleep" in Path(f"/proc/{below[0]}/cmdline").read_text()
    finally:
        for pid in [*descendants(proc.pid), proc.pid]:
            os.kill(pid, 9)
        proc.wait()


def test_local_deployment_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="n_nodes"):
        LocalDeployment(0, tmp_path)
    with pytest.raises(ConfigError, match="node_config"):
        LocalDeployment(2, tmp_path, node_config=[{}])


# ----------------------------------------------------------------------------- deployments


@pytest.mark.slow
@needs_data
def test_loopback_deployment_matches_the_engine(tmp_path: Path) -> None:
    # Prepare: the same config (2 clients, q = 0.7 so sampling matters) for both runtimes
    path = write_config(tmp_path, rounds=2, q="[0.7, 0.9]")
    out = tmp_path / "flower-run"
    # Execute: Flower
    with LocalDeployment(2, tmp_path / "deploy") as dep:
        dep.submit(REPO, {"fedlora-config": str(path), "out-dir": str(out)})
        wait_for_file(out / "summary.json", 900, alive=[dep.superlink], error=out / "error.txt")
        pids = dep.pids()
        assert len(pids) == 5  # 2 workers, 2 SuperNodes, 1 SuperLink
    # Assert: what we started is gone; the run is the engine's
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    assert_matches_engine(out, path, tmp_path)


@pytest.mark.slow
@needs_data
def test_killed_node_is_recorded_as_dropout(tmp_path: Path) -> None:
    # Prepare: every client sampled every round (q = 1)
    path = write_config(tmp_path, rounds=1, q='"full"')
    out = tmp_path / "flower-run"
    with LocalDeployment(2, tmp_path / "deploy") as dep:
        dep.submit(
            REPO, {"fedlora-config": str(path), "out-dir": str(out), "round-timeout-s": 30.0}
        )
        # Execute: kill node 1 once the run has identified the nodes (round 0 evaluated)
        wait_for_file(out / "metrics.jsonl", 900, alive=[dep.superlink], error=out / "error.txt")
        dep.kill_node(1)
        wait_for_file(out / "summary.json", 900, alive=[dep.superlink], error=out / "error.txt")
    # Assert: the run finished, client 1 dropped out, client 0's update was applied
    lines = read_metrics(out)
    assert [x["round"] for x in lines] == [0, 1]
    assert lines[1]["participants"] == [0, 1]
    assert lines[1]["dropouts"] == [1]
    assert lines[1]["train_loss"] is not None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total_dropouts"] == 1


# ----------------------------------------------------------------------------- Ray simulation
