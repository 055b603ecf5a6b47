"""`heterolora`: heterogeneous-rank LoRA with truncation and zero padding (HetLoRA, Cho et al. 2024).

The global adapter has rank γ. Participant n (m sampled uniformly per round,
``method.clients_per_round``; 0 = all) has rank budget r_n ≤ γ (``method.ranks``):

- download: the global adapter truncated to its first r_n components (B[:, :r_n], A[:r_n]);
- local training of those r_n components as a LoRA of rank r_n: its forward factor is α/r_n
  (`scaling = "rank"`, HetLoRA: every client's LoRA has the same α). The slot computes
  (α/γ)·B diag(s) A, so s = γ/r_n on the first r_n components and 0 elsewhere.
  ``scaling = "global"`` keeps α/γ for everyone (s = 1). With rsLoRA (``lora.rslora``) a
  rank-r_n LoRA scales by α/√r_n and the slot by α/√γ, so s = √(γ/r_n);
- upload: the r_n trained components; the server zero-pads the *updates* back to rank γ and
  adds their weighted mean (``padding = "updates"``, the reference):

      B ← B + Σ_{n∈K} p_n pad(B_n − B),   A ← A + Σ_{n∈K} p_n pad(A_n − A),   Σ_{n∈K} p_n = 1,

  so a component nobody trained this round keeps its global value, and one trained by some
  participants moves by their share. ``padding = "modules"`` averages the zero-padded modules
  themselves (B ← Σ p_n B̃_n): a component no participant trains becomes 0 and, with B and A
  both 0, never gets a gradient again: under partial participation the live rank can only
  shrink. Kept for comparison only.

Weights p_n (`weighting`): ``"sparsity"`` (HetLoRA's sparsity-weighted aggregation, the
default): per LoRA module, p_n ∝ ‖B̃_n Ã_n‖_F, the Frobenius norm of the client's padded
product, normalised over the participants (all norms zero: falls back to data weights);
``"data"``: p_n = a_n / Σ_{K} a_n.

Rank self-pruning (`pruning` = the decay factor d in (0, 1), HetLoRA §3; 0 = off; the option
``[method.heterolora] pruning``, `HeteroLoRAOptions`): after its
local training, client n measures the norm of its tail components j ∈ [⌊d·r_n⌋, r_n),
‖B_tail‖_F·‖A_tail‖_F summed over the modules; when it is smaller than the value it measured
the last time it trained at the same rank, the client prunes its rank to max(1, ⌊d·r_n⌋) for
the following rounds. The decision needs only the uploaded adapter, so the server makes it.
HetLoRA also adds this tail norm, times λ, to the local loss to push the tail down; fedlora's
local training has no such term (the schedule is the paper's, the regulariser is not).

Payload: r_n(out + in) parameters per module, up and down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError, bad_value
from fedlora.federation.methods.base import (
    Adapter,
    Aggregation,
    ClientTask,
    MethodContext,
    RoundPlan,
)
from fedlora.federation.methods.factors import lora_modules, normalized_weights, product_fro_norm
from fedlora.federation.methods.fedavg import RankTruncationMethod, weighted_mean
from fedlora.federation.methods.registry import register_method

WEIGHTINGS = ("sparsity", "data")
PADDINGS = ("updates", "modules")
SCALINGS = ("rank", "global")


def tail_norm(state: Adapter, rank: int, decay: float) -> float:
    """HetLoRA's pruning statistic: Σ_modules ‖B[:, t:r]‖_F·‖A[t:r]‖_F, t = ⌊decay·r⌋."""
    start = int(math.floor(decay * rank))
    total = 0.0
    for mod in lora_modules(state):
        a = state[f"{mod}.lora_A"][start:rank].astype(np.float64)
        b = state[f"{mod}.lora_B"][:, start:rank].astype(np.float64)
        total += float(np.linalg.norm(b) * np.linalg.norm(a))
    return total


def check_pruning(pruning: float) -> None:
    """ConfigError unless the self-pruning decay d is 0 (off) or in (0, 1)."""
    if isinstance(pruning, bool) or not (pruning == 0 or 0 < pruning < 1):
        raise bad_value("method.heterolora.pruning", pruning, "0 (off) or in (0, 1)")


@dataclass(frozen=True)
class HeteroLoRAOptions:
    """HeteroLoRA's own options, the table ``[method.heterolora]``."""

    # HetLoRA's rank self-pruning decay factor d: r_n -> floor(d r_n) when the client's tail
    # norm falls; 0 = off (formerly method.heterolora_pruning)
    pruning: float = 0.0

    def __post_init__(self) -> None:
        check_pruning(self.pruning)


def _weighting(cfg: ExperimentConfig) -> str:
    """ "data" under DP or secure aggregation (the norms of each client's own update are
    data-dependent, and secure aggregation hides them from the server), else "sparsity"."""
    private = cfg.privacy.enabled or cfg.privacy.secure_aggregation
    return "data" if private else "sparsity"


@register_method("heterolora")
class HeteroLoRA(RankTruncationMethod):
    name = "heterolora"
    dp_sampling = "uniform"  # m of N uniformly; X + Σ w_n pad(X_n − X) (data weights)
    normalised_weights = True  # a_n / Σ_K a_j
    secagg_masked = True  # the aggregate zero-pads each update to the trained ranks
    delta_aggregate = True  # padding = "updates": X + Σ p_n pad(X_n − X)
    options = HeteroLoRAOptions

    @classmethod
    def check_privacy(cls, cfg: ExperimentConfig) -> None:
        """Self-pruning (a rank schedule decided from the clients' own updates) is refused
        with differential privacy and with secure aggregation."""
        p, pruning = cfg.privacy, cls.read_options(cfg).pruning
        if pruning and p.secure_aggregation:
            raise ConfigError(
                f"privacy.secure_aggregation = true is invalid with method.heterolora.pruning = "
                f"{pruning!r}: the self-pruning schedule needs each client's own update, which "
                "the server no longer sees; set method.heterolora.pruning = 0"
            )
        if pruning and p.enabled:
            raise ConfigError(
                f"privacy.mode = {p.mode!r} is invalid with method.heterolora.pruning = "
                f"{pruning!r}: the self-pruning schedule is decided from the clients' un-noised "
                "updates; set method.heterolora.pruning = 0"
            )

    @classmethod
    def from_config(cls, ctx: MethodContext) -> HeteroLoRA:
        m = ctx.cfg.method
        return cls(
            a=ctx.a,
            ranks=ctx.ranks(),
            gamma=ctx.gamma,
            clients_per_round=m.clients_per_round,
            pruning=ctx.options.pruning,
            rslora=ctx.cfg.lora.rslora,
            weighting=_weighting(ctx.cfg),
        )

    def __init__(
        self,
        *,
        a: np.ndarray,
        ranks: np.ndarray,
        gamma: int,
        clients_per_round: int = 0,
        weighting: str = "sparsity",
        padding: str = "updates",
        scaling: str = "rank",
        pruning: float = 0.0,
        rslora: bool = False,
    ) -> None:
        if weighting not in WEIGHTINGS:
            raise bad_value("heterolora weighting", weighting, f"one of {', '.join(WEIGHTINGS)}")
        if padding not in PADDINGS:
            raise bad_value("heterolora padding", padding, f"one of {', '.join(PADDINGS)}")
        if scaling not in SCALINGS:
            raise bad_value("heterolora scaling", scaling, f"one of {', '.join(SCALINGS)}")
        check_pruning(pruning)
        super().__init__(a=a, ranks=ranks, gamma=gamma, clients_per_round=clients_per_round)
        self.ranks = self.ranks.copy()  # pruning changes them
        self.weighting, self.padding, self.scaling = weighting, padding, scaling
        self.rslora = bool(rslora)
        self.pruning = float(pruning)
        self._tail: dict[int, tuple[int, float]] = {}  # client -> (rank, last tail norm)

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        plan = super().plan_round(round_index, rng_sampling, rng_sketch)
        if self.scaling == "global":
            return plan
        tasks = tuple(  # s = γ/r_n on the first r_n: the slot's α/γ becomes α/r_n
            ClientTask(t.client, t.scale * self._rank_factor(t.rank_used), t.rank_used, t.weight)
            for t in plan.tasks
        )
        return RoundPlan(plan.round, tasks)

    def _rank_factor(self, rank: int) -> float:
        """s on a rank-r client's components: the slot's α/γ (α/√γ) times s is α/r (α/√r)."""
        return (self.gamma / rank) ** 0.5 if self.rslora else self.gamma / rank

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        data_w = normalized_weights(plan)
        masks = [(np.asarray(t.scale) != 0).astype(np.float64) for t in plan.tasks]  # (γ,) each
        out: Adapter = {}
        info: dict = {"weights": {}}
        for mod in lora_modules(global_state):
            ka, kb = f"{mod}.lora_A", f"{mod}.lora_B"
            padded_a = [m[:, None] * s[ka] for m, s in zip(masks, client_states)]  # (γ, in)
            padded_b = [s[kb] * m[None, :] for m, s in zip(masks, client_states)]  # (out, γ)
            p = data_w
            if self.weighting == "sparsity":
                norms = np.array([product_fro_norm(b, a) for b, a in zip(padded_b, padded_a)])
                if norms.sum() > 0:
                    p = norms / norms.sum()
            info["weights"][mod] = p.tolist()
            g_a = global_state[ka].astype(np.float64)
            g_b = global_state[kb].astype(np.float64)
            if self.padding == "updates":  # untouched components: update 0, value kept
                new_a = g_a + sum(w * (x - m[:, None] * g_a) for w, x, m in zip(p, padded_a, masks))
                new_b = g_b + sum(w * (x - g_b * m[None, :]) for w, x, m in zip(p, padded_b, masks))
            else:
                new_a = sum(w * x for w, x in zip(p, padded_a))
                new_b = sum(w * x for w, x in zip(p, padded_b))
            out[ka] = np.asarray(new_a).astype(global_state[ka].dtype)
            out[kb] = np.asarray(new_b).astype(global_state[kb].dtype)
        rest = [k for k in global_state if k not in out]
        if rest:  # anything that is not a LoRA pair: the data-weighted mean
            out.update(weighted_mean([{k: s[k] for k in rest} for s in client_states], data_w))
        if self.pruning:
            self._self_prune(plan, client_states)
            info["ranks"] = [int(self.ranks[t.client]) for t in plan.tasks]
        return Aggregation(out, info=info)

    def _self_prune(self, plan: RoundPlan, client_states: list[Adapter]) -> None:
        """HetLoRA's schedule: prune r_n to ⌊d·r_n⌋ when the tail norm fell since last time."""
        for t, state in zip(plan.tasks, client_states):
            rank = t.rank_used
            value = tail_norm(state, rank, self.pruning)
            last = self._tail.get(t.client)
            new_rank = max(1, int(math.floor(self.pruning * rank)))
            if last is not None and last[0] == rank and value < last[1] and new_rank < rank:
                self.ranks[t.client] = new_rank
                self._tail.pop(t.client)
            else:
                self._tail[t.client] = (rank, value)

    def state_dict(self) -> dict:
        if not self.pruning:
            return {}
        return {
            "ranks": [int(r) for r in self.ranks],
            "tail": {int(c): [int(r), float(v)] for c, (r, v) in self._tail.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("ranks") is not None:
            self.ranks = np.asarray(state["ranks"], dtype=np.int64)
        self._tail = {int(c): (int(r), float(v)) for c, (r, v) in state.get("tail", {}).items()}
