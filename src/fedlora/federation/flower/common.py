"""What the ServerApp and ClientApp share: run-config mapping, record conversion, env safety,
and a loopback deployment (SuperLink + SuperNodes started and stopped by PID).

Flower's run config (``[tool.flwr.app.config]`` in pyproject.toml, ``flwr run -c ...``) maps to
fedlora's config like this:

    fedlora-config      path to an experiment TOML ("" = fedlora's defaults)
    fedlora-overrides   "section.key=value ..." (shell quoting: 'method.q=[0.5, 0.5]')
    out-dir             the run directory the ServerApp writes ("" = <output.dir>/<output.name>)
    overwrite           replace an existing run directory
    round-timeout-s     how long the server waits for a round's replies; late nodes drop out
    connect-timeout-s   how long the server waits for data.n_clients nodes at start
    poll-interval-s     how often the server pulls replies
    availability        "none" | "observed": re-weight for dropouts (docs/flower.md)

Network safety: `SAFE_ENV` turns off Flower's telemetry and update check and Ray's usage
stats; `apply_safe_env` sets it in the current process, `safe_env` returns a copy of the
environment for child processes. Every address fedlora starts Flower on is 127.0.0.1.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config import ExperimentConfig, load_config
from fedlora.errors import ConfigError, bad_value

# the worker's socket layer owns the loopback rule; re-exported here for older callers
from fedlora.federation.flower.worker import LOOPBACK, check_loopback, wait_ready

SAFE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
}

# Message types (Flower routes "<category>[.<action>]" to the ClientApp's handlers).
QUERY = "query"
TRAIN = "train"

AVAILABILITY = ("none", "observed")


def apply_safe_env() -> None:
    """Telemetry, update checks and Ray usage stats off in this process (before Flower runs)."""
    os.environ.update(SAFE_ENV)


def safe_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A copy of `base` (default: os.environ) with `SAFE_ENV` and `extra` applied."""
    env = dict(os.environ if base is None else base)
    env.update(SAFE_ENV)
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- run config


@dataclass(frozen=True)
class FlowerOptions:
    """The Flower-only settings of a run (everything else is fedlora's ExperimentConfig)."""

    out_dir: str = ""
    overwrite: bool = False
    round_timeout_s: float = 600.0
    connect_timeout_s: float = 120.0
    poll_interval_s: float = 0.2
    availability: str = "none"

    def __post_init__(self) -> None:
        for name in ("round_timeout_s", "connect_timeout_s", "poll_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise bad_value(name.replace("_", "-"), value, "a number > 0 (seconds)")
        if self.availability not in AVAILABILITY:
            raise bad_value(
                "availability", self.availability, f"allowed: {', '.join(AVAILABILITY)}"
            )


_OPTION_KEYS = {
    "out-dir": "out_dir",
    "overwrite": "overwrite",
    "round-timeout-s": "round_timeout_s",
    "connect-timeout-s": "connect_timeout_s",
    "poll-interval-s": "poll_interval_s",
    "availability": "availability",
}
RUN_CONFIG_KEYS = ("fedlora-config", "fedlora-overrides", *_OPTION_KEYS)


def config_from_run_config(
    run_config: Mapping[str, Any],
) -> tuple[ExperimentConfig, FlowerOptions]:
    """fedlora's `ExperimentConfig` and the Flower options from a Flower run config."""
    unknown = sorted(set(run_config) - set(RUN_CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"Flower run config: unknown key(s) {', '.join(unknown)} "
            f"(valid: {', '.join(RUN_CONFIG_KEYS)})"
        )
    path = run_config.get("fedlora-config", "") or None
    overrides_text = run_config.get("fedlora-overrides", "")
    if not isinstance(overrides_text, str):
        raise bad_value("fedlora-overrides", overrides_text, "a string of section.key=value")
    try:
        overrides = shlex.split(overrides_text)
    except ValueError as e:
        raise bad_value("fedlora-overrides", overrides_text, f"shell-quoted words ({e})") from None
    cfg = load_config(path, overrides)
    opts = FlowerOptions(
        **{attr: run_config[key] for key, attr in _OPTION_KEYS.items() if key in run_config}
    )
    return cfg, opts


def check_flower_method(cfg: ExperimentConfig) -> None:
    """ConfigError for what the Flower runtime cannot run like the engine does: `fedstacklora`
    (its merged base update stays on the server, so the nodes would train on a stale base)
    and `proposed` without a plan file (the calibration runs of Algorithm 2 are engine runs)."""
    m = cfg.method
    if m.name == "fedstacklora":
        raise ConfigError(
            "method.name = 'fedstacklora' is not supported on Flower: its merged base update "
            "is not sent to the nodes; use `fedlora run`"
        )
    if m.name == "proposed" and not (
        isinstance(m.q, str) and m.q == m.k and m.q.endswith(".json") and Path(m.q).exists()
    ):
        raise ConfigError(
            f"method.name = 'proposed' with method.q = {m.q!r}, method.k = {m.k!r}: on Flower "
            "it needs a plan: set method.q and method.k to one plan JSON file (`fedlora plan "
            "-o`, or the plan.json of a `fedlora run` with method proposed)"
        )


# ----------------------------------------------------------------------------- records


def adapter_to_record(state: Mapping[str, Any]) -> Any:
    """An adapter (name -> numpy array or tensor) as a Flower ArrayRecord (fp32)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord(
        {k: Array(np.ascontiguousarray(np.asarray(v, dtype=np.float32))) for k, v in state.items()}
    )


def record_to_adapter(record: Any) -> dict[str, np.ndarray]:
    """An ArrayRecord back to name -> numpy array."""
    return {k: np.asarray(v.numpy()) for k, v in record.items()}


# ----------------------------------------------------------------------------- deployment


def descendants(pid: int) -> list[int]:
    """PIDs of every live process below `pid` (from /proc; Flower detaches some children
    into their own sessions, so a process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a process we started and what it started: SIGTERM, then SIGKILL, by PID."""
    if proc.poll() is not None:
        return
    below = descendants(proc.pid)
    _signal_pids([proc.pid], signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_pids([proc.pid], signal.SIGKILL)
        proc.wait(timeout=grace_s)
    _signal_pids([p for p in below if Path(f"/proc/{p}").exists()], signal.SIGKILL)


def _bin(name: str) -> str:
    """A console script of the running interpreter's environment."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


class LocalDeployment:
    """A SuperLink and one SuperNode per partition, all on 127.0.0.1, started with Popen;
    with `workers` (default), one persistent fedlora worker per SuperNode
    (`fedlora flower worker`, node_config ``worker-address``) that keeps the model and the
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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / log_name, "wb")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def start(self) -> LocalDeployment:
        """Start the workers (they import torch meanwhile), the SuperLink, the SuperNodes
        (partition-id = 0..n-1), then wait until every worker answers."""
        (self.home / "flwr-home").mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_workers(self) -> None:
        for i in range(self.n_nodes if self.use_workers else 0):
            address = f"{LOOPBACK}:{free_port()}"
            args = [sys.executable, "-m", "fedlora.cli", "flower", "worker"]
            args += ["--port", address.rpartition(":")[2]]
            data_dir = self.node_config[i].get("data-dir")
            if data_dir:
                args += ["--data-dir", str(data_dir)]
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
                _signal_pids([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
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
            _stop(proc)
        if self.superlink is not None:
            _stop(self.superlink)

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
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
