"""What one Flower node does with a message, without Flower: build (once) the model, a
one-slot LoRA and the federated data, answer the identity query, train one task.

Used in-process by the ClientApp (no worker configured, or the Ray simulation, whose actors
live across rounds) and by the persistent node worker (`fedlora.federation.flower.worker`).
Top-level imports are light (numpy, fedlora.config): torch, transformers and the data code
load on the first `client_state` call (through `fedlora.federation.runstate` and
`fedlora.federation.trainer`, the code the engine builds and trains with).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import tomllib

from fedlora.config.experiment import ExperimentConfig, config_from_dict
from fedlora.federation.trainable import Trainable

_CACHE: dict[str, Trainable] = {}  # what a node keeps between messages (one experiment)
BASE_PREFIX = "base/"  # arrays named so are the server's sum of merges into the frozen base


def _cache_key(cfg: ExperimentConfig) -> str:
    # the method decides the adapter's factors (Fed-SB adds R), so it is part of the key
    d = cfg.to_dict()
    return repr((d["model"], d["lora"], d["data"], d["method"], cfg.training.seed))


def config_from_toml(
    text: str,
    *,
    data_dir: str | None = None,
    source: str = "config sent by the server",
    device: str | None = None,
) -> ExperimentConfig:
    """The experiment config in `text` (the server's resolved TOML), with `data_dir` (if set)
    replacing data.data_dir: a node's local copy of the data; and `device` (if set)
    replacing model.device: each node trains on its own device (node_config ``device``)."""
    raw = tomllib.loads(str(text))
    if data_dir:
        raw.setdefault("data", {})["data_dir"] = str(data_dir)
    if device:
        raw.setdefault("model", {})["device"] = str(device)
    return config_from_dict(raw, source=source)


def client_state(cfg: ExperimentConfig) -> Trainable:
    """Build (or reuse) this process's model, one-slot LoRA and federated data (as the
    engine's `build_run` does, with one slot): the same `Trainable` as the engine's `Run`."""
    key = _cache_key(cfg)
    if key not in _CACHE:
        from fedlora.federation.runstate import load_trainable
        from fedlora.llm.device import resolve_runtime

        _CACHE.clear()  # one experiment per process: free the previous model first
        # this node's device and dtype (auto made concrete)
        _CACHE[key] = load_trainable(resolve_runtime(cfg), slots=1, progress=False)
    return _CACHE[key]


def n_examples(state: Trainable, partition_id: int) -> int:
    """|D_n| of partition `partition_id` (0 for a partition the data has no room for)."""
    indices = state.fed.client_indices
    return len(indices[partition_id]) if partition_id < len(indices) else 0


def train_one(
    state: Trainable, global_adapter: Mapping[str, np.ndarray], task: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], float]:
    """Local training of one participant on slot 0; returns (adapter, mean loss over H).
    Arrays named ``base/<layer>`` set the frozen base to its initial value plus them
    (`SlotLora.add_to_base` with total=True; none: the initial base).

    The engine's `fedlora.federation.trainer.train_clients` for one client, so the same draws
    as the engine with ``training.slots = 1`` (torch seeded by the task's position in the
    round's plan).
    """
    import torch

    from fedlora.federation.trainer import train_clients

    base = {
        k[len(BASE_PREFIX) :]: v for k, v in global_adapter.items() if k.startswith(BASE_PREFIX)
    }
    adapter = {k: v for k, v in global_adapter.items() if not k.startswith(BASE_PREFIX)}
    state.lora.add_to_base({k: torch.from_numpy(np.array(v)) for k, v in base.items()}, total=True)
    state.lora.load_global({k: torch.from_numpy(np.array(v)) for k, v in adapter.items()})
    scale = np.asarray(task["scale"], dtype=np.float32)  # (γ,)
    losses = np.asarray(
        train_clients(
            state,
            int(task["round"]),
            [int(task["client"])],
            scale[None, :],
            int(task["index"]),
            trains=str(task.get("trains", "AB")),
        )
    )  # (1, H)
    adapter = {k: v.numpy().copy() for k, v in state.lora.slot_state(0).items()}
    return adapter, float(losses.mean())


def warm_imports() -> None:
    """Import the heavy modules now (a worker does this before it listens)."""
    import torch  # noqa: F401

    import fedlora.llm.data  # noqa: F401
    import fedlora.llm.lora  # noqa: F401
    import fedlora.llm.models  # noqa: F401
    import fedlora.llm.train  # noqa: F401
