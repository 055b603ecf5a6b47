"""fedlora.federation.flower.simulation: the Ray backend stays on loopback, and a simulated
run matches the engine and resumes (split from test_flower.py, issue 11)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlora.errors import ConfigError
from fedlora.federation.flower.common import safe_env
from fedlora.federation.flower.processes import descendants
from fedlora.federation.flower.worker import LOOPBACK
from flower_cases import (
    assert_matches_engine,
    needs_data,
    read_metrics,
    write_config,
)

# ----------------------------------------------------------------------------- Ray simulation


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _hex_ip(text: str) -> str:
    raw = bytes.fromhex(text)  # /proc/net: 32-bit words in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _listening_addresses(pids: set[int]) -> set[str]:
    """Local IPs of listening TCP and bound UDP sockets held by `pids` (from /proc/net)."""
    inodes = _socket_inodes(pids)
    found = set()
    for table, listen_state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == listen_state and f[9] in inodes:
                found.add(_hex_ip(f[1].split(":")[0]))
    return found


def _is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def test_proc_net_addresses_are_decoded() -> None:
    # Prepare: a listener on 127.0.0.1 held by this process
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen(1)
        # Execute
        found = _listening_addresses({os.getpid()})
    # Assert
    assert LOOPBACK in found
    assert _hex_ip("0100007F") == "127.0.0.1"
    assert _hex_ip("0000000000000000FFFF00000100007F") == "::ffff:127.0.0.1"
    assert _is_loopback("::ffff:127.0.0.1") and _is_loopback("::1")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("::") and not _is_loopback("10.1.2.3")


def test_ray_backend_config_is_loopback_without_dashboard() -> None:
    from fedlora.federation.flower.simulation import RAY_ENV, ray_backend_config

    bc = ray_backend_config(num_cpus=2, client_num_cpus=1.0)
    assert bc["init_args"]["_node_ip_address"] == LOOPBACK
    assert bc["init_args"]["include_dashboard"] is False
    assert bc["init_args"]["num_cpus"] == 2
    assert bc["client_resources"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert RAY_ENV["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert RAY_ENV["RAY_USAGE_STATS_ENABLED"] == "0"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_cpus": 0}, "num_cpus"), ({"num_cpus": 1.5}, "num_cpus"),
     ({"client_num_cpus": 0.0}, "client_num_cpus"),
     ({"num_cpus": 1, "client_num_cpus": 2.0}, "client_num_cpus"),
     ({"object_store_mb": 10}, "object_store_mb")],
)  # fmt: skip
def test_ray_backend_config_rejects_bad_resources(kwargs: dict, field: str) -> None:
    from fedlora.federation.flower.simulation import ray_backend_config

    with pytest.raises(ConfigError, match=field):
        ray_backend_config(**kwargs)


def _run_python(code: str) -> str:
    env = {k: v for k, v in safe_env().items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return done.stdout.strip()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_env_makes_ray_resolve_the_node_to_loopback() -> None:
    # Execute: in fresh processes (Ray reads the variable when imported); Ray is not started
    with_env = _run_python(
        "from fedlora.federation.flower.simulation import apply_ray_env; apply_ray_env(); "
        "from ray._private import ray_constants, services; "
        "print(ray_constants.ENABLE_RAY_CLUSTER, services.resolve_ip_for_localhost('127.0.0.1'))"
    )
    without = _run_python(
        "from ray._private import ray_constants; print(ray_constants.ENABLE_RAY_CLUSTER)"
    )
    # Assert: without it, ray.init would turn 127.0.0.1 into the machine's routable address
    assert with_env == "False 127.0.0.1"
    assert without == "True"


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_imported_in_cluster_mode_is_refused() -> None:
    out = _run_python(
        "import ray\n"
        "from fedlora.errors import ConfigError\n"
        "from fedlora.federation.flower.simulation import apply_ray_env\n"
        "try:\n    apply_ray_env()\n    print('accepted')\n"
        "except ConfigError as e:\n    print('refused:', e)"
    )
    assert out.startswith("refused:") and "loopback" in out


@pytest.mark.slow
@needs_data
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_simulation_matches_the_engine_on_loopback_and_resumes(tmp_path: Path) -> None:
    # Prepare: the engine-equivalence config; the simulation runs in its own process so Ray
    # starts fresh and its whole process tree can be watched
    path = write_config(tmp_path, rounds=2, q="[0.7, 0.9]")
    out = tmp_path / "sim-run"
    # Execute: run it, sampling the listening sockets of its process tree
    seen, tree = _simulate(["--config", str(path), "--out", str(out)], tmp_path / "sim.log")
    # Assert: Ray listened (the probe saw it), only on loopback, and is gone
    assert seen, "no listening socket seen: the probe did not work"
    assert all(_is_loopback(ip) for ip in seen), seen
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() for p in tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in tree if Path(f"/proc/{p}").exists()]
    # Assert: the run is the engine's
    assert_matches_engine(out, path, tmp_path)

    # Prepare: a crash after round 1 (round 2's checkpoint and summary lost; its metrics line
    # written, so resume must cut it)
    before = read_metrics(out)
    (out / "checkpoints" / "round-000002.safetensors").unlink()
    (out / "summary.json").unlink()
    # Execute
    seen, _ = _simulate(["--resume", str(out)], tmp_path / "resume.log")
    # Assert: round 2 ran again from round 1's checkpoint, to the engine's result
    after = read_metrics(out)
    assert [x["round"] for x in after] == [0, 1, 2]
    assert after[:2] == before[:2]
    assert after[2]["participants"] == before[2]["participants"]
    assert after[2]["train_loss"] == pytest.approx(before[2]["train_loss"], rel=1e-6)
    assert all(_is_loopback(ip) for ip in seen), seen
    assert_matches_engine(out, path, tmp_path)
    # machine.jsonl: the server's machine, the SuperNodes train; the resume from round 1
    machines = [json.loads(x) for x in (out / "machine.jsonl").read_text().splitlines()]
    assert [(m["from_round"], m["trains"]) for m in machines] == [(0, "remote"), (1, "remote")]


def _simulate(cli_args: list[str], log_path: Path) -> tuple[set[str], set[int]]:
    """`fedlora flower simulate ARGS` in a new process; returns the IPs its process tree
    listened on (sampled every 0.3 s) and the PIDs of that tree. Fails on a non-zero exit."""
    args = [sys.executable, "-m", "fedlora.cli", "flower", "simulate", *cli_args, "--num-cpus", "2"]
    seen: set[str] = set()
    tree: set[int] = set()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=safe_env(HF_HUB_OFFLINE="1"),
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 900
            while proc.poll() is None and time.monotonic() < deadline:
                pids = {proc.pid, *descendants(proc.pid)}
                tree |= pids
                seen |= _listening_addresses(pids)
                time.sleep(0.3)
        finally:
            if proc.poll() is None:
                for pid in [*descendants(proc.pid), proc.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    return seen, tree
