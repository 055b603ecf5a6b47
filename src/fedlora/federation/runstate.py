"""What a run holds in memory between rounds (`Run`): the model and its LoRA slots, the
partitioned data, the client profiles and the method; built once from the config
(`build_run`), saved to and restored from checkpoints (`checkpoint_state`, `restore_state`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.federation.clientmemory import ClientMemory
from fedlora.federation.methods import make_method
from fedlora.federation.methods.base import Method
from fedlora.federation.methods.proposed import Plan
from fedlora.federation.profiles import build_profiles
from fedlora.federation.progress import Progress
from fedlora.federation.trainable import Trainable
from fedlora.llm.device import Resolution
from fedlora.system.client_profiles import ClientProfiles
from fedlora.system.seeding import derive_rng, derive_seed


@dataclass
class Run(Trainable):
    """Everything a run holds in memory between rounds: what it trains (`Trainable`: cfg,
    model, tokenizer, lora, fed) and the rest."""

    run_dir: Path
    profiles: ClientProfiles
    method: Method
    shapes: dict[str, tuple[int, int]]
    base_delta: dict[str, np.ndarray] = field(default_factory=dict)
    device: str = "cpu"  # where the model, the slots, batches and the layer cache live
    slots_per_pass: int = 0  # clients per forward/backward; 0 = training.slots
    memory: ClientMemory = field(default_factory=lambda: ClientMemory(lambda k: False, {}))
    # training.optimizer_state = "keep": client -> its AdamW state (`SlotAdamW.slot_state`)
    optim_states: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    # the frozen-layer `DiskStore` of model.cache_dir / model.disk_cache_mb (None = off),
    # handed to the training and evaluation caches (`layer_cache_for`, `eval_cache_for`)
    disk: Any = None


def load_trainable(
    runtime: Resolution, *, slots: int, progress: bool = True, log=None
) -> Trainable:
    """What the engine and a Flower node build alike, from a config whose device and dtype
    were resolved (`fedlora.llm.device.resolve_runtime`, once, by the caller): the config
    (evaluation.format made concrete), the model and tokenizer, LoRA with `slots` client
    slots (initialised from the run's seed) and the federated data."""
    from fedlora.llm.data import build_federated_data
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.models import load_model

    cfg = runtime.cfg
    if log is not None:
        log(f"model: {cfg.model.name} on {runtime.describe()}")
    model, tokenizer = load_model(
        cfg.model.name,
        dtype=cfg.model.dtype,
        cache_dir=cfg.model.cache_dir or None,
        progress=progress,
        device=cfg.model.device,
    )
    # evaluation.format = auto: harness below 3B parameters (fedlora.llm.harness)
    from fedlora.llm.harness import resolve_eval_format

    n_params = sum(p.numel() for p in model.parameters())
    tasks = [
        *cfg.data.tasks,
        *cfg.data.eval_tasks,
        *(Path(f).parent.name for f in cfg.data.task_files),
    ]
    fmt = resolve_eval_format(cfg.evaluation.format, n_params, tasks)
    cfg = cfg.replace(evaluation=replace(cfg.evaluation, format=fmt))
    lora = inject_lora(model, cfg.lora, slots=slots, seed=derive_seed(cfg.training.seed, "init"))
    fed = build_federated_data(cfg.data, tokenizer, seed=cfg.training.seed, fmt=fmt)
    if log is not None:
        log(f"evaluation.format: {fmt} ({n_params / 1e6:.0f}M parameters)")
        if fed.lengths is not None:
            log(fed.lengths.describe())
        elif fed.train.cut:
            log(
                f"training examples (llm-adapters format): {fed.train.cut} of {len(fed.train)} "
                f"prompts cut from the left to data.max_seq_len = {cfg.data.max_seq_len} tokens"
            )
    return Trainable(cfg, model, tokenizer, lora, fed)


def build_run(runtime: Resolution, run_dir: Path, log=print, plan: Plan | None = None) -> Run:
    """Model, LoRA slots, federated data, client profiles and the method of one run, on the
    device and in the dtype `runtime` resolved."""
    slots = runtime.cfg.training.slots
    t = load_trainable(runtime, slots=slots, log=log)
    cfg, model, tokenizer, lora, fed = t.cfg, t.model, t.tokenizer, t.lora, t.fed
    shapes = lora.layer_shapes()
    full_bits = cfg.lora.rank * sum(o + i for o, i in shapes.values()) * cfg.network.bits_per_param
    profiles = build_profiles(cfg, full_bits)
    method = make_method(
        cfg,
        fed.a,
        derive_rng(cfg.training.seed, "strategy"),
        tau_full_s=profiles.tau_full_s,
        plan=plan,
    )
    start = to_numpy(lora.global_state())
    initial = method.initial_state(start)  # e.g. Fed-SB's frozen factors and R
    if initial is not start:
        lora.load_global(to_torch(initial))
    run = Run(cfg, model, tokenizer, lora, fed, run_dir, profiles, method, shapes)
    run.memory = ClientMemory(method.is_local, initial)
    from fedlora.llm.disk_cache import disk_store_for

    run.disk = disk_store_for(cfg.model)
    run.device = cfg.model.device
    run.slots_per_pass = device_slots_per_pass(run, log)
    return run


def device_slots_per_pass(run: Run, log=print) -> int:
    """training.slots, capped on a CUDA GPU by what half its free memory holds (an
    over-estimate of one slot's activations, `fedlora.llm.device.activation_bytes_per_slot`)."""
    requested = run.cfg.training.slots
    if not run.device.startswith("cuda"):
        return requested
    import torch

    from fedlora.llm.device import activation_bytes_per_slot, slots_for_memory
    from fedlora.llm.lora_targets import layer_index

    free_bytes, _ = torch.cuda.mem_get_info(run.device)
    n_layers = int(run.model.config.num_hidden_layers)
    lowest = min((i for n in run.lora.names if (i := layer_index(n)) is not None), default=0)
    per_slot = activation_bytes_per_slot(
        run.model.config,
        batch_size=run.cfg.training.batch_size,
        seq_len=run.cfg.data.max_seq_len,
        trained_layers=n_layers - lowest,
        dtype_bytes=2 if run.cfg.model.dtype == "bf16" else 4,
    )
    slots = slots_for_memory(requested, free_bytes, per_slot)
    if slots < requested:
        log(
            f"training.slots = {requested}: {slots} per pass fit in half of the "
            f"{free_bytes / 2**30:.1f} GiB free on {run.device}"
        )
    return slots


def to_numpy(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def to_torch(state: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


def checkpoint_state(run: Run, progress: Progress) -> dict[str, Any]:
    return {
        "round": progress.round,
        "progress": progress.__dict__.copy(),
        "global": run.lora.global_state(),
        "base_delta": run.base_delta,
        "method": run.method.state_dict(),
        "memory": run.memory.state_dict(),
        "server_opt": run.method.server_opt.state_dict() if run.method.server_opt else {},
        "client_optim": {
            f"{c}/{k}": v for c, state in run.optim_states.items() for k, v in state.items()
        },
        "seed": run.cfg.training.seed,
        "rng": "derived from (seed, stream, round): see fedlora.federation.engine.derive_rng",
    }


def restore_state(run: Run, state: dict[str, Any]) -> Progress:
    """Put a checkpoint's global adapter, merged base delta and method state back into `run`;
    its progress. Shared by the engine and the Flower ServerApp."""
    run.lora.load_global(state["global"])
    run.base_delta = state.get("base_delta") or {}
    if run.base_delta:
        run.lora.add_to_base(to_torch(run.base_delta))
    run.method.load_state_dict(state.get("method", {}))
    run.memory.load_state_dict(state.get("memory") or {})
    run.optim_states = {}
    for key, value in (state.get("client_optim") or {}).items():  # kept AdamW states
        client, name = key.split("/", 1)
        run.optim_states.setdefault(int(client), {})[name] = np.asarray(value)
    if run.method.server_opt is not None:  # method.server_optimizer's m, v, t
        run.method.server_opt.load_state_dict(state.get("server_opt") or {})
    return Progress(**state["progress"])
