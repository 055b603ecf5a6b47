"""Which SuperNode holds which fedlora client: the ServerApp's identity query at the start
of a run (`discover_nodes`), and the ``fedlora`` config record every message carries."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError, DataError
from fedlora.federation.flower.common import QUERY, FlowerOptions, apply_safe_env, exchange

apply_safe_env()

from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fedlora_record(cfg: ExperimentConfig) -> ConfigRecord:
    from fedlora.config.toml_io import dump_toml

    return ConfigRecord({"config-toml": dump_toml(cfg)})


def discover_nodes(
    grid: Grid, cfg: ExperimentConfig, fed: Any, opts: FlowerOptions, log: Log = _stderr
) -> dict[int, int]:
    """Ask every node its partition id and |D_n|; returns {client (partition id): node id}.

    Waits up to ``connect_timeout_s`` for data.n_clients nodes. A node whose partition count,
    id or |D_n| disagrees with the server's partition is a ConfigError / DataError; a missing
    partition is allowed (that client drops out whenever it is sampled) and logged.
    """
    n = cfg.data.n_clients
    deadline = time.monotonic() + opts.connect_timeout_s
    while True:
        node_ids = sorted(grid.get_node_ids())
        if len(node_ids) >= n or time.monotonic() >= deadline:
            break
        time.sleep(opts.poll_interval_s)
    if not node_ids:
        raise ConfigError(
            f"no SuperNode connected within connect-timeout-s = {opts.connect_timeout_s}"
        )
    messages = [
        Message(RecordDict({"fedlora": fedlora_record(cfg)}), node_id, QUERY, group_id="identity")
        for node_id in node_ids
    ]
    replies = exchange(grid, messages, opts.connect_timeout_s, opts.poll_interval_s)
    clients: dict[int, int] = {}
    for i, node_id in enumerate(node_ids):
        reply = replies.get(i)
        if reply is None or reply.has_error():
            why = "no reply" if reply is None else reply.error.reason
            log(f"node {node_id}: identity query failed ({why}); it takes no part")
            continue
        ident = reply.content.config_records["identity"]
        pid, n_parts, n_ex = (
            int(ident[k]) for k in ("partition-id", "num-partitions", "n-examples")
        )
        if n_parts != n:
            raise ConfigError(
                f"node {node_id}: num-partitions = {n_parts} is invalid: must equal "
                f"data.n_clients = {n}"
            )
        if pid in clients:
            raise ConfigError(
                f"partition-id = {pid} is claimed by nodes {clients[pid]} and {node_id}: "
                "each SuperNode needs its own partition-id"
            )
        expected = len(fed.client_indices[pid])
        if n_ex != expected:
            raise DataError(
                f"node {node_id} (partition {pid}) holds {n_ex} examples, the server's "
                f"partition says {expected}: both sides must use the same data and config"
            )
        clients[pid] = node_id
    missing = sorted(set(range(n)) - set(clients))
    if missing:
        log(f"no node for client(s) {missing}: they drop out whenever sampled")
    return clients
