"""Local training of a round's participants, behind one interface (`Trainer`): the engine's
round loop (`fedlora.federation.engine.run_rounds`) calls `train(plan, global_state)` and
gets back the adapters that arrived. `SlotTrainer` trains in this process, `slots` clients
per forward/backward; the Flower ServerApp's trainer sends the tasks to its nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlora.errors import FedloraError
from fedlora.federation.methods.base import RoundPlan
from fedlora.federation.runstate import Run, to_numpy
from fedlora.federation.trainable import Trainable
from fedlora.system.seeding import derive_rng, derive_seed


class TrainingDiverged(FedloraError):
    """A non-finite training loss: the run stops and keeps its last good checkpoint."""


@dataclass
class Trained:
    """What came back from one round's local training: `plan` holds the tasks whose adapters
    arrived (with the weights to aggregate them by), `states` and `losses` their adapters and
    mean training losses (in that order), `dropouts` the clients asked that did not answer."""

    plan: RoundPlan
    states: list[dict[str, np.ndarray]]
    losses: Any  # (n,) floats
    dropouts: list[int] = field(default_factory=list)


class Trainer:
    """Local training of a round's participants for `fedlora.federation.engine.run_rounds`.

    `train` is the one verb; the others let a runtime add to what the loop records (Flower:
    the dropouts on every metrics line, its answer counts in checkpoints, its summary keys).
    `trains_here`: whether `train` computes on this machine (machine.jsonl's ``trains``).
    """

    trains_here: bool = True

    def train(self, plan: RoundPlan, global_state: dict[str, np.ndarray]) -> Trained:
        raise NotImplementedError

    def line_fields(self, trained: Trained | None) -> dict[str, Any]:
        """Extra fields at the end of a round's metrics line (None: round 0 or no participant)."""
        return {}

    def report(self, line: dict[str, Any]) -> None:
        """Called with every round's metrics line once it is written."""

    def state_dict(self) -> dict[str, Any]:
        """Extra entries of a checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint (the whole checkpoint state)."""

    def summary_fields(self) -> dict[str, Any]:
        """Extra keys of summary.json."""
        return {}


class SlotTrainer(Trainer):
    """In-process training: the participants share the model, `slots` per forward/backward."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def train(self, plan: RoundPlan, global_state: dict[str, np.ndarray]) -> Trained:
        states, losses = train_participants(self.run, plan)  # slots start from the global
        return Trained(plan, states, losses)


def train_participants(run: Run, plan: RoundPlan) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """Local training of every participant, `slots` clients per forward/backward.

    Returns each participant's final adapter (in plan order) and its mean loss over H steps.
    """
    from fedlora.llm.train import TrainingError, layer_cache_for

    cfg, r = run.cfg, plan.round
    # lora.layers = K: frozen lower layers once per example, kept across rounds (exact), and
    # on disk (run.disk), shared with other runs of the same model
    cache = layer_cache_for(
        run.model,
        run.lora,
        cfg.training.layer_cache_mb,
        cfg.training.layer_cache_dtype,
        disk=run.disk,
    )
    states: list[dict[str, np.ndarray]] = []
    losses: list[float] = []
    tasks = list(plan.tasks)
    for what in ("trains", "steps"):  # the slots of one pass step together
        values = {getattr(t, what) for t in tasks}
        if len(values) > 1:
            raise FedloraError(f"round {r + 1}: tasks differ in {what} {sorted(values)}")
    memory = run.memory  # what clients keep across rounds (FedSA-LoRA's B_n)
    # training.optimizer_state = "keep" (or a reference's learner): each client's AdamW state
    # across its rounds
    keep = cfg.training.optimizer_state == "keep" or run.method.keeps_optimizer_state
    kept = run.optim_states if keep else None
    per_pass = run.slots_per_pass or cfg.training.slots
    for start in range(0, len(tasks), per_pass):
        chunk = tasks[start : start + per_pass]
        clients = [t.client for t in chunk]
        try:
            chunk_losses = train_clients(
                run,
                r,
                clients,
                np.stack([t.scale for t in chunk]),
                start,
                cache=cache,
                trains=chunk[0].trains,
                overlays=[memory.restore(c) for c in clients],
                optim_states=kept,
                steps=chunk[0].steps,
                pooled=[t.pooled for t in chunk],
            )  # (c, H)
        except TrainingError as e:
            raise TrainingDiverged(f"round {r + 1}, clients {clients}: {e}") from None
        for i, client in enumerate(clients):  # a client's local part stays with it
            states.append(memory.keep(client, to_numpy(run.lora.slot_state(i))))
        losses.extend(np.asarray(chunk_losses).mean(axis=1).tolist())
    return states, np.array(losses)


def train_clients(
    holder: Trainable,
    round_index: int,
    clients: list[int],
    scales: np.ndarray,
    torch_id: int,
    *,
    cache: Any = None,
    trains: str = "AB",
    overlays: list[dict[str, np.ndarray]] | None = None,
    optim_states: dict[int, dict[str, np.ndarray]] | None = None,
    steps: int = 0,
    pooled: list[bool] | None = None,
) -> Any:
    """H local steps of `clients` on slots 0..c-1 (each starts from the global adapter);
    returns their losses (c, H). `holder`: what trains, the in-process `Run` or a Flower
    node's state (`Trainable`: cfg, model, tokenizer, lora, fed). The draws: batches from
    ``derive_rng(seed, "data", r, client)``, torch seeded by ``derive_seed(seed, "torch", r,
    torch_id)`` (torch_id: the first client's position in the round's plan). `trains`: the
    factors that move (`SlotLora.set_trainable`); `overlays[i]`: slot i's own tensors (a
    client's kept local part) over the global adapter. The step size: ``training.lr`` under
    ``training.lr_schedule`` at this round (`round_lr`), per client with ``sketch_step``.
    ``training.optimizer = "adamw"``: a `SlotAdamW` on the c slots, new (`optim_states`
    None) or starting from each client's entry in `optim_states`, which it updates (a
    client's kept state, ``training.optimizer_state = "keep"``). `steps`: the local steps
    (0: ``training.local_steps``); `pooled[i]`: slot i's batches come from the union of every
    client's data (`centralized`)."""
    import torch

    from fedlora.llm.step_sizes import round_lr, step_sizes_for
    from fedlora.llm.train import local_train

    cfg, seed = holder.cfg, holder.cfg.training.seed
    t = cfg.training
    scales = np.asarray(scales, dtype=np.float32)  # (c, γ)
    holder.lora.set_clients(torch.from_numpy(scales))
    holder.lora.set_trainable(trains)
    for i, values in enumerate(overlays or []):
        if values:
            holder.lora.set_slot(i, {k: torch.from_numpy(np.asarray(v)) for k, v in values.items()})
    batches = _batches(holder, round_index, clients, steps, pooled)
    # training.optimizer read once, here: the object (None = SGD) is what travels on
    adamw = _slot_adamw(holder, clients, optim_states) if t.optimizer == "adamw" else None
    torch.manual_seed(derive_seed(seed, "torch", round_index, torch_id))
    lr = round_lr(t.lr, t.lr_min, t.lr_schedule, round_index, t.rounds)
    losses = local_train(
        holder.model,
        holder.lora,
        batches,
        step_sizes_for(lr, t.sketch_step, scales, adamw),
        autocast_bf16=cfg.model.dtype == "bf16",
        cache=cache,
        momentum=t.momentum,
        optimizer=adamw,
    )
    if adamw is not None and optim_states is not None:
        for i, client in enumerate(clients):
            optim_states[int(client)] = {k: v.numpy() for k, v in adamw.slot_state(i).items()}
    return losses


def _batches(
    holder: Trainable,
    round_index: int,
    clients: list[int],
    steps: int,
    pooled: list[bool] | None,
) -> list[list[dict[str, Any]]]:
    """Each client's H batches of this round, drawn from ``derive_rng(seed, "data", r,
    client)`` (from every client's data where `pooled`)."""
    from fedlora.llm.data import client_batches

    cfg, seed = holder.cfg, holder.cfg.training.seed
    pooled = pooled or [False] * len(clients)
    return [
        client_batches(
            holder.fed,
            client,
            steps or cfg.training.local_steps,
            cfg.training.batch_size,
            derive_rng(seed, "data", round_index, client),
            holder.tokenizer.pad_token_id,
            pooled=pool,
        )
        for client, pool in zip(clients, pooled)
    ]


def _slot_adamw(
    holder: Trainable, clients: list[int], optim_states: dict[int, dict[str, np.ndarray]] | None
) -> Any:
    """A `SlotAdamW` on the c slots, each starting from its client's kept state, if any."""
    from fedlora.llm.client_optim import SlotAdamW

    t = holder.cfg.training
    kept = optim_states if optim_states is not None else {}
    return SlotAdamW(
        holder.lora,
        betas=t.adam_betas,
        eps=t.adam_eps,
        weight_decay=t.weight_decay,
        states=[_to_torch(kept.get(int(client))) for client in clients],
    )


def _to_torch(state: dict[str, np.ndarray] | None) -> dict[str, Any] | None:
    import torch

    return None if state is None else {k: torch.from_numpy(v.copy()) for k, v in state.items()}
