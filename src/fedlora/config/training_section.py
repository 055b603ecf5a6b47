"""The training section of an experiment config: the round loop (rounds, evaluation,
stopping, checkpoints) and the clients' local training (H steps of SGD or AdamW, their step
sizes across clients and rounds, the frozen-layer cache), with the checks that tie the
optimizer's fields together."""

from __future__ import annotations

from dataclasses import dataclass

from fedlora.config.checks import check_choice, check_int, check_number
from fedlora.errors import bad_value

SKETCH_STEPS = ("paper", "scaled")  # training.sketch_step (fedlora.llm.train.client_step_sizes)
OPTIMIZERS = ("sgd", "adamw")  # training.optimizer: the clients' local optimizer
OPTIMIZER_STATES = ("reset", "keep")  # training.optimizer_state
LR_SCHEDULES = ("constant", "cosine")  # training.lr_schedule, across rounds


@dataclass(frozen=True)
class TrainingConfig:
    """The round loop: local training (SGD or AdamW), evaluation, stopping and checkpoints."""

    rounds: int = 8  # maximum rounds
    local_steps: int = 5  # H
    batch_size: int = 4  # b
    lr: float = 0.2  # η (plain SGD, as in the paper's analysis)
    slots: int = 5  # clients trained together in one forward/backward
    eval_every: int = 8  # E (8 = the demo evaluates before and after training only)
    seed: int = 0
    target_accuracy: float = 0.0  # stop when reached; 0 = off
    target_loss: float = 0.0  # stop when the mean eval_loss is <= this; 0 = off
    target_mc_loss: float = 0.0  # stop when the mean mc_loss is <= this; 0 = off
    time_budget_s: float = 0.0  # stop when the simulated clock passes it; 0 = off
    # stop at the first evaluation whose mean accuracy is more than this below round 0's (a
    # run that has fallen that far, e.g. a step-size grid's diverged run); 0 = off
    stop_accuracy_drop: float = 0.0
    # also evaluate at the first round whose clock passes each multiple of this; 0 = off
    eval_every_s: float = 0.0
    checkpoint_every: int = 5
    # With lora.layers = K: cache the frozen layers below the top K per example (exact, LRU).
    layer_cache_mb: float = 2048.0  # memory bound of that cache in MB; 0 = off
    layer_cache_dtype: str = "fp32"  # fp32 (exact) | bf16 (half the memory, rounded)
    # "paper": every client steps with η (Eq. 4). "scaled": client n steps with
    # η·(k_n/γ)^1.5 (AdamW: η·(k_n/γ)^0.5), which makes the expected size of its first-step
    # ΔW independent of k_n (docs/methods.md, "Sketch-scaled local steps"; docs/models.md);
    # no effect on unsketched clients.
    sketch_step: str = "scaled"
    momentum: float = 0.0  # local heavy-ball momentum μ (reset every round); 0 = plain SGD
    # The clients' optimizer: "sgd" (plain, or heavy-ball with momentum) or "adamw" (per client
    # and per rank component of its sketch, fedlora.llm.client_optim), its state new at each
    # round start ("reset") or kept per client across the rounds it joins ("keep").
    optimizer: str = "sgd"
    adam_betas: tuple[float, ...] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    optimizer_state: str = "reset"
    # "cosine": lr at the first round, falling to lr_min after the last (llm.step_sizes.round_lr)
    lr_schedule: str = "constant"
    lr_min: float = 0.0
    # method.name = "centralized": its training steps (0: training.rounds × local_steps ×
    # the expected participants per round of method.budget_of; docs/methods.md, "References")
    centralized_steps: int = 0

    def __post_init__(self) -> None:
        check_int("training.rounds", self.rounds, lo=1)
        check_int("training.local_steps", self.local_steps, lo=1)
        check_int("training.centralized_steps", self.centralized_steps, lo=0)
        check_int("training.batch_size", self.batch_size, lo=1)
        check_number("training.lr", self.lr, lo=0, lo_open=True)
        check_int("training.slots", self.slots, lo=1)
        check_int("training.eval_every", self.eval_every, lo=1)
        check_int("training.seed", self.seed, lo=0)
        check_number("training.target_accuracy", self.target_accuracy, lo=0, hi=1)
        check_number("training.target_loss", self.target_loss, lo=0)
        check_number("training.target_mc_loss", self.target_mc_loss, lo=0)
        check_number("training.time_budget_s", self.time_budget_s, lo=0)
        check_number("training.stop_accuracy_drop", self.stop_accuracy_drop, lo=0, hi=1)
        check_number("training.eval_every_s", self.eval_every_s, lo=0)
        check_int("training.checkpoint_every", self.checkpoint_every, lo=1)
        check_number("training.layer_cache_mb", self.layer_cache_mb, lo=0)
        check_choice("training.layer_cache_dtype", self.layer_cache_dtype, ("fp32", "bf16"))
        check_choice("training.sketch_step", self.sketch_step, SKETCH_STEPS)
        check_number("training.momentum", self.momentum, lo=0, hi=1, hi_open=True)
        self._check_optimizer()

    def _check_optimizer(self) -> None:
        check_choice("training.optimizer", self.optimizer, OPTIMIZERS)
        if not isinstance(self.adam_betas, tuple) or len(self.adam_betas) != 2:
            raise bad_value("training.adam_betas", self.adam_betas, "two numbers [β1, β2]")
        for i, beta in enumerate(self.adam_betas):
            check_number(f"training.adam_betas[{i}]", beta, lo=0, hi=1, hi_open=True)
        check_number("training.adam_eps", self.adam_eps, lo=0, lo_open=True)
        check_number("training.weight_decay", self.weight_decay, lo=0)
        check_choice("training.optimizer_state", self.optimizer_state, OPTIMIZER_STATES)
        check_choice("training.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_number("training.lr_min", self.lr_min, lo=0)
        if self.lr_min > self.lr:
            raise bad_value("training.lr_min", self.lr_min, f"<= training.lr = {self.lr}")
        if self.optimizer == "adamw" and self.momentum:
            raise bad_value(
                "training.momentum",
                self.momentum,
                "0 with training.optimizer = 'adamw' (its first moment is training.adam_betas[0])",
            )
        if self.optimizer == "sgd" and self.weight_decay:
            raise bad_value(
                "training.weight_decay",
                self.weight_decay,
                "0 with training.optimizer = 'sgd' (decoupled weight decay is AdamW's)",
            )
        # AdamW's decay W <- (1 - η'λ) W with every client step size η' <= training.lr (a
        # sketch scales it by (k/γ)^p <= 1, a schedule lowers it): ηλ > 1 flips W's sign, as
        # method.server_weight_decay's bound says for the server optimizer
        if self.lr * self.weight_decay > 1:
            raise bad_value(
                "training.weight_decay",
                self.weight_decay,
                f"training.lr × training.weight_decay must be <= 1 (the decay factor 1 - ηλ "
                f">= 0); with training.lr = {self.lr}: at most {1 / self.lr:.6g}",
            )
        if self.optimizer == "sgd" and self.optimizer_state == "keep":
            raise bad_value(
                "training.optimizer_state",
                self.optimizer_state,
                "'reset' with training.optimizer = 'sgd' (its momentum buffer starts anew "
                "every round; a kept state is AdamW's)",
            )
