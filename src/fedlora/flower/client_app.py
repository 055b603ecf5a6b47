"""fedlora's ClientApp: one SuperNode = one fedlora client (its partition id).

Two message types:

- ``query``: the server sends the resolved experiment config; the node answers with its
  ``partition-id``, ``num-partitions`` (node_config) and ``n-examples`` = |D_n|.
- ``train``: the server sends the global adapter (ArrayRecord) and the task (client id,
  round, scale vector, rank used, weight); the node trains ONE LoRA slot for H local steps on
  ``client_batches(fed, client, H, b, derive_rng(seed, "data", r, client), pad_id)`` with
  `fedlora.train.local_train` and returns its adapter and mean train loss.

The model, the LoRA slot and the federated data are built once per process and cached at
module level (keyed by the config sections they depend on). Every node rebuilds the same
seeded partition and uses only its own part; node_config ``data-dir`` points a device at its
local copy of the data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlora.config import ExperimentConfig, config_from_dict, dump_toml
from fedlora.engine import derive_rng, derive_seed
from fedlora.errors import ConfigError
from fedlora.flower.common import adapter_to_record, apply_safe_env, record_to_adapter

apply_safe_env()

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402


@dataclass
class ClientState:
    """What a node keeps between messages: model, one-slot LoRA, data."""

    cfg: ExperimentConfig
    model: Any
    tokenizer: Any
    lora: Any
    fed: Any


_CACHE: dict[str, ClientState] = {}


def _cache_key(cfg: ExperimentConfig) -> str:
    d = cfg.to_dict()
    return repr((d["model"], d["lora"], d["data"], cfg.training.seed))


def config_from_message(message: Message, context: Context) -> ExperimentConfig:
    """The experiment config the server sent (``fedlora`` ConfigRecord, key ``config-toml``),
    with node_config ``data-dir`` (if set) replacing data.data_dir."""
    import tomllib

    text = message.content.config_records["fedlora"]["config-toml"]
    raw = tomllib.loads(str(text))
    data_dir = context.node_config.get("data-dir")
    if data_dir:
        raw.setdefault("data", {})["data_dir"] = str(data_dir)
    return config_from_dict(raw, source="config sent by the server")


def client_state(cfg: ExperimentConfig) -> ClientState:
    """Build (or reuse) this process's model, one-slot LoRA and federated data."""
    key = _cache_key(cfg)
    if key not in _CACHE:
        import torch

        from fedlora.data import build_federated_data
        from fedlora.lora import inject_lora
        from fedlora.models import load_model

        if cfg.model.threads:
            torch.set_num_threads(cfg.model.threads)
        model, tokenizer = load_model(
            cfg.model.name,
            dtype=cfg.model.dtype,
            cache_dir=cfg.model.cache_dir or None,
            progress=False,
        )
        lora = inject_lora(model, cfg.lora, slots=1, seed=derive_seed(cfg.training.seed, "init"))
        fed = build_federated_data(cfg.data, tokenizer, seed=cfg.training.seed)
        _CACHE.clear()  # one experiment per process: free the previous model
        _CACHE[key] = ClientState(cfg, model, tokenizer, lora, fed)
    return _CACHE[key]


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


def train_one(
    state: ClientState, global_adapter: dict[str, np.ndarray], task: dict[str, Any]
) -> tuple[dict[str, np.ndarray], float]:
    """Local training of one participant on slot 0; returns (adapter, mean loss over H)."""
    import torch

    from fedlora.data import client_batches
    from fedlora.train import local_train

    cfg, seed = state.cfg, state.cfg.training.seed
    client, r = int(task["client"]), int(task["round"])
    scale = np.asarray(task["scale"], dtype=np.float32)  # (γ,)
    state.lora.load_global({k: torch.from_numpy(v.copy()) for k, v in global_adapter.items()})
    state.lora.set_clients(torch.from_numpy(scale[None, :]))  # (1, γ)
    batches = client_batches(
        state.fed,
        client,
        cfg.training.local_steps,
        cfg.training.batch_size,
        derive_rng(seed, "data", r, client),
        state.tokenizer.pad_token_id,
    )
    torch.manual_seed(derive_seed(seed, "torch", r, int(task["index"])))
    losses = np.asarray(
        local_train(
            state.model,
            state.lora,
            [batches],
            cfg.training.lr,
            autocast_bf16=cfg.model.dtype == "bf16",
        )
    )  # (1, H)
    adapter = {k: v.numpy().copy() for k, v in state.lora.slot_state(0).items()}
    return adapter, float(losses.mean())


app = ClientApp()


@app.query()
def query(message: Message, context: Context) -> Message:
    """Answer the server's identity query: partition id, number of partitions, |D_n|."""
    cfg = config_from_message(message, context)
    pid, n = node_partition(context)
    state = client_state(cfg)
    n_examples = len(state.fed.client_indices[pid]) if pid < len(state.fed.client_indices) else 0
    reply = ConfigRecord({"partition-id": pid, "num-partitions": n, "n-examples": int(n_examples)})
    return Message(RecordDict({"identity": reply}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Train the task in the message on this node's partition; reply adapter + train loss."""
    t0 = time.perf_counter()
    cfg = config_from_message(message, context)
    pid, _ = node_partition(context)
    task = dict(message.content.config_records["task"])
    if int(task["client"]) != pid:
        raise ConfigError(
            f"task client = {task['client']} was sent to the node with partition-id = {pid}"
        )
    state = client_state(cfg)
    adapter, loss = train_one(state, record_to_adapter(message.content.array_records["adapter"]),
                              task)  # fmt: skip
    content = RecordDict(
        {
            "adapter": adapter_to_record(adapter),
            "metrics": MetricRecord(
                {"train-loss": loss, "compute-s": time.perf_counter() - t0, "client": pid}
            ),
        }
    )
    return Message(content, reply_to=message)


def config_record(cfg: ExperimentConfig) -> ConfigRecord:
    """The ``fedlora`` ConfigRecord the server puts in every message."""
    return ConfigRecord({"config-toml": dump_toml(cfg)})
