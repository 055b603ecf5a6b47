"""fedlora on Flower: run-config mapping, env safety, and loopback deployments.

The deployment tests start two persistent fedlora workers, `flower-superlink` and two
`flower-supernode` processes on 127.0.0.1 (insecure, free ports), submit the app with
`flwr run`, and stop what they started by PID. Flower 1.41 still runs every message in a fresh
`flwr-clientapp` process (a Python start + flwr import per node and round); the workers keep
the model and the tokenized data loaded across rounds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.flower import worker
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
layers = "all"
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
checkpoint_every = 1
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


def test_client_app_imports_only_light_modules() -> None:
    # Flower starts a fresh ClientApp process per message: its imports are paid every round
    code = (
        "import sys, fedlora.flower.client_app; "
        "print(sorted(m for m in ('torch', 'transformers', 'fedlora.engine', 'fedlora.data', "
        "'fedlora.methods', 'scipy') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=safe_env()
    )
    assert done.stdout.strip() == "[]"


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


@pytest.mark.parametrize(
    ("overrides", "allowed"),
    [(["method.name=sketched"], True), (["method.name=fedavg"], True),
     (["method.name=fedstacklora"], False), (["method.name=proposed"], False),
     (["method.name=proposed", "method.q={plan}", "method.k={plan}"], True)],
)  # fmt: skip
def test_flower_refuses_methods_it_cannot_run_like_the_engine(
    tmp_path: Path, overrides: list[str], allowed: bool
) -> None:
    from fedlora.flower.common import check_flower_method

    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    cfg = load_config(None, [o.format(plan=f'"{plan}"') for o in overrides])
    if allowed:
        check_flower_method(cfg)
    else:
        with pytest.raises(ConfigError, match=f"method.name = '{cfg.method.name}'"):
            check_flower_method(cfg)


def test_cli_refuses_fedstacklora_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedlora.cli import main

    out = tmp_path / "run"
    for action in ("run-local", "simulate"):
        assert main(["flower", action, "--out", str(out), "method.name=fedstacklora"]) == 2
        assert "fedstacklora" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- node worker


def _roundtrip(frame: bytes) -> tuple[dict, dict]:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        return worker.read_frame(b)


def test_frame_roundtrip_keeps_header_and_arrays_bit_exact() -> None:
    # Prepare: arrays of every allowed dtype, including 0-d, empty and a non-contiguous view
    rng = np.random.default_rng(0)
    arrays = {
        "a.lora_A": rng.standard_normal((3, 5)).astype(np.float32),
        "b.lora_B": rng.standard_normal((4, 2)).T,  # float64, non-contiguous (2, 4)
        "steps": np.arange(6, dtype=np.int64).reshape(2, 3),
        "count": np.array(7, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    header = {"op": "train", "task": {"client": 1, "scale": [1.0, 0.5]}}
    # Execute
    got_header, got = _roundtrip(worker.encode(header, arrays))
    # Assert
    assert got_header == header
    assert list(got) == list(arrays)
    for name, want in arrays.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want)


def test_frame_without_arrays() -> None:
    header, arrays = _roundtrip(worker.encode({"op": "ping"}))
    assert header == {"op": "ping"} and arrays == {}


def test_encode_refuses_unsupported_dtypes_naming_the_array() -> None:
    with pytest.raises(ConfigError, match="'z'.*complex|'z'.*<c8"):
        worker.encode({}, {"z": np.zeros(2, dtype=np.complex64)})
    with pytest.raises(ConfigError, match="'obj'"):
        worker.encode({}, {"obj": np.array([object()], dtype=object)})


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"XXXX" + bytes(12), "magic"),
        (worker._PREFIX.pack(worker.MAGIC, worker.MAX_HEADER_BYTES + 1, 0), "too large"),
        (worker._PREFIX.pack(worker.MAGIC, 2, 0) + b"[]", "JSON object"),
        (worker._PREFIX.pack(worker.MAGIC, 2, 0), "connection closed after 0 of 2"),
    ],
)
def test_read_frame_rejects_malformed_frames(frame: bytes, message: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(worker.WorkerError, match=message):
            worker.read_frame(b)


def test_read_frame_rejects_an_array_outside_the_body() -> None:
    # Prepare: a valid frame whose array spec claims 8 bytes more than the body holds
    head = json.dumps(
        {"arrays": [{"name": "x", "dtype": "<f4", "shape": [4], "offset": 0, "nbytes": 16}]}
    ).encode()
    frame = worker._PREFIX.pack(worker.MAGIC, len(head), 8) + head + bytes(8)
    # Execute / Assert
    with pytest.raises(worker.WorkerError, match="bad array spec"):
        _roundtrip(frame)


@pytest.mark.parametrize("address", ["0.0.0.0:9000", "10.0.0.1:9000", "localhost:9000"])
def test_worker_call_refuses_non_loopback_addresses(address: str) -> None:
    with pytest.raises(ConfigError, match="worker-address"):
        worker.call(address, {"op": "ping"})


def test_worker_call_to_a_closed_port_is_a_worker_error() -> None:
    with pytest.raises(worker.WorkerError, match="fedlora worker at 127.0.0.1"):
        worker.call(f"{LOOPBACK}:{free_port()}", {"op": "ping"}, timeout_s=5)


@pytest.mark.parametrize(
    ("port", "data_dir", "field"),
    [(70000, None, "--port"), (-1, None, "--port"), (True, None, "--port"),
     (0, "/nonexistent/data", "--data-dir")],
)  # fmt: skip
def test_worker_args_are_checked(port: object, data_dir: str | None, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        worker.check_serve_args(port, data_dir)  # type: ignore[arg-type]


def test_cli_worker_with_a_bad_port_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from fedlora.cli import main

    assert main(["flower", "worker", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "--port = 70000" in err and "0..65535" in err and "Traceback" not in err


def test_client_app_reads_and_checks_the_worker_address() -> None:
    from types import SimpleNamespace

    from fedlora.flower.client_app import worker_address

    assert worker_address(SimpleNamespace(node_config={})) is None
    ctx = SimpleNamespace(node_config={"worker-address": "127.0.0.1:7001"})
    assert worker_address(ctx) == "127.0.0.1:7001"
    with pytest.raises(ConfigError, match="worker-address"):
        worker_address(SimpleNamespace(node_config={"worker-address": "0.0.0.0:7001"}))


def test_each_node_picks_its_own_device_from_node_config(monkeypatch) -> None:
    from types import SimpleNamespace

    from fedlora.config import dump_toml
    from fedlora.flower.client_app import config_from_message

    # the server ran on a GPU: its resolved config names cuda:0; a node decides for itself
    text = dump_toml(load_config(None, ['model.device="cuda:0"', "model.dtype=bf16"]))
    message = SimpleNamespace(
        content=SimpleNamespace(config_records={"fedlora": {"config-toml": text}})
    )

    def device_of(nc: dict) -> str:
        return config_from_message(message, SimpleNamespace(node_config=nc)).model.device

    assert device_of({}) == "auto"
    assert device_of({"device": "cuda:1"}) == "cuda:1"
    assert device_of({"device": "cpu"}) == "cpu"
    with pytest.raises(ConfigError, match=r"model.device = 'gpu1' is invalid: allowed: auto"):
        device_of({"device": "gpu1"})
    # a device the node does not have is refused before the model loads
    import torch

    from fedlora.flower import node

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = config_from_message(message, SimpleNamespace(node_config={"device": "cuda:1"}))
    with pytest.raises(ConfigError, match=r"'cuda:1' is invalid: not available.*available: cpu"):
        node.client_state(cfg)


class _ThreadWorker:
    """`worker.serve` on a free loopback port in a daemon thread, for `n` requests."""

    def __init__(self, n: int, data_dir: str | None = None) -> None:
        bound: list[int] = []
        ready = threading.Event()

        def on_ready(port: int) -> None:
            bound.append(port)
            ready.set()

        self.thread = threading.Thread(
            target=worker.serve,
            args=(0,),
            kwargs={"data_dir": data_dir, "max_requests": n, "ready": on_ready},
            daemon=True,
        )
        self.thread.start()
        assert ready.wait(30)
        self.address = f"{LOOPBACK}:{bound[0]}"


def test_worker_answers_ping_and_reports_bad_ops_without_dying() -> None:
    # Prepare
    w = _ThreadWorker(n=3)
    # Execute / Assert: a failure comes back as an error reply; the worker serves on
    reply, _ = worker.call(w.address, {"op": "ping"})
    assert reply["ok"] and reply["pid"] == os.getpid() and reply["requests"] == 1
    with pytest.raises(worker.WorkerError, match="op = 'bogus'.*ping, query, train"):
        worker.call(w.address, {"op": "bogus"})
    reply, _ = worker.call(w.address, {"op": "ping"})
    assert reply["requests"] == 3
    w.thread.join(10)
    assert not w.thread.is_alive()


@needs_data
def test_worker_trains_exactly_like_the_in_process_node(tmp_path: Path) -> None:
    # Prepare: the tiny config, the untrained global adapter, client 1's task in round 0
    from fedlora.config import dump_toml
    from fedlora.flower import node

    cfg = load_config(_write_config(tmp_path, rounds=1, q='"full"'))
    state = node.client_state(cfg)
    global_adapter = {k: v.numpy().copy() for k, v in state.lora.global_state().items()}
    task = {"client": 1, "round": 0, "index": 1, "scale": [1.0] * cfg.lora.rank,
            "rank-used": cfg.lora.rank, "weight": 1.0}  # fmt: skip
    w = _ThreadWorker(n=3)
    text = dump_toml(cfg)
    # Execute: query, then the same task twice through the worker
    query, _ = worker.call(w.address, {"op": "query", "config_toml": text, "partition_id": 1})
    header = {"op": "train", "config_toml": text, "task": task}
    reply1, got1 = worker.call(w.address, header, global_adapter)
    reply2, got2 = worker.call(w.address, header, global_adapter)
    want, want_loss = node.train_one(state, global_adapter, task)
    # Assert: |D_1|, the adapter and the loss are the in-process ones, bit for bit, and the
    # kept state does not leak from one request into the next
    assert query["n_examples"] == len(state.fed.client_indices[1]) > 0
    assert reply1["loss"] == reply2["loss"] == want_loss
    assert set(got1) == set(want)
    for name in want:
        np.testing.assert_array_equal(got1[name], want[name], err_msg=name)
        np.testing.assert_array_equal(got2[name], want[name], err_msg=name)
    assert any(not np.allclose(want[k], global_adapter[k]) for k in want)


# ----------------------------------------------------------------------------- deployments


def _final_global(run_dir: Path) -> dict[str, np.ndarray]:
    from fedlora.rundir import load_checkpoint

    state = load_checkpoint(run_dir)
    return {k: np.asarray(v) for k, v in state["global"].items()}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _engine_run(config_path: Path, tmp_path: Path) -> Path:
    """fedlora's own engine on the same config (run once per test)."""
    from fedlora.engine import prepare_run_dir, run_experiment

    ref = tmp_path / "engine-run"
    if not (ref / "summary.json").exists():
        cfg = load_config(config_path)
        prepare_run_dir(cfg, ref)
        run_experiment(cfg, ref, quiet=True)
    return ref


def _assert_matches_engine(out: Path, config_path: Path, tmp_path: Path) -> None:
    """Same sampled sets, ranks and final adapter as the engine on the same config."""
    ref = _engine_run(config_path, tmp_path)
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
    assert summary["rounds"] == len(engine_lines) - 1 and summary["runtime"] == "flower"
    assert (out / "adapter").is_dir()


@pytest.mark.slow
@needs_data
def test_loopback_deployment_matches_the_engine(tmp_path: Path) -> None:
    # Prepare: the same config (2 clients, q = 0.7 so sampling matters) for both runtimes
    path = _write_config(tmp_path, rounds=2, q="[0.7, 0.9]")
    out = tmp_path / "flower-run"
    # Execute: Flower
    with LocalDeployment(2, tmp_path / "deploy") as dep:
        dep.submit(REPO, {"fedlora-config": str(path), "out-dir": str(out)})
        wait_for_file(out / "summary.json", 900, alive=[dep.superlink], error=out / "error.txt")
        pids = dep.pids()
        assert len(pids) == 5  # 2 workers, 2 SuperNodes, 1 SuperLink
    # Assert: what we started is gone; the run is the engine's
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    _assert_matches_engine(out, path, tmp_path)


@pytest.mark.slow
@needs_data
def test_killed_node_is_recorded_as_dropout(tmp_path: Path) -> None:
    # Prepare: every client sampled every round (q = 1)
    path = _write_config(tmp_path, rounds=1, q='"full"')
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
    lines = _metrics(out)
    assert [x["round"] for x in lines] == [0, 1]
    assert lines[1]["participants"] == [0, 1]
    assert lines[1]["dropouts"] == [1]
    assert lines[1]["train_loss"] is not None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total_dropouts"] == 1


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
    from fedlora.flower.simulation import RAY_ENV, ray_backend_config

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
    from fedlora.flower.simulation import ray_backend_config

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
        "from fedlora.flower.simulation import apply_ray_env; apply_ray_env(); "
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
        "from fedlora.flower.simulation import apply_ray_env\n"
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
    path = _write_config(tmp_path, rounds=2, q="[0.7, 0.9]")
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
    _assert_matches_engine(out, path, tmp_path)

    # Prepare: a crash after round 1 (round 2's checkpoint and summary lost; its metrics line
    # written, so resume must cut it)
    before = _metrics(out)
    (out / "checkpoints" / "round-000002.safetensors").unlink()
    (out / "summary.json").unlink()
    # Execute
    seen, _ = _simulate(["--resume", str(out)], tmp_path / "resume.log")
    # Assert: round 2 ran again from round 1's checkpoint, to the engine's result
    after = _metrics(out)
    assert [x["round"] for x in after] == [0, 1, 2]
    assert after[:2] == before[:2]
    assert after[2]["participants"] == before[2]["participants"]
    assert after[2]["train_loss"] == pytest.approx(before[2]["train_loss"], rel=1e-6)
    assert all(_is_loopback(ip) for ip in seen), seen
    _assert_matches_engine(out, path, tmp_path)


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
