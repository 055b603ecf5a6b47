"""What clients keep for themselves across rounds: the part of the adapter a method never
uploads (`Method.is_local`; FedSA-LoRA's B_n), held per client by the simulation.

Before client n trains, `restore(n)` gives the values it kept the last time it took part
(never taken part: the run's initial values); after, `keep(n, state)` stores its local part
and returns what it uploads (the rest). `mean(a)` is Σ_n a_n X_n over every client's kept
values: the evaluation view of the global adapter (no link carries it). A method without
local tensors leaves the memory empty and every call a no-op.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Adapter = dict[str, np.ndarray]


class ClientMemory:
    def __init__(self, is_local: Callable[[str], bool], initial: Adapter) -> None:
        self.initial = {k: np.array(v) for k, v in initial.items() if is_local(k)}
        self.kept: dict[int, Adapter] = {}

    def __bool__(self) -> bool:
        return bool(self.initial)

    def restore(self, client: int) -> Adapter:
        """Client `client`'s local tensors (its kept ones, else the initial values)."""
        return self.kept.get(int(client), self.initial) if self.initial else {}

    def keep(self, client: int, state: Adapter) -> Adapter:
        """Store `client`'s local tensors of its trained `state`; returns its upload."""
        if not self.initial:
            return state
        self.kept[int(client)] = {k: np.array(state[k]) for k in self.initial}
        return {k: v for k, v in state.items() if k not in self.initial}

    def mean(self, a: np.ndarray) -> Adapter:
        """Σ_n a_n X_n over clients 0..N−1 (float64 accumulation, cast back)."""
        out = {}
        for k, x0 in self.initial.items():
            acc = sum(float(w) * self.restore(n)[k].astype(np.float64) for n, w in enumerate(a))
            out[k] = np.asarray(acc).astype(x0.dtype)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """``"<client>/<tensor>"`` -> array (checkpointed as tensors)."""
        return {f"{c}/{k}": v for c, state in self.kept.items() for k, v in state.items()}

    def load_state_dict(self, flat: dict[str, np.ndarray]) -> None:
        self.kept = {}
        for key, v in flat.items():
            c, name = key.split("/", 1)
            self.kept.setdefault(int(c), {})[name] = np.asarray(v)
