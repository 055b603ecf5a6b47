"""The verbs every federated method shares: `plan_round`, `aggregate`, `payload`; and the hooks
a method may use: `check_run` (at preflight), `before_round` and `after_round` (the round loop).

A method decides who trains on what and how updates combine. It sees adapters as dicts of
numpy arrays (``"<module>.lora_A"`` of shape (r, in), ``"<module>.lora_B"`` of shape (out, r))
and never touches the model or the network.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig, coerce_value
from fedlora.errors import ConfigError, shown, suggest_key
from fedlora.federation.methods.ranks import resolve_ranks
from fedlora.system.client_profiles import ClientProfiles

Adapter = dict[str, np.ndarray]
LayerShapes = dict[str, tuple[int, int]]  # module name -> (out_features, in_features)


@dataclass(frozen=True)
class ClientTask:
    """What one participant does in a round.

    `scale` is the (γ,) rank scale vector of its slot: γ/k on a sketch's k indices (Eq. 3),
    or 1 on the first r_n components for a rank truncation; 0 elsewhere. `rank_used` is the
    number of non-zero entries (k_n or r_n): what the client computes on and uploads.
    """

    client: int
    scale: np.ndarray
    rank_used: int
    weight: float  # the aggregation weight of this participant (a_n/q_n for unbiased sampling)
    trains: str = "AB"  # the factors it trains (FFA-LoRA "B", RoLoRA "A"/"B", Fed-SB "R")
    steps: int = 0  # local steps of this task; 0 = training.local_steps (H)
    pooled: bool = False  # batches from the union of every client's data (centralized)


@dataclass(frozen=True)
class RoundPlan:
    round: int
    tasks: tuple[ClientTask, ...]

    @property
    def participants(self) -> list[int]:
        return [t.client for t in self.tasks]


@dataclass(frozen=True)
class Payload:
    """Parameters sent per participant in one round (exact counts, not approximations)."""

    uplink_params: int
    downlink_params: int


@dataclass
class Aggregation:
    """A method's aggregate: the next global adapter, and optionally a change to the frozen
    base weights (FedStackLoRA merges into the base: module name -> (out, in))."""

    global_state: Adapter
    base_delta: dict[str, np.ndarray] | None = None
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MethodContext:
    """What `Method.from_config` builds a method from.

    `a` (N,): the clients' data weights. `rng`: the run's "strategy" stream, which draws any
    random k / rank vector (so those are reproducible). `tau_full_s` (N,): the clients'
    compute times (``method.ranks = "capability"`` needs them: `make_method` passes them).
    `plan`: Algorithm 2's `proposed.Plan` of a `proposed` run, or None. `options`: the
    method's own options (`Method.read_options`; None for a method without any).
    """

    cfg: ExperimentConfig
    a: np.ndarray
    rng: np.random.Generator
    tau_full_s: np.ndarray | None = None
    plan: Any = None
    options: Any = None  # the method's `Method.options`, read from its [method.<name>] table

    @property
    def gamma(self) -> int:
        return self.cfg.lora.rank

    def ranks(self) -> np.ndarray:
        """The (N,) rank budgets of ``method.ranks`` (`fedlora.federation.methods.ranks`)."""
        m = self.cfg.method
        return resolve_ranks(
            m.ranks,
            n=self.a.size,
            gamma=self.gamma,
            rng=self.rng,
            tau_full_s=self.tau_full_s,
            rank_range=m.rank_range,
        )


@dataclass(frozen=True)
class RoundContext:
    """What a method's round hooks see of the run (built once by the round loop): its config,
    the clients' data weights `a` (N,), their profiles, the run directory (a method may write
    its own file there, e.g. `proposed`'s plan.json) and the run's log."""

    cfg: ExperimentConfig
    a: np.ndarray
    profiles: ClientProfiles
    run_dir: Path
    log: Callable[[str], Any]
    # (N, orders) the RDP every client has spent so far (`columns_rdp`), None without a
    # privacy budget's mechanism: an in-run plan keeps what is left of planner.max_epsilon
    privacy_rdp: Callable[[], np.ndarray | None] | None = None


def build_options(cls: type[Method], table: Mapping[str, Any]) -> Any:
    """`cls.options` built from the raw `table` (`Method.read_options`)."""
    where = f"method.{cls.name}"
    if cls.options is None:
        if table:
            raise ConfigError(
                f"[{where}] = {shown(dict(table))} is invalid: method {cls.name!r} has no "
                "options of its own; remove the table"
            )
        return None
    if not (isinstance(cls.options, type) and dataclasses.is_dataclass(cls.options)):
        raise TypeError(f"{cls.__qualname__}.options must be a dataclass, got {cls.options!r}")
    hints = typing.get_type_hints(cls.options)
    names = [f.name for f in dataclasses.fields(cls.options) if f.init]
    kwargs = {}
    for key, value in table.items():
        if key not in names:
            raise ConfigError(
                f"unknown key {where}.{key}{suggest_key(key, names)}: the options of "
                f"method {cls.name!r} are {', '.join(names) or 'none'}"
            )
        kwargs[key] = coerce_value(f"{where}.{key}", hints[key], value)
    return cls.options(**kwargs)


def options_table(options: Any) -> dict[str, Any]:
    """A method's built options as its ``[method.<name>]`` table: every field, defaults
    included (what a run records; `read_options` reads it back to equal options)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.init}


def active_indices(scale: np.ndarray) -> np.ndarray:
    """The rank components a task touches (non-zero entries of its scale vector)."""
    return np.flatnonzero(np.asarray(scale) != 0)


def sketch_payload_params(rank_used: int, shapes: LayerShapes) -> int:
    """Parameters of k rank components: k columns of every B (out) plus k rows of every A (in).

    The server chose the indices, so no index list is sent. k = γ gives the whole adapter.
    """
    return int(rank_used) * sum(out + inp for out, inp in shapes.values())


class Method:
    """Base class: subclasses implement `plan_round` and `aggregate`; `payload` defaults to
    the sketched accounting (a participant downloads and uploads its active components).

    A registered method (`fedlora.federation.methods.registry.register_method`) also gives
    `from_config` (how it is built from the run's config) and, if it has ``method.*`` fields
    of its own, `check_config`. `delta_aggregate` says whether its aggregate is the global
    adapter plus an update (X + Δ, with the clients starting from X): only then can a server
    optimizer (``method.server_optimizer``) take Δ as its pseudo-gradient. The class
    attributes below `delta_aggregate` are the method's other facts, which the privacy and
    Flower layers ask the class for (`dp_sampling`, `dp_refusal`, `normalised_weights`,
    `secagg_masked`, `flower_refusal`; the hooks `check_privacy` and `check_flower`).
    """

    name = "base"
    delta_aggregate = False
    # True: every learner's client-optimizer state is kept across its rounds whatever
    # training.optimizer_state (the references: one uninterrupted training per learner)
    keeps_optimizer_state = False
    # True: evaluation scores every client's own adapter (kept in the run's client memory) and
    # reports their mean and spread (`local`); False: the global adapter
    evaluates_clients = False
    # True: the round loop adds ``client_losses`` [[client, training loss], ...] (the trained
    # participants', whose mean is ``train_loss``) to each round's metrics line before
    # `after_round` sees it (`proposed` in-run with planner.fit_client_offsets)
    logs_client_losses = False
    # What the privacy and Flower layers ask of a method (they hold no list of method names;
    # `registry.check_method_config` and the Flower runtime read these). The defaults are the
    # safe ones: a method that declares nothing refuses differential privacy and secure
    # aggregation (saying that `dp_sampling` is not declared) and runs on Flower unmasked.
    #
    # How the method samples a round's participants when its aggregate is the global adapter
    # plus a weighted sum of the clients' updates, X + Σ w_n (X_n − X) — the only aggregate
    # whose sensitivity clipping bounds (docs/privacy.md), so the only one that
    # ``privacy.mode`` and ``privacy.secure_aggregation`` accept: "independent" (client n
    # joins with its own q_n: Poisson sampling), "uniform" (m of N without replacement,
    # m = 0: all N), or None (not such a sum: both are refused, giving `dp_refusal`)
    dp_sampling: str | None = None
    # why the method refuses differential privacy and secure aggregation (dp_sampling None);
    # "" = it does not say (the refusal names the undeclared `dp_sampling`)
    dp_refusal = ""
    # True: the aggregate divides the participants' weights by their sum over the round's
    # participants (a weighted mean: FedAvg's a_n / Σ_K a_j), so clipping and SecAgg+ apply
    # w_n / Σ w; False: the task weights as they are (a_n / q_n, 1/m)
    normalised_weights = False
    # True: under secure aggregation each node zero-pads its update to the rank components it
    # trained (`ClientTask.scale`, HeteroLoRA's truncated ranks) before masking it
    secagg_masked = False
    # why the method does not run on Flower ("" = it does; checked by the Flower runtime, with
    # `check_flower` for a refusal that depends on the config)
    flower_refusal = ""
    # The method's own options: a frozen dataclass (its fields with their defaults, checked
    # in its __post_init__, errors naming ``method.<name>.<field>``) read from the config's
    # table ``[method.<name>]`` by `read_options`; None: the method has none (a table for it
    # is refused)
    options: type | None = None
    server_opt: Any = None  # server_opt.ServerOptimizer, set by make_method (None: plain)
    privacy: Any = None  # a privacy_mechanisms PrivacyMechanism, set by make_method (None: no DP)

    @classmethod
    def read_options(cls, cfg: ExperimentConfig) -> Any:
        """This method's `options` built from ``cfg``'s table ``[method.<name>]`` (each value
        converted to its field's type, the dataclass's own checks run), or None for a method
        without options. ConfigError for a key the dataclass lacks or a bad value."""
        return build_options(cls, cfg.method.options.get(cls.name, {}))

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """Raise ConfigError (naming the field, the value, what is allowed) for a bad value of
        this method's own ``method.*`` fields. Called for every registered method, whichever
        ``method.name`` is, so a bad value never waits for the method to be chosen."""
        del cfg

    @classmethod
    def check_run(cls, cfg: ExperimentConfig) -> None:
        """Raise ConfigError for a config this method cannot run (a rule across sections,
        e.g. `proposed`'s lora.rank >= 2). Called at preflight, for the method that runs,
        before anything is created or replaced."""
        del cfg

    @classmethod
    def check_privacy(cls, cfg: ExperimentConfig) -> None:
        """Raise ConfigError for a privacy setting (``privacy.mode``,
        ``privacy.secure_aggregation``) this method cannot honour although its aggregate is a
        sum (`dp_sampling` set), e.g. HeteroLoRA's self-pruning. Called by
        `registry.check_method_config` for the method that runs, with privacy on."""
        del cfg

    @classmethod
    def check_flower(cls, cfg: ExperimentConfig) -> None:
        """Raise ConfigError for a config this method cannot run on Flower although it has no
        `flower_refusal` (e.g. `proposed` without a plan file). Called by the Flower runtime
        (`fedlora.federation.flower.common.check_flower_method`)."""
        del cfg

    @classmethod
    def from_config(cls, ctx: MethodContext) -> Method:
        """The method for ``ctx.cfg`` (see `registry.MethodContext`)."""
        raise NotImplementedError(f"{cls.__qualname__}.from_config")

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        raise NotImplementedError

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        raise NotImplementedError

    def server_step(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        """What the engine applies: `aggregate`, then the server optimizer on its update Δ
        (``method.server_optimizer``; a round without participants is no optimizer step).
        With ``privacy.mode`` set, the updates are clipped before and the noise added after
        `aggregate`, before the optimizer (`fedlora.federation.privacy`)."""
        if self.privacy is not None:
            client_states = self.privacy.clip(global_state, plan, client_states)
        agg = self.aggregate(global_state, plan, client_states)
        if self.privacy is not None:
            agg.global_state = self.privacy.noise(global_state, agg.global_state, plan)
        if self.server_opt is not None and plan.tasks:
            agg.global_state = self.server_opt.step(global_state, agg.global_state)
        return agg

    def participation(self) -> np.ndarray | None:
        """Each client's probability of taking part in a round, (N,) (the references take
        their budget from it: `method.budget_of`); None where it is not fixed in advance."""
        return None

    def before_round(self, ctx: RoundContext, round_index: int) -> None:
        """Called by the round loop before round `round_index` is planned (most methods:
        nothing; `proposed` with in-run calibration sets the round's q and k)."""
        del ctx, round_index

    def after_round(self, ctx: RoundContext, round_index: int, line: dict[str, Any]) -> None:
        """Called by the round loop once round `round_index` is done, with its metrics line
        before it is written (a method may add its own keys; `proposed` its fits and plans)."""
        del ctx, round_index, line

    def payload(self, task: ClientTask, shapes: LayerShapes, plan: RoundPlan) -> Payload:
        params = sketch_payload_params(task.rank_used, shapes)
        return Payload(uplink_params=params, downlink_params=params)

    def initial_state(self, global_state: Adapter) -> Adapter:
        """The global adapter the run starts from, given the model's seeded LoRA init (most
        methods: unchanged; Fed-SB adds its frozen factors and R). Called once per run."""
        return global_state

    def is_local(self, name: str) -> bool:
        """True for adapter tensors a client keeps for itself across rounds and never uploads
        (FedSA-LoRA: every ``lora_B``). Most methods: none."""
        del name
        return False

    def state_dict(self) -> dict:
        """Anything the method must carry across a checkpoint (most methods: nothing)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state
