"""A loopback Flower deployment: a SuperLink, one SuperNode per partition and one fedlora
worker per SuperNode, started with Popen and stopped by PID.

Every address is 127.0.0.1 (free ports, `check_loopback`), and every child process gets
`common.safe_env` (telemetry, update checks and Ray usage stats off). Stopping never goes by
process name: SIGTERM to each PID started here, SIGKILL after a grace period, then SIGKILL to
whatever they started (`fedlora.federation.flower.processes`).

The processes' logs go to ``log_dir`` (`flower run-local`: ``<out>-logs`` beside the run
directory). fedlora writes there only into a folder it made (its marker `LOG_MARKER`) or a
new or empty one, and only its own log names; `check_log_dir` refuses any other folder
before anything starts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError, bad_value
from fedlora.federation.flower.common import safe_env
from fedlora.federation.flower.processes import descendants, signal_pids, stop_process
from fedlora.federation.flower.worker import LOOPBACK, check_loopback, wait_ready
from fedlora.files import open_for_write

WORKER_MODULE = "fedlora.federation.flower.worker_main"  # python -m WORKER_MODULE --port P
LOG_MARKER = ".fedlora-logs"  # a log folder fedlora made: its own log names are rewritten


def check_log_dir(path: Path) -> None:
    """Refuse a log folder fedlora may not write into: one that exists (or is a link or a
    file) without `LOG_MARKER` and holds anything. Nothing is written here."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError(
            f"log folder {str(path)!r} (beside --out) is a link or a file: fedlora writes the "
            "deployment's logs there; move it away or choose another --out"
        )
    if not path.is_dir():
        return
    names = sorted(p.name for p in path.iterdir())
    if names and LOG_MARKER not in names:
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise ConfigError(
            f"log folder {str(path)!r} (beside --out) = [{shown}] was not made by fedlora (no "
            f"{LOG_MARKER}): fedlora would rewrite its log files there; allowed: a new or "
            "empty folder, or one fedlora made; move it away or choose another --out"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def worker_argv(port: int, data_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The command line of one node worker: its own module, not the `fedlora` CLI."""
    args = [sys.executable, "-m", WORKER_MODULE, "--port", str(port)]
    return args + (["--data-dir", str(data_dir)] if data_dir else [])


def _bin(name: str) -> str:
    """A console script of the running interpreter's environment."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


class LocalDeployment:
    """A SuperLink and one SuperNode per partition, all on 127.0.0.1, started with Popen;
    with `workers` (default), one persistent fedlora worker per SuperNode
    (`WORKER_MODULE`, node_config ``worker-address``) that keeps the model and the
    tokenized partition loaded across rounds.

    Everything is stopped by PID only: `stop()` (or leaving the `with` block) sends SIGTERM to
    each process it started, SIGKILL after a grace period, then SIGKILL to any of their
    descendants still alive (Flower's SuperExec/ClientApp processes).

        with LocalDeployment(n_nodes=2, home=tmp) as dep:
            dep.submit(app_dir, {"fedlora-config": "exp.toml", "out-dir": "runs/x"})
            dep.wait_for(Path("runs/x/summary.json"), timeout_s=600)
    """

    def __init__(
        self,
        n_nodes: int,
        home: str | os.PathLike[str],
        *,
        node_config: Sequence[Mapping[str, Any]] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        workers: bool = True,
        worker_timeout_s: float = 300.0,
    ) -> None:
        if isinstance(n_nodes, bool) or not isinstance(n_nodes, int) or n_nodes < 1:
            raise bad_value("n_nodes", n_nodes, "an integer >= 1")
        self.n_nodes = n_nodes
        self.home = Path(home)
        self.log_dir = Path(log_dir) if log_dir else self.home / "logs"
        self.node_config = list(node_config or [{} for _ in range(n_nodes)])
        if len(self.node_config) != n_nodes:
            raise bad_value("node_config", node_config, f"one mapping per node ({n_nodes})")
        self.use_workers = bool(workers)
        self.worker_timeout_s = float(worker_timeout_s)
        self.superlink: subprocess.Popen | None = None
        self.supernodes: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.watchdog: subprocess.Popen | None = None
        self.worker_addresses: list[str] = []
        self.port = 0
        # Flower starts its own helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by
        # name: put this interpreter's scripts first on PATH.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        # SuperExec polls for ClientApp/ServerApp tasks every 1 s by default; 0.2 s cuts the
        # per-message latency (the SuperNode's own 3 s idle poll of the SuperLink is fixed).
        self.env = safe_env(
            FLWR_HOME=str(self.home / "flwr-home"),
            PATH=path,
            FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.2",
        )

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _popen(self, args: list[str], log_name: str) -> subprocess.Popen:
        check_log_dir(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        open_for_write(self.log_dir / LOG_MARKER, append=True).close()  # never through a link
        log = open_for_write(self.log_dir / log_name)  # closed with the process
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        with open(self.home / "pids", "a", encoding="utf-8") as f:  # for the watchdog
            f.write(f"{proc.pid}\n")
        return proc

    def _start_watchdog(self) -> None:
        """A process that outlives this one by a moment: when this process dies (SIGKILL
        included) it stops every process group this deployment started, and what they
        started, so nothing keeps running or holds the run's lock."""
        (self.home / "pids").touch()
        code = "from fedlora.federation.flower.processes import watchdog; watchdog()"
        self.watchdog = subprocess.Popen(
            [sys.executable, "-c", code, str(os.getpid()), str(self.home / "pids")],
            env=self.env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )

    def start(self) -> LocalDeployment:
        """Start the workers (they import torch meanwhile), the SuperLink, the SuperNodes
        (partition-id = 0..n-1), then wait until every worker answers."""
        (self.home / "flwr-home").mkdir(parents=True, exist_ok=True)
        self._start_watchdog()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_workers(self) -> None:
        for i in range(self.n_nodes if self.use_workers else 0):
            address = f"{LOOPBACK}:{free_port()}"
            port = int(address.rpartition(":")[2])
            args = worker_argv(port, self.node_config[i].get("data-dir"))
            self.workers.append(self._popen(args, f"worker-{i}.log"))
            self.worker_addresses.append(address)

    def _wait_workers(self) -> None:
        for proc, address in zip(self.workers, self.worker_addresses, strict=True):
            wait_ready(address, self.worker_timeout_s, alive=lambda p=proc: p.poll() is None)

    def _start(self) -> None:
        self._start_workers()
        self.port = free_port()
        check_loopback(self.address, "superlink address")
        self.superlink = self._popen(
            [
                _bin("flower-superlink"),
                "--insecure",
                "--host",
                LOOPBACK,
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
            "superlink.log",
        )
        self._wait_listening(self.port, timeout_s=60)
        for i in range(self.n_nodes):
            cfg = {"partition-id": i, "num-partitions": self.n_nodes, **self.node_config[i]}
            if self.use_workers:
                cfg["worker-address"] = self.worker_addresses[i]
            node_cfg = " ".join(f"{k}={_toml_scalar(v)}" for k, v in cfg.items())
            self.supernodes.append(
                self._popen(
                    [
                        _bin("flower-supernode"),
                        "--insecure",
                        "--superlink",
                        self.address,
                        "--host",
                        LOOPBACK,
                        "--port",
                        str(free_port()),
                        "--node-config",
                        node_cfg,
                    ],
                    f"supernode-{i}.log",
                )
            )
        self._wait_workers()

    def _wait_listening(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.superlink is not None and self.superlink.poll() is not None:
                raise RuntimeError(
                    f"flower-superlink exited with {self.superlink.returncode}; "
                    f"see {self.log_dir / 'superlink.log'}"
                )
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if s.connect_ex((LOOPBACK, port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"flower-superlink did not listen on {LOOPBACK}:{port} in {timeout_s} s")

    def write_flwr_config(self, name: str = "fedlora-local") -> str:
        """The Flower CLI's connection entry for this SuperLink (in this deployment's home)."""
        path = self.home / "flwr-home" / "config.toml"
        path.write_text(
            f'[superlink]\ndefault = "{name}"\n\n'
            f'[superlink.{name}]\naddress = "{self.address}"\ninsecure = true\n',
            encoding="utf-8",
        )
        return name

    def submit(
        self, app_dir: str | os.PathLike[str], run_config: Mapping[str, Any], timeout_s: float = 120
    ) -> str:
        """`flwr run <app_dir> <connection> --run-config ...`; returns the CLI's output."""
        name = self.write_flwr_config()
        overrides = " ".join(f"{k}={_toml_scalar(v)}" for k, v in run_config.items())
        args = [_bin("flwr"), "run", str(app_dir), name]
        if overrides:
            args += ["--run-config", overrides]
        done = subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"flwr run failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return done.stdout

    def kill_node(self, index: int) -> None:
        """Kill SuperNode `index`, what it started, and its worker, without a grace period
        (a device that died)."""
        procs = [self.supernodes[index]]
        if self.workers:
            procs.append(self.workers[index])
        for proc in procs:
            if proc.poll() is None:
                signal_pids([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
                proc.wait(timeout=10)

    def pids(self) -> list[int]:
        """PIDs of every process this deployment started directly."""
        procs = [*self.workers, *self.supernodes]
        if self.superlink is not None:
            procs.append(self.superlink)
        return [p.pid for p in procs]

    def stop(self) -> None:
        """Stop the SuperNodes, the workers, then the SuperLink (by PID, SIGTERM then
        SIGKILL)."""
        for proc in [*self.supernodes, *self.workers]:
            stop_process(proc)
        if self.superlink is not None:
            stop_process(self.superlink)
        if self.watchdog is not None:
            stop_process(self.watchdog)

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # a TOML basic string without a raw quote inside: Flower's --run-config parser cuts a
    # quoted value at the next '"', escaped or not (an override like lora.layers="all")
    text = "".join(
        f"\\u{ord(c):04x}" if c == '"' or ord(c) < 0x20 or ord(c) == 0x7F else c
        for c in str(value).replace("\\", "\\\\")
    )
    return f'"{text}"'


def wait_for_file(
    path: Path,
    timeout_s: float,
    *,
    alive: Sequence[subprocess.Popen] = (),
    error: Path | None = None,
) -> None:
    """Wait until `path` exists; fail early if one of `alive` exits or `error` appears."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if error is not None and error.exists():
            raise RuntimeError(f"the run failed: {error.read_text().strip()}")
        for proc in alive:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.5)
