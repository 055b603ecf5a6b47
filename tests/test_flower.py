"""fedlora on Flower: run-config mapping, env safety, and loopback deployments.

The deployment tests start `flower-superlink` and two `flower-supernode` processes on
127.0.0.1 (insecure, free ports), submit the app with `flwr run`, and stop what they started by
PID. Flower 1.41 runs every message in a fresh `flwr-clientapp` process, so each round costs
a Python start + torch import per node: these tests take minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.flower.common import (
    LOOPBACK,
    SAFE_ENV,
    FlowerOptions,
    LocalDeployment,
    check_loopback,
    config_from_run_config,
    descendants,
    free_port,
    safe_env,
    wait_for_file,
)

REPO = Path(__file__).resolve().parents[1]
DATA = os.environ.get("FEDLORA_DATA", str(REPO.parent / "shared" / "data" / "commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason=f"no data at {DATA}")

TINY = """
[model]
name = "tiny-llama"
dtype = "fp32"
threads = 1
[lora]
rank = 4
[data]
data_dir = "{data}"
n_clients = 2
train_limit = 40
eval_limit = 8
tasks = ["arc-e"]
max_seq_len = 64
[training]
rounds = {rounds}
local_steps = 2
batch_size = 2
slots = 1
eval_every = 1
seed = 3
[method]
q = {q}
k = "uniform"
"""


def _write_config(tmp_path: Path, rounds: int, q: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(TINY.format(data=Path(DATA).resolve(), rounds=rounds, q=q), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- fast


def test_run_config_maps_to_fedlora_config(tmp_path: Path) -> None:
    # Prepare
    path = _write_config(tmp_path, rounds=2, q='"full"')
    run_config = {
        "fedlora-config": str(path),
        "fedlora-overrides": "training.rounds=5 'method.q=[0.5, 0.25]'",
        "out-dir": str(tmp_path / "out"),
        "round-timeout-s": 30.0,
        "availability": "observed",
    }
    # Execute
    cfg, opts = config_from_run_config(run_config)
    # Assert
    expected = load_config(path, ["training.rounds=5", "method.q=[0.5, 0.25]"])
    assert cfg == expected
    assert cfg.method.q == (0.5, 0.25) and cfg.training.rounds == 5
    assert opts == FlowerOptions(
        out_dir=str(tmp_path / "out"), round_timeout_s=30.0, availability="observed"
    )


def test_run_config_defaults_are_fedlora_defaults() -> None:
    cfg, opts = config_from_run_config({})
    assert cfg == load_config()
    assert opts == FlowerOptions()


@pytest.mark.parametrize(
    ("run_config", "field"),
    [
        ({"round-timout-s": 3.0}, "round-timout-s"),
        ({"round-timeout-s": 0.0}, "round-timeout-s"),
        ({"poll-interval-s": -1.0}, "poll-interval-s"),
        ({"availability": "guess"}, "availability"),
        ({"fedlora-overrides": "training.rounds=0"}, "training.rounds"),
        ({"fedlora-overrides": "'unclosed"}, "fedlora-overrides"),
        ({"fedlora-overrides": 3}, "fedlora-overrides"),
    ],
)
def test_bad_run_config_names_the_field(run_config: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from_run_config(run_config)


def test_pyproject_declares_the_flower_app_and_every_run_config_key() -> None:
    import tomllib

    from fedlora.flower.common import RUN_CONFIG_KEYS

    app = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "fedlora.flower.server_app:app",
        "clientapp": "fedlora.flower.client_app:app",
    }
    assert set(app["config"]) == set(RUN_CONFIG_KEYS)
    # the declared defaults are valid
    config_from_run_config({k: v for k, v in app["config"].items()})


def test_safe_env_turns_off_telemetry_update_check_and_ray_stats() -> None:
    env = safe_env({"PATH": "/bin", "FLWR_TELEMETRY_ENABLED": "1"})
    assert env["FLWR_TELEMETRY_ENABLED"] == "0"
    assert env["FLWR_DISABLE_UPDATE_CHECK"] == "1"
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["PATH"] == "/bin"
    assert set(SAFE_ENV) <= set(env)


def test_importing_the_apps_sets_the_safe_env() -> None:
    import fedlora.flower.client_app  # noqa: F401
    import fedlora.flower.server_app  # noqa: F401

    for key, value in SAFE_ENV.items():
        assert os.environ[key] == value


@pytest.mark.parametrize("address", ["0.0.0.0:9092", "localhost:9092", "[::]:9092", "127.0.0.1"])
def test_check_loopback_refuses_other_addresses(address: str) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        check_loopback(address, "superlink")


def test_free_port_is_on_loopback_and_bindable() -> None:
    import socket

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


def _final_global(run_dir: Path) -> dict[str, np.ndarray]:
    import torch

    ckpt = sorted((run_dir / "checkpoints").glob("round-*.pt"))[-1]
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    return {k: np.asarray(v) for k, v in state["global"].items()}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@needs_data
def test_loopback_deployment_matches_the_engine(tmp_path: Path) -> None:
    # Prepare: the same config (2 clients, q = 0.7 so sampling matters) for both runtimes
    from fedlora.engine import prepare_run_dir, run_experiment

    path = _write_config(tmp_path, rounds=2, q="[0.7, 0.9]")
    cfg = load_config(path)
    out = tmp_path / "flower-run"
    # Execute: Flower
    with LocalDeployment(2, tmp_path / "deploy") as dep:
        dep.submit(REPO, {"fedlora-config": str(path), "out-dir": str(out)})
        wait_for_file(out / "summary.json", 900, alive=[dep.superlink], error=out / "error.txt")
        pids = [dep.superlink.pid, *(p.pid for p in dep.supernodes)]
    # Execute: fedlora's own engine
    ref = tmp_path / "engine-run"
    prepare_run_dir(cfg, ref)
    run_experiment(cfg, ref, quiet=True)
    # Assert: what we started is gone
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    # Assert: same sampled sets, same final adapter
    flower_lines, engine_lines = _metrics(out), _metrics(ref)
    assert [x["participants"] for x in flower_lines] == [x["participants"] for x in engine_lines]
    assert [x["k"] for x in flower_lines] == [x["k"] for x in engine_lines]
    assert all(x["dropouts"] == [] for x in flower_lines)
    got, want = _final_global(out), _final_global(ref)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(not np.allclose(v, 0) for k, v in got.items() if k.endswith("lora_B"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["runtime"] == "flower"
    assert (out / "adapter").is_dir()


@pytest.mark.slow
@needs_data
def test_killed_node_is_recorded_as_dropout(tmp_path: Path) -> None:
    # Prepare: every client sampled every round (q = 1)
    path = _write_config(tmp_path, rounds=1, q='"full"')
    out = tmp_path / "flower-run"
    with LocalDeployment(2, tmp_path / "deploy") as dep:
        dep.submit(
            REPO, {"fedlora-config": str(path), "out-dir": str(out), "round-timeout-s": 60.0}
        )
        # Execute: kill node 1 once the run has identified the nodes (round 0 evaluated)
        wait_for_file(out / "metrics.jsonl", 900, alive=[dep.superlink], error=out / "error.txt")
        dep.kill_node(1)
        wait_for_file(out / "summary.json", 900, alive=[dep.superlink], error=out / "error.txt")
    # Assert: the run finished, client 1 dropped out, client 0's update was applied
    lines = _metrics(out)
    assert [x["round"] for x in lines] == [0, 1]
    assert lines[1]["participants"] == [0, 1]
    assert lines[1]["dropouts"] == [1]
    assert lines[1]["train_loss"] is not None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total_dropouts"] == 1
