"""What the ServerApp and ClientApp share: run-config mapping, the message exchange, record
conversion, env safety.
The loopback deployment (SuperLink, SuperNodes and workers started and stopped by PID) is in
`fedlora.federation.flower.deploy`.

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
environment for child processes. Every address fedlora starts Flower on is 127.0.0.1
(`fedlora.federation.flower.worker.check_loopback`).
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.toml_io import load_config
from fedlora.errors import ConfigError, bad_value

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
    # the run's `fedlora.llm.device.Resolution` when a caller in this process entered the run
    # and holds its lock (`fedlora flower simulate`); never part of a Flower run config
    entered: Any = None

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
    """ConfigError for what the Flower runtime cannot run like the engine does: a method with
    a `flower_refusal` (the references `centralized` and `local`; `fedstacklora`, whose merged
    base update stays on the server, so the nodes would train on a stale base; `fedsalora`,
    whose evaluation view needs every client's B), a method whose `check_flower` refuses the
    config (`proposed` without a plan file: the calibration runs of Algorithm 2 are engine
    runs), and a client AdamW state kept across rounds (``training.optimizer_state =
    "keep"``). FedEx-LoRA's base merges travel to the nodes with every train message (the
    ``base`` ArrayRecord)."""
    from fedlora.federation.methods.registry import check_method_config

    cls = check_method_config(cfg)
    if cls.flower_refusal:  # a method that says why it does not run on Flower
        raise ConfigError(
            f"method.name = {cfg.method.name!r} is not supported on Flower: {cls.flower_refusal}"
        )
    check_secure_clients(cfg)
    if cfg.training.optimizer_state == "keep":
        raise ConfigError(
            "training.optimizer_state = 'keep' is not supported on Flower: a node trains "
            "whichever client the server sends it and the server's checkpoints do not hold "
            "the nodes' AdamW states, so a resumed run would not continue them; use 'reset' "
            "(a new AdamW per client per round) or `fedlora run`"
        )
    cls.check_flower(cfg)


def check_secure_clients(cfg: ExperimentConfig) -> None:
    """ConfigError when ``privacy.secure_aggregation`` cannot work with data.n_clients: more
    clients than SecAgg+'s modulus sums without wrapping around, or a threshold no round
    can reach (every round would be skipped)."""
    from fedlora.config.privacy_section import SECAGG_MAX_CLIENTS

    p, n = cfg.privacy, cfg.data.n_clients
    if not p.secure_aggregation:
        return
    if n > SECAGG_MAX_CLIENTS:
        raise ConfigError(
            f"data.n_clients = {n} is invalid with privacy.secure_aggregation = true: SecAgg+ "
            f"sums at most {SECAGG_MAX_CLIENTS} updates without wrapping around"
        )
    if p.secagg_threshold > n:
        raise ConfigError(
            f"privacy.secagg_threshold = {p.secagg_threshold} is invalid with data.n_clients = "
            f"{n}: no round can have that many participants; allowed: 2..{n}"
        )


def check_flower_resume(run_dir: Path) -> None:
    """ConfigError for a Flower resume of a run that `fedlora run` finished: its summary.json
    (no ``"runtime": "flower"``) would be rewritten by another runtime's."""
    import json

    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no (readable) summary: an unfinished run, or the entry's check names it
    if isinstance(summary, dict) and summary.get("runtime") != "flower":
        raise ConfigError(
            f"--resume {str(run_dir)!r} is a run `fedlora run` finished (its summary.json has "
            "no runtime = flower); allowed: a Flower run, or continue it with "
            f"`fedlora run --resume {run_dir}` (and --force training.rounds=N to add rounds)"
        )


# ----------------------------------------------------------------------------- messaging


def exchange(grid: Any, messages: Sequence[Any], timeout_s: float, poll_s: float) -> dict[int, Any]:
    """Push `messages` (Flower Messages) through `grid` (a ServerApp's Grid), pull replies until all arrived or `timeout_s` passed.

    Returns {index in `messages`: reply}, matched by ``reply_to_message_id``. (Flower's own
    `send_and_receive` polls every 3 s; this polls every `poll_s`.)
    """
    ids = list(grid.push_messages(list(messages)))
    index = {mid: i for i, mid in enumerate(ids) if mid}
    pending = set(index)
    replies: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for reply in grid.pull_messages(list(pending)):
            mid = reply.metadata.reply_to_message_id
            if mid in pending:
                pending.discard(mid)
                replies[index[mid]] = reply
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return replies


# ----------------------------------------------------------------------------- records


def adapter_to_record(state: Mapping[str, Any]) -> Any:
    """An adapter (name -> numpy array or tensor) as a Flower ArrayRecord (fp32)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord(
        {k: Array(np.ascontiguousarray(np.asarray(v, dtype=np.float32))) for k, v in state.items()}
    )


def train_content(
    fedlora_record: Any,
    plan: Any,
    index: int,
    global_state: Mapping[str, Any],
    base_delta: Mapping[str, Any] | None = None,
) -> Any:
    """The content of the ``train`` message of task `index` of `plan` (a RoundPlan): the
    ``fedlora`` config record, the ``task`` (client, round, index, scale, rank used, weight,
    the factors it trains), the global ``adapter`` and, if any, the ``base`` merges."""
    from flwr.app import ConfigRecord, RecordDict

    t = plan.tasks[index]
    task = ConfigRecord(
        {
            "client": t.client,
            "round": plan.round,
            "index": index,
            "scale": [float(s) for s in t.scale],
            "rank-used": t.rank_used,
            "weight": t.weight,
            "trains": t.trains,  # the factors it trains (FFA-LoRA, RoLoRA, Fed-SB)
        }
    )
    base = {"base": adapter_to_record(base_delta)} if base_delta else {}
    return RecordDict(
        {
            "fedlora": fedlora_record,
            "task": task,
            "adapter": adapter_to_record(global_state),
            **base,
        }
    )


def record_to_adapter(record: Any) -> dict[str, np.ndarray]:
    """An ArrayRecord back to name -> numpy array."""
    return {k: np.asarray(v.numpy()) for k, v in record.items()}
