"""AdamW for the clients' LoRA slots: one AdamW per slot and per rank component of its sketch.

`local_train` trains c clients at once on slots 0..c-1 of every adapted layer (A (C, r, in),
B (C, out, r), R (C, r, r)). `SlotAdamW` keeps, per tensor, the moments m and v of every
slot (the same shape as the slot tensors) and a step count per slot and rank component
(c, r), and applies `torch.optim.AdamW`'s update (decoupled weight decay, bias-corrected
moments) to the elements a client trains: rank component j of slot i is trained iff the
client's sketch scale s_i[j] > 0 (A's row j, B's and R's column j; with Fed-SB's middle
factor every column of B, since R mixes the components). The other elements keep their
weights, moments and step count: no weight decay, no moment decay. So one step of a slot is
`torch.optim.AdamW` on that client's sketched slice alone, and c slots at once are c separate
clients (tests/test_client_optim.py).

A slot's state (`slot_state`, the input `states`) is a dict of fp32 tensors named
``<layer>.lora_A.exp_avg``, ``.exp_avg_sq``, ``.step`` (``.lora_B``, ``.lora_R`` alike): what
``training.optimizer_state = "keep"`` carries from one of a client's rounds to the next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedlora.config.checks import check_number
from fedlora.errors import ConfigError, bad_value
from fedlora.llm.lora import SlotLora
from fedlora.llm.step_sizes import ADAMW_SKETCH_STEP_POWER

__all__ = ["SlotAdamW", "check_adamw_options"]

STATE_PARTS = ("exp_avg", "exp_avg_sq", "step")


def check_adamw_options(betas: Sequence[float], eps: float, weight_decay: float) -> None:
    """ConfigError naming training.adam_betas / adam_eps / weight_decay for a bad value."""
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise bad_value("training.adam_betas", betas, "two numbers [β1, β2]")
    for i, beta in enumerate(betas):
        check_number(f"training.adam_betas[{i}]", beta, lo=0, hi=1, hi_open=True)
    check_number("training.adam_eps", eps, lo=0, lo_open=True)
    check_number("training.weight_decay", weight_decay, lo=0)


class SlotAdamW:
    """AdamW on the c active slots of `lora` (see the module docstring).

    Built after `lora.set_clients(scales)` (and `set_trainable`): the sketch masks are read
    from the slots' scales then. `states[i]`: slot i's state from an earlier round (None or
    absent: a new AdamW, zero moments). `step(lrs)` updates every slot tensor that has a
    gradient, with slot i's step size ``lrs[i]``.
    """

    # training.sketch_step = "scaled": the p of η·(k_n/γ)^p under AdamW (`step_sizes_for`)
    sketch_step_power = ADAMW_SKETCH_STEP_POWER

    def __init__(
        self,
        lora: SlotLora,
        *,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        states: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    ) -> None:
        check_adamw_options(betas, eps, weight_decay)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        c = self.active = lora.active
        states = list(states or [])
        if len(states) > c:
            raise ConfigError(f"{len(states)} optimizer states for {c} active slots")
        # (key, parameter, rank axis of its mask); every layer's scales are the same rows
        self.entries: list[tuple[str, torch.nn.Parameter, torch.Tensor]] = []
        for name, layer in lora.layers.items():
            rows = layer.scale[:c] > 0  # (c, r): the components each client trains
            everywhere = torch.ones_like(rows)
            self.entries.append((f"{name}.lora_A", layer.lora_A, rows))
            b_rows = everywhere if layer.lora_R is not None else rows  # R mixes components
            self.entries.append((f"{name}.lora_B", layer.lora_B, b_rows))
            if layer.lora_R is not None:
                self.entries.append((f"{name}.lora_R", layer.lora_R, rows))
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for key, p, _ in self.entries:
            zeros = torch.zeros_like(p[:c], dtype=torch.float32)
            self.state[key] = {
                "exp_avg": zeros,
                "exp_avg_sq": zeros.clone(),
                "step": torch.zeros(c, lora.rank, dtype=torch.float32, device=p.device),
            }
        for i, slot in enumerate(states):
            if slot:
                self._load_slot(i, slot)

    def _load_slot(self, i: int, slot: Mapping[str, torch.Tensor]) -> None:
        expected = {f"{key}.{part}" for key in self.state for part in STATE_PARTS}
        if set(slot) != expected:
            missing, extra = sorted(expected - set(slot)), sorted(set(slot) - expected)
            raise ConfigError(
                f"optimizer state of slot {i} does not match the adapter (missing "
                f"{missing[:3]}, unexpected {extra[:3]})"
            )
        with torch.no_grad():
            for key, parts in self.state.items():
                for part, buf in parts.items():
                    value = torch.as_tensor(slot[f"{key}.{part}"])
                    if tuple(value.shape) != tuple(buf.shape[1:]):
                        raise ConfigError(
                            f"optimizer state {key}.{part} of slot {i} has shape "
                            f"{tuple(value.shape)}, expected {tuple(buf.shape[1:])}"
                        )
                    buf[i].copy_(value)

    def slot_state(self, i: int) -> dict[str, torch.Tensor]:
        """Slot i's state (fp32 CPU copies), the form `states` takes back."""
        if not 0 <= i < self.active:
            raise ConfigError(f"slot {i} is not active: 0 <= i < {self.active}")
        return {
            f"{key}.{part}": buf[i].detach().float().cpu().clone()
            for key, parts in self.state.items()
            for part, buf in parts.items()
        }

    @torch.no_grad()
    def step(self, lrs: torch.Tensor) -> None:
        """One AdamW step of every slot tensor with a gradient; `lrs` (c,) per slot."""
        c = self.active
        b1, b2 = self.beta1, self.beta2
        for key, p, rows in self.entries:
            if p.grad is None:
                continue  # a frozen factor (`SlotLora.set_trainable`): state kept as it is
            s = self.state[key]
            on_mps = p.device.type == "mps"  # no float64 there
            rank_axis = 1 if key.endswith(".lora_A") else 2  # A: rows; B, R: columns
            mask = rows.unsqueeze(3 - rank_axis)  # (c, r, 1) or (c, 1, r)
            grad = p.grad[:c].float()
            s["step"].add_(rows.to(s["step"].dtype))
            # (c, r), in float64 as torch's Python-float bias corrections (MPS: float32);
            # the count is 0 only where nothing trains
            step = s["step"].clamp(min=1).to(torch.float32 if on_mps else torch.float64)
            bc1 = (1 - b1**step).float().unsqueeze(3 - rank_axis)
            bc2_sqrt = (1 - b2**step).sqrt().float().unsqueeze(3 - rank_axis)
            lr = lrs.to(device=p.device, dtype=torch.float32).view(c, 1, 1)
            w = p[:c]
            # decoupled weight decay, then the moments, as torch.optim.AdamW
            w.copy_(torch.where(mask, w * (1 - lr * self.weight_decay), w))
            m = torch.where(mask, s["exp_avg"].lerp(grad, 1 - b1), s["exp_avg"])
            v = torch.where(mask, s["exp_avg_sq"] * b2 + (1 - b2) * grad * grad, s["exp_avg_sq"])
            s["exp_avg"].copy_(m)
            s["exp_avg_sq"].copy_(v)
            denom = v.sqrt() / bc2_sqrt + self.eps
            update = (lr / bc1) * m / denom
            w.sub_(torch.where(mask, update, torch.zeros_like(update)).to(w.dtype))
