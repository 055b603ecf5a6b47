"""fedlora.federation.flower.worker, node and client_app: frames, the worker protocol and
its checks, each node's device, and a worker training exactly like the in-process node
(split from test_flower.py, issue 11)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.flower import worker
from fedlora.federation.flower.deploy import free_port
from fedlora.federation.flower.worker import LOOPBACK, check_loopback
from fedlora.federation.trainable import Trainable
from flower_cases import needs_data, write_config

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


@pytest.mark.parametrize("address", ["0.0.0.0:9092", "localhost:9092", "[::]:9092", "127.0.0.1"])
def test_check_loopback_refuses_other_addresses(address: str) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        check_loopback(address, "superlink")


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


def test_the_worker_module_exits_2_on_a_bad_port() -> None:
    from fedlora.federation.flower.deploy import worker_argv

    argv = worker_argv(70000)
    assert argv[1:3] == ["-m", "fedlora.federation.flower.worker_main"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--port = 70000" in proc.stderr and "Traceback" not in proc.stderr


def test_the_worker_module_serves_a_ping(tmp_path: Path) -> None:
    # what LocalDeployment starts for each node: its own module, answering on 127.0.0.1
    from fedlora.federation.flower.deploy import worker_argv

    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [*worker_argv(0, tmp_path), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_file.exists(), proc.stderr.read() if proc.poll() is not None else "timeout"
        port = int(port_file.read_text())
        reply, _ = worker.call(f"{worker.LOOPBACK}:{port}", {"op": "ping"}, timeout_s=30)
        assert reply["ok"] and reply["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_client_app_reads_and_checks_the_worker_address() -> None:
    from types import SimpleNamespace

    from fedlora.federation.flower.client_app import worker_address

    assert worker_address(SimpleNamespace(node_config={})) is None
    ctx = SimpleNamespace(node_config={"worker-address": "127.0.0.1:7001"})
    assert worker_address(ctx) == "127.0.0.1:7001"
    with pytest.raises(ConfigError, match="worker-address"):
        worker_address(SimpleNamespace(node_config={"worker-address": "0.0.0.0:7001"}))


def test_each_node_picks_its_own_device_from_node_config(monkeypatch) -> None:
    from types import SimpleNamespace

    from fedlora.config import dump_toml
    from fedlora.federation.flower.client_app import config_from_message

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

    from fedlora.federation.flower import node

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
    from fedlora.federation.flower import node

    cfg = load_config(write_config(tmp_path, rounds=1, q='"full"'))
    state = node.client_state(cfg)
    assert isinstance(state, Trainable)  # the engine's Run is one too
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
