"""The two references a federated result is read against (docs/methods.md, "References"):

`centralized`: one learner trains on the union of the clients' training data (the partition's
records, pooled), the same model, LoRA placement, client optimizer, batch and evaluation as the
federated run. `local`: every client trains alone on its own data and nothing is combined; the
evaluation scores each client's own adapter and reports their mean and spread.

Both get the federated run's budget of client-steps. ``method.budget_of`` names the federated
method; its participation per round (`Method.participation`: q_n for `sketched`, m/N for the
uniformly sampled methods) gives the expected participants per round E[m] = Σ_n p_n, and

    centralized: S = rounds × H × E[m] steps (or ``training.centralized_steps``),
    local:       P_n = rounds × p_n participations of client n, H steps each,

each rounded to the nearest integer and spread evenly over the run's rounds (`spread`), so the
rounds are only where the learners are evaluated and checkpointed. Each learner is one
uninterrupted training: its client-optimizer state is kept across rounds
(`Method.keeps_optimizer_state`), whatever ``training.optimizer_state`` says.

The clock: nothing is sent (no uplink, no downlink). Centralized computes on one device, the
fastest client's (the smallest τ_n of the run's profiles), for its steps of each round; in a
round of `local` every learner that trains computes H steps on its own device, in parallel,
so the round lasts as long as the slowest of them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError
from fedlora.federation.methods.base import (
    Adapter,
    Aggregation,
    ClientTask,
    LayerShapes,
    Method,
    MethodContext,
    Payload,
    RoundPlan,
)
from fedlora.federation.methods.registry import method_class, method_names, register_method

REFERENCES = ("centralized", "local")

ON_FLOWER = {
    "centralized": "it trains one learner on every client's data pooled in one place, which "
    "no node of a federation holds; run it with `fedlora run` or `fedlora compare --suite "
    "references`",
    "local": "nothing is sent or aggregated, and its evaluation scores every client's own "
    "adapter, which a Flower server never receives; run it with `fedlora run` or `fedlora "
    "compare --suite references`",
}


def spread(total: int, rounds: int, round_index: int) -> int:
    """Round `round_index`'s share of `total` steps (or participations) spread evenly over
    `rounds` rounds: ⌊(r+1)T/R⌋ − ⌊rT/R⌋. The shares sum to `total`; with T ≤ R each is 0
    or 1, and the last round always gets one when T > 0."""
    return (round_index + 1) * total // rounds - round_index * total // rounds


def budget_participation(ctx: MethodContext) -> np.ndarray:
    """(N,) each client's probability of taking part in a round of ``method.budget_of``
    (built from the same config with that method's name)."""
    cfg = ctx.cfg
    name = cfg.method.budget_of
    sub = cfg.replace(method=replace(cfg.method, name=name))
    try:
        method = method_class(name).from_config(replace(ctx, cfg=sub, tau_full_s=_tau_full_s(ctx)))
    except ConfigError as e:
        raise ConfigError(
            f"method.budget_of = {name!r} is invalid: its participation per round must be "
            f"fixed before the run, and building it fails: {e}"
        ) from None
    p = method.participation()
    if p is None:
        raise ConfigError(
            f"method.budget_of = {name!r} is invalid: its participation per round is not "
            "fixed in advance (e.g. planned during its run); name a method with fixed q or "
            "clients_per_round (e.g. 'sketched' with method.q = the plan's file), or set "
            "training.centralized_steps for centralized"
        )
    return np.asarray(p, dtype=float)


def _tau_full_s(ctx: MethodContext) -> np.ndarray:
    """The clients' compute times τ_n^γ: the run's, or rebuilt from the config as the engine
    builds them (they do not depend on the model)."""
    if ctx.tau_full_s is not None:
        return ctx.tau_full_s
    from fedlora.federation.profiles import build_profiles

    return build_profiles(ctx.cfg, full_payload_bits=1.0).tau_full_s


def _nearest(x: float | np.ndarray) -> np.ndarray:
    """Round half up (np.rint rounds half to even)."""
    return np.floor(np.asarray(x, dtype=float) + 0.5).astype(np.int64)


class ReferenceMethod(Method):
    """What the two references share: their budget's checks, nothing sent, the learners'
    optimizer state kept across rounds, and the Flower refusal."""

    keeps_optimizer_state = True

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        name = cfg.method.budget_of
        allowed = [n for n in method_names() if n not in REFERENCES]
        if name not in allowed:
            raise ConfigError(
                f"method.budget_of = {name!r} is invalid: the federated method the references' "
                f"budget follows; allowed: {', '.join(allowed)}"
            )

    @classmethod
    def check_run(cls, cfg: ExperimentConfig) -> None:
        """The budget is known before anything is created: ``method.budget_of``'s
        participation is fixed in advance (found here with equal data weights; the run uses
        the partition's)."""
        if cls.name == "centralized" and cfg.training.centralized_steps:
            return
        n = cfg.data.n_clients
        budget_participation(MethodContext(cfg, np.full(n, 1.0 / n), np.random.default_rng(0)))

    def payload(self, task: ClientTask, shapes: LayerShapes, plan: RoundPlan) -> Payload:
        return Payload(uplink_params=0, downlink_params=0)


@register_method("centralized")
class Centralized(ReferenceMethod):
    """One learner on the pooled data, `steps` steps spread over the rounds, timed on the
    device of client `device` (see the module)."""

    name = "centralized"
    dp_refusal = (
        "it is the non-private reference: one learner on every client's data "
        "pooled, nothing aggregated"
    )
    flower_refusal = ON_FLOWER["centralized"]

    def __init__(self, *, steps: int, rounds: int, device: int, gamma: int) -> None:
        self.steps, self.rounds, self.device, self.gamma = steps, rounds, device, gamma

    @classmethod
    def from_config(cls, ctx: MethodContext) -> Centralized:
        t = ctx.cfg.training
        steps = t.centralized_steps
        if not steps:
            expected = float(np.sum(budget_participation(ctx)))
            steps = int(_nearest(t.rounds * t.local_steps * expected))
            if steps < 1:
                raise ConfigError(
                    f"method.name = 'centralized': training.rounds × local_steps × the "
                    f"expected participants of {ctx.cfg.method.budget_of!r} ({expected:.3g}) "
                    "round to 0 steps; set training.centralized_steps"
                )
        device = int(np.argmin(_tau_full_s(ctx)))  # the fastest client's (ties: the first)
        return cls(steps=steps, rounds=t.rounds, device=device, gamma=ctx.gamma)

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        steps = spread(self.steps, self.rounds, round_index)
        if steps == 0:
            return RoundPlan(round_index, ())
        task = ClientTask(
            self.device, np.ones(self.gamma), self.gamma, 1.0, steps=steps, pooled=True
        )
        return RoundPlan(round_index, (task,))

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        # the learner's adapter is the model: nothing to combine
        return Aggregation(dict(client_states[0] if client_states else global_state))


@register_method("local")
class Local(ReferenceMethod):
    """Every client alone: client n trains H steps in `participations[n]` rounds spread
    evenly over the run, on its own data and its own adapter (see the module)."""

    name = "local"
    dp_refusal = (
        "it is the reference without federation: every client trains alone and nothing "
        "is aggregated or released"
    )
    evaluates_clients = True
    flower_refusal = ON_FLOWER["local"]

    def __init__(self, *, participations: np.ndarray, rounds: int, gamma: int) -> None:
        self.participations = np.asarray(participations, dtype=np.int64)
        self.rounds, self.gamma = rounds, gamma

    @classmethod
    def from_config(cls, ctx: MethodContext) -> Local:
        rounds = ctx.cfg.training.rounds
        participations = _nearest(rounds * budget_participation(ctx))
        return cls(participations=participations, rounds=rounds, gamma=ctx.gamma)

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        ones = np.ones(self.gamma)
        tasks = tuple(
            ClientTask(n, ones, self.gamma, 1.0)
            for n, p in enumerate(self.participations.tolist())
            if spread(p, self.rounds, round_index)
        )
        return RoundPlan(round_index, tasks)

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        # nothing arrives (every tensor stays with its client): the global adapter is unchanged
        return Aggregation(dict(global_state))

    def is_local(self, name: str) -> bool:
        return True  # each client keeps its whole adapter (the run's client memory)
