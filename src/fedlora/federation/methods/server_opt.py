"""Server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2).

A method whose aggregate is the global adapter plus an update, X' = X + Δ (`Method.
delta_aggregate`), hands Δ to a server optimizer as a pseudo-gradient (−Δ is the gradient
direction). Per round t = 1, 2, ..., elementwise, with η = ``method.server_lr``:

    avg      X ← X + η Δ                                   (η = 1: the method's own aggregate)
    avgm     m ← μ m + Δ;                 X ← X + η m      (FedAvgM, μ = method.server_momentum)
    adam     m ← β1 m + (1−β1) Δ;  v ← β2 v + (1−β2) Δ²
    yogi     m as adam;            v ← v − (1−β2) Δ² sign(v − Δ²)
    adagrad  m as adam;            v ← v + Δ²
             X ← X + η m̂ / (√v̂ + τ)   (adam, yogi, adagrad; τ = method.server_eps)

with m, v starting at 0, and m̂ = m, v̂ = v as in Reddi et al., or, with
``method.server_bias_correction``, m̂ = m/(1−β1^t), v̂ = v/(1−β2^t) as torch's Adam (adam and
yogi only; adagrad's v is a sum). ``method.server_weight_decay`` λ shrinks X first,
X ← (1 − ηλ) X, as torch's AdamW (decoupled). A round without participants is no step.

Pure numpy on ``name -> array`` dicts; the state (m, v, t) is float64 and is checkpointed
exactly (`state_dict`), so a resumed run continues bit-identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedlora.config.sections import SERVER_OPTIMIZERS, MethodConfig
from fedlora.errors import FedloraError

Arrays = dict[str, np.ndarray]


class ServerStepDiverged(FedloraError):
    """A server step made the global adapter non-finite from a finite update: the step is
    not taken (the run stops; its last checkpoint, from before this round, is kept)."""


@dataclass
class ServerOptimizer:
    kind: str = "avg"
    lr: float = 1.0  # η
    momentum: float = 0.9  # μ (avgm)
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3  # τ
    bias_correction: bool = False
    weight_decay: float = 0.0  # λ (decoupled)
    step_count: int = 0
    m: Arrays = field(default_factory=dict)
    v: Arrays = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in SERVER_OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.kind!r}")

    @property
    def is_identity(self) -> bool:
        """True when every step returns the method's aggregate unchanged (avg, η = 1, λ = 0)."""
        return self.kind == "avg" and self.lr == 1.0 and self.weight_decay == 0.0

    def step(self, global_state: Arrays, aggregate: Arrays) -> Arrays:
        """The next global adapter from the current one X and the method's aggregate X + Δ."""
        if self.is_identity:
            return aggregate
        self.step_count += 1
        t = self.step_count
        out: Arrays = {}
        for name, new in aggregate.items():
            x = global_state[name].astype(np.float64)
            delta = new.astype(np.float64) - x  # (shape of the parameter)
            if self.weight_decay:
                x = x * (1.0 - self.lr * self.weight_decay)
            x = x + self.lr * self._direction(name, delta, t)
            with np.errstate(over="ignore", invalid="ignore"):  # checked just below
                out[name] = x.astype(new.dtype)
            if not np.isfinite(out[name]).all() and np.isfinite(delta).all():
                raise ServerStepDiverged(
                    f"server step {t}: method.server_optimizer = {self.kind!r} with "
                    f"method.server_lr = {self.lr:g} made the global adapter non-finite in "
                    f"{name} (the clients' update was finite): lower method.server_lr"
                )
        return out

    def _direction(self, name: str, delta: np.ndarray, t: int) -> np.ndarray:
        if self.kind == "avg":
            return delta
        m = self.m.get(name, np.zeros_like(delta))
        if self.kind == "avgm":
            self.m[name] = self.momentum * m + delta
            return self.m[name]
        m = self.beta1 * m + (1.0 - self.beta1) * delta
        v = self.v.get(name, np.zeros_like(delta))
        d2 = delta * delta
        if self.kind == "adam":
            v = self.beta2 * v + (1.0 - self.beta2) * d2
        elif self.kind == "yogi":
            v = v - (1.0 - self.beta2) * d2 * np.sign(v - d2)
        else:  # adagrad
            v = v + d2
        self.m[name], self.v[name] = m, v
        if self.bias_correction and self.kind != "adagrad":
            m = m / (1.0 - self.beta1**t)
            v = v / (1.0 - self.beta2**t)
        return m / (np.sqrt(v) + self.eps)

    @classmethod
    def from_config(cls, m: MethodConfig) -> ServerOptimizer:
        """The server optimizer of ``method.server_*``."""
        beta1, beta2 = m.server_betas
        return cls(
            kind=m.server_optimizer,
            lr=m.server_lr,
            momentum=m.server_momentum,
            beta1=beta1,
            beta2=beta2,
            eps=m.server_eps,
            bias_correction=m.server_bias_correction,
            weight_decay=m.server_weight_decay,
        )

    def state_dict(self) -> Arrays:
        """m, v and the step count t as float64 / int64 arrays (``m/<name>``, ``v/<name>``)."""
        state = {f"m/{k}": a for k, a in self.m.items()} | {f"v/{k}": a for k, a in self.v.items()}
        return state | {"t": np.array([self.step_count], dtype=np.int64)}  # (1,)

    def load_state_dict(self, state: Arrays) -> None:
        self.step_count = int(np.asarray(state.get("t", 0)).reshape(-1)[0])
        self.m = {k[2:]: np.asarray(a, dtype=np.float64) for k, a in state.items() if k[:2] == "m/"}
        self.v = {k[2:]: np.asarray(a, dtype=np.float64) for k, a in state.items() if k[:2] == "v/"}
