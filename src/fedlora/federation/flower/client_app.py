"""fedlora's ClientApp: one SuperNode = one fedlora client (its partition id).

Two message types:

- ``query``: the server sends the resolved experiment config; the node answers with its
  ``partition-id``, ``num-partitions`` (node_config) and ``n-examples`` = |D_n|.
- ``train``: the server sends the global adapter (ArrayRecord) and the task (client id,
  round, scale vector, rank used, weight); the node trains ONE LoRA slot for H local steps on
  ``client_batches(fed, client, H, b, derive_rng(seed, "data", r, client), pad_id)`` with
  `fedlora.llm.train.local_train` and returns its adapter and mean train loss. In a SecAgg+
  round (``privacy.secure_aggregation``) the handler wears Flower's `secaggplus_mod`
  (`fedlora.federation.flower.secagg_node`) and returns its weighted update, masked.

Where the work happens:

- node_config ``worker-address = "127.0.0.1:<port>"``: the request is forwarded to that
  node-local persistent worker (`fedlora flower worker`, `fedlora.federation.flower.worker`), which keeps
  the model, the LoRA slot and the tokenized partition loaded across rounds. Flower 1.41
  starts a fresh ClientApp process for every message, so this saves the torch import, the
  model load and the tokenization on every round.
- otherwise in this process (`fedlora.federation.flower.node`, cached at module level: in Ray
  simulation the process lives across rounds).

This module imports only light modules at top level (numpy, fedlora.config, flwr); torch and
transformers load only on the in-process path. Every node rebuilds the same seeded partition
and uses only its own part; node_config ``data-dir`` points a device at its local copy of the
data, and node_config ``device`` (``auto`` | ``cpu`` | ``cuda:N`` | ``mps``; default ``auto``)
picks the accelerator the node trains on, so one machine with several GPUs can host one
SuperNode per GPU.

Measured per round (the ``train`` reply's metrics, written by the ServerApp to
``node_times.csv``; `fedlora profiles fit` turns them into a profile file): ``train-s``, the
node's local training time of the H steps (the worker's own timing when a worker trains,
so the transfer to it is not counted), and ``upload-params`` / ``upload-bytes``, the size of
the adapter it sends back. node_config ``step-delay-s`` adds a sleep per local step (inside
the measured time) to make a node slower for tests.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.toml_io import dump_toml
from fedlora.errors import ConfigError
from fedlora.federation.flower import node
from fedlora.federation.flower.common import adapter_to_record, apply_safe_env, record_to_adapter
from fedlora.federation.flower.secagg_node import is_secure, secagg_mod, secure_content

apply_safe_env()

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402


def config_from_message(message: Message, context: Context) -> ExperimentConfig:
    """The experiment config the server sent (``fedlora`` ConfigRecord, key ``config-toml``),
    with node_config ``data-dir`` (if set) replacing data.data_dir and node_config ``device``
    (default ``auto``: this node's GPU if it has one) replacing model.device."""
    text = message.content.config_records["fedlora"]["config-toml"]
    nc = context.node_config
    return node.config_from_toml(
        str(text),
        data_dir=nc.get("data-dir") or None,
        device=str(nc.get("device") or "auto"),
        source="config sent by the server (model.device from node_config device)",
    )


def node_partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config; ConfigError if absent or bad."""
    nc = context.node_config
    try:
        pid, n = int(nc["partition-id"]), int(nc["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"node_config = {dict(nc)!r} is invalid: needs integer partition-id and "
            "num-partitions (flower-supernode --node-config 'partition-id=0 num-partitions=2')"
        ) from None
    if not 0 <= pid < n:
        raise ConfigError(f"node_config partition-id = {pid} is invalid: must be in 0..{n - 1}")
    return pid, n


def worker_address(context: Context) -> str | None:
    """node_config ``worker-address`` (checked to be 127.0.0.1:<port>), or None."""
    from fedlora.federation.flower.worker import check_loopback

    address = context.node_config.get("worker-address")
    if not address:
        return None
    check_loopback(str(address), "node_config worker-address")
    return str(address)


def step_delay_s(context: Context) -> float:
    """node_config ``step-delay-s``: seconds of sleep added per local step (a slower device,
    for testing measured profiles; default 0)."""
    raw = context.node_config.get("step-delay-s", 0.0)
    try:
        delay = float(raw)
    except (TypeError, ValueError):
        delay = -1.0
    if not (delay >= 0 and np.isfinite(delay)):
        raise ConfigError(
            f"node_config step-delay-s = {raw!r} is invalid: must be a number of seconds >= 0"
        )
    return delay


app = ClientApp()


@app.query()
def query(message: Message, context: Context) -> Message:
    """Answer the server's identity query: partition id, number of partitions, |D_n|."""
    cfg = config_from_message(message, context)
    pid, n = node_partition(context)
    address = worker_address(context)
    if address:
        from fedlora.federation.flower import worker

        reply, _ = worker.call(
            address, {"op": "query", "config_toml": dump_toml(cfg), "partition_id": pid}
        )
        n_examples = int(reply["n_examples"])
    else:
        n_examples = node.n_examples(node.client_state(cfg), pid)
    reply_rec = ConfigRecord(
        {"partition-id": pid, "num-partitions": n, "n-examples": int(n_examples)}
    )
    return Message(RecordDict({"identity": reply_rec}), reply_to=message)


@app.train(mods=[secagg_mod])
def train(message: Message, context: Context) -> Message:
    """Train the task in the message on this node's partition; reply adapter + train loss
    (in a SecAgg+ round: its weighted update, which `secagg_mod` masks)."""
    t0 = time.perf_counter()
    cfg = config_from_message(message, context)
    pid, _ = node_partition(context)
    task: dict[str, Any] = dict(message.content.config_records["task"])
    if int(task["client"]) != pid:
        raise ConfigError(
            f"task client = {task['client']} was sent to the node with partition-id = {pid}"
        )
    global_adapter = record_to_adapter(message.content.array_records["adapter"])
    if "base" in message.content.array_records:  # the server's sum of base merges (FedEx-LoRA)
        base = record_to_adapter(message.content.array_records["base"])
        global_adapter.update({f"{node.BASE_PREFIX}{k}": v for k, v in base.items()})
    delay_s = step_delay_s(context)
    address = worker_address(context)
    if address:
        from fedlora.federation.flower import worker

        header = {
            "op": "train",
            "config_toml": dump_toml(cfg),
            "task": {k: (list(v) if isinstance(v, list) else v) for k, v in task.items()},
        }
        reply, adapter = worker.call(address, header, global_adapter)
        loss, train_s = float(reply["loss"]), float(reply["compute_s"])  # the worker's own
    else:
        t_train = time.perf_counter()
        adapter, loss = node.train_one(node.client_state(cfg), global_adapter, task)
        train_s = time.perf_counter() - t_train
    if delay_s:  # a slower device, for testing the measured profiles
        time.sleep(delay_s * cfg.training.local_steps)
        train_s += delay_s * cfg.training.local_steps
    arrays = {k: np.asarray(v) for k, v in adapter.items()}
    metrics = MetricRecord(
        {
            "train-loss": loss,
            "compute-s": time.perf_counter() - t0,
            "client": pid,
            # measured on this node (fedlora profiles fit): local training of the H
            # steps alone, and the size of the adapter it sends back
            "train-s": train_s,
            "upload-params": int(sum(a.size for a in arrays.values())),
            "upload-bytes": int(sum(a.nbytes for a in arrays.values())),
        }
    )
    if is_secure(message):  # the weighted update, masked by `secagg_mod` on its way out
        content = secure_content(task, global_adapter, arrays, metrics)
    else:
        content = RecordDict({"adapter": adapter_to_record(arrays), "metrics": metrics})
    return Message(content, reply_to=message)


def config_record(cfg: ExperimentConfig) -> ConfigRecord:
    """The ``fedlora`` ConfigRecord the server puts in every message."""
    return ConfigRecord({"config-toml": dump_toml(cfg)})
