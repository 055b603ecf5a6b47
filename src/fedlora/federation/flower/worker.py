"""A node-local persistent fedlora worker: keeps the model, the LoRA slot and the tokenized
partition loaded across rounds, so a Flower ClientApp (a fresh process per message in Flower
1.41) only forwards its request instead of rebuilding everything.

    fedlora flower worker --port 7001 [--data-dir /data/commonsense]
    flower-supernode ... --node-config 'partition-id=0 num-partitions=2 worker-address="127.0.0.1:7001"'

The worker listens on 127.0.0.1 only and serves one request at a time (one node = one
worker). Wire format (no pickle: nothing the peer sends is executed), one request and one
reply per connection:

    b"FLW1" | u32 header length | u64 body length | header (UTF-8 JSON) | body

The header is a JSON object; its ``arrays`` list names each array of the body
(``name``, ``dtype`` in ARRAY_DTYPES, ``shape``, ``offset``, ``nbytes``). Requests:
``{"op": "ping"}``, ``{"op": "query", "config_toml", "partition_id"}`` -> ``n_examples``,
``{"op": "train", "config_toml", "task"}`` + the global adapter -> ``loss`` + the trained
adapter. A reply is ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value

LOOPBACK = "127.0.0.1"


def check_loopback(address: str, what: str) -> None:
    """Refuse any address other than 127.0.0.1:<port>."""
    host, _, port = address.rpartition(":")
    if host != LOOPBACK or not port.isdigit():
        raise bad_value(what, address, f"an address {LOOPBACK}:<port> (loopback only)")


MAGIC = b"FLW1"
_PREFIX = struct.Struct("<4sIQ")  # magic, header bytes, body bytes
MAX_HEADER_BYTES = 16 << 20
MAX_BODY_BYTES = 16 << 30
ARRAY_DTYPES = ("<f4", "<f8", "<i8", "<i4")


class WorkerError(RuntimeError):
    """The worker could not be reached, broke the protocol, or reported a failure."""


# ----------------------------------------------------------------------------- wire format


def encode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    """One frame: `header` (JSON-able) plus `arrays` (contiguous little-endian copies)."""
    specs, chunks, offset = [], [], 0
    for name, value in (arrays or {}).items():
        a = np.asarray(value, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        if a.dtype.str not in ARRAY_DTYPES:
            raise bad_value(f"array {name!r} dtype", a.dtype.str, f"one of {ARRAY_DTYPES}")
        buf = a.tobytes()
        specs.append(
            {
                "name": name,
                "dtype": a.dtype.str,
                "shape": list(a.shape),
                "offset": offset,
                "nbytes": len(buf),
            }
        )
        chunks.append(buf)
        offset += len(buf)
    head = json.dumps({**header, "arrays": specs}).encode()
    return _PREFIX.pack(MAGIC, len(head), offset) + head + b"".join(chunks)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WorkerError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read one frame from `sock`: (header without ``arrays``, name -> array)."""
    magic, n_head, n_body = _PREFIX.unpack(_recv_exactly(sock, _PREFIX.size))
    if magic != MAGIC:
        raise WorkerError(f"not a fedlora worker frame (magic {magic!r}, expected {MAGIC!r})")
    if n_head > MAX_HEADER_BYTES or n_body > MAX_BODY_BYTES:
        raise WorkerError(f"frame too large: header {n_head} B, body {n_body} B")
    header = json.loads(_recv_exactly(sock, n_head))
    if not isinstance(header, dict):
        raise WorkerError("frame header is not a JSON object")
    body = _recv_exactly(sock, n_body)
    arrays: dict[str, np.ndarray] = {}
    for spec in header.pop("arrays", []):
        dtype, shape = spec["dtype"], tuple(int(s) for s in spec["shape"])
        start, nbytes = int(spec["offset"]), int(spec["nbytes"])
        if dtype not in ARRAY_DTYPES or start < 0 or start + nbytes > len(body):
            raise WorkerError(f"bad array spec {spec!r}")
        a = np.frombuffer(body, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=start)
        if a.size != int(np.prod(shape)):
            raise WorkerError(f"array {spec['name']!r}: {a.size} values for shape {shape}")
        arrays[str(spec["name"])] = a.reshape(shape)
    return header, arrays


# ----------------------------------------------------------------------------- client side


def call(
    address: str,
    header: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray] | None = None,
    *,
    timeout_s: float = 3600.0,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Send one request to the worker at `address` (127.0.0.1:<port>) and return its reply.

    Raises WorkerError if it cannot be reached, breaks the protocol, or reports a failure.
    """
    check_loopback(address, "worker-address")
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(encode(header, arrays))
            reply, out = read_frame(sock)
    except OSError as e:
        raise WorkerError(f"fedlora worker at {address}: {e}") from None
    if not reply.get("ok"):
        raise WorkerError(f"fedlora worker at {address}: {reply.get('error', 'failed')}")
    return reply, out


def wait_ready(address: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Ping `address` until the worker answers; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call(address, {"op": "ping"}, timeout_s=5.0)
            return
        except WorkerError:
            if not alive():
                raise WorkerError(f"the fedlora worker for {address} exited") from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no fedlora worker answered on {address} in {timeout_s} s"
                ) from None
            time.sleep(0.2)


# ----------------------------------------------------------------------------- server side


class Worker:
    """Answers ping / query / train requests with `fedlora.federation.flower.node` (state kept across
    requests). `data_dir` replaces data.data_dir in every config it receives."""

    def __init__(self, data_dir: str | None = None) -> None:
        self.data_dir = data_dir or None
        self.requests = 0

    def handle(
        self, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        from fedlora.federation.flower import node

        op = header.get("op")
        self.requests += 1
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "requests": self.requests}, {}
        if op not in ("query", "train"):
            raise bad_value("op", op, "one of ping, query, train")
        cfg = node.config_from_toml(header["config_toml"], data_dir=self.data_dir)
        state = node.client_state(cfg)
        if op == "query":
            pid = int(header["partition_id"])
            return {"ok": True, "n_examples": node.n_examples(state, pid)}, {}
        t0 = time.perf_counter()
        adapter, loss = node.train_one(state, arrays, header["task"])
        return {"ok": True, "loss": loss, "compute_s": time.perf_counter() - t0}, adapter

    def serve_connection(self, conn: socket.socket) -> None:
        """One request, one reply; any failure is sent back as ``{"ok": false}``."""
        try:
            header, arrays = read_frame(conn)
        except (WorkerError, OSError, ValueError) as e:
            _log(f"bad request: {e}")
            return
        try:
            reply, out = self.handle(header, arrays)
        except Exception as e:  # noqa: BLE001 - reported to the ClientApp, which fails the reply
            reply, out = {"ok": False, "error": f"{type(e).__name__}: {e}"}, {}
            _log(f"request {header.get('op')!r} failed: {reply['error']}")
        try:
            conn.sendall(encode(reply, out))
        except OSError as e:
            _log(f"could not send the reply: {e}")


def _log(msg: str) -> None:
    print(f"fedlora worker [{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def check_serve_args(port: int, data_dir: str | None) -> None:
    """ConfigError for a port outside 0..65535 or a data dir that is not a directory."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise bad_value("--port", port, "an integer in 0..65535")
    if data_dir is not None and not os.path.isdir(data_dir):
        raise ConfigError(f"--data-dir = {data_dir!r} is invalid: not a directory")


def serve(
    port: int,
    *,
    data_dir: str | None = None,
    max_requests: int | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Listen on 127.0.0.1:`port` (0 = any free port) and serve requests one at a time until
    killed (or `max_requests` were served). `ready(port)` is called once listening."""
    check_serve_args(port, data_dir)
    worker = Worker(data_dir)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((LOOPBACK, port))
        srv.listen(8)
        bound = int(srv.getsockname()[1])
        _log(f"listening on {LOOPBACK}:{bound}")
        if ready is not None:
            ready(bound)
        served = 0
        while max_requests is None or served < max_requests:
            conn, _ = srv.accept()
            with conn:
                worker.serve_connection(conn)
            served += 1
