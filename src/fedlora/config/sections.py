"""The sections of an experiment config: one frozen dataclass each, with its defaults and
the checks of every field in ``__post_init__`` (`fedlora.config.checks`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Union

from fedlora.config.checks import (
    check_choice,
    check_device_spec,
    check_int,
    check_number,
    check_snr_range,
    check_vector_or_strategy,
)
from fedlora.config.data_mc import McConfig
from fedlora.config.eval_format import EvalFormat
from fedlora.config.method_options import FrozenTable, check_option_tables
from fedlora.errors import bad_value


@dataclass(frozen=True)
class ModelConfig:
    """The frozen base model. `name`: a hub id, a local directory, `smollm2-135m`, or
    `tiny-llama` / `tiny-qwen2` (random-init test models)."""

    name: str = "smollm2-135m"
    # auto | fp32 | bf16. auto: bf16 on a CUDA GPU; on a CPU bf16 only with native bf16
    # (avx512_bf16/amx_bf16) and a probe measuring it faster; else fp32 (fedlora.llm.device)
    dtype: str = "auto"
    device: str = "auto"  # auto (cuda, else mps, else cpu) | cpu | cuda | cuda:N | mps
    threads: int = 0  # torch threads; 0 = torch's default
    cache_dir: str = ""  # where converted models are kept; "" = ~/.cache/fedlora
    # with lora.layers = K: the frozen layers' hidden states on disk under the cache dir,
    # shared by every run and evaluation of the same model and tokens (MB bound; 0 = off)
    disk_cache_mb: float = 4096.0
    # written by the run when dtype = auto: the timed choice ("" otherwise; not an input)
    dtype_choice: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise bad_value("model.name", self.name, "a non-empty model spec")
        check_choice("model.dtype", self.dtype, ("auto", "fp32", "bf16"))
        check_device_spec("model.device", self.device)
        check_int("model.threads", self.threads, lo=0)
        check_number("model.disk_cache_mb", self.disk_cache_mb, lo=0)
        if not isinstance(self.dtype_choice, str):
            raise bad_value("model.dtype_choice", self.dtype_choice, "a string")


@dataclass(frozen=True)
class LoraConfig:
    """The global adapter: rank γ on `target_modules` of all layers or the top K."""

    rank: int = 16  # γ
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    layers: Union[str, int] = 8  # "all" or K (the top K layers)  # noqa: UP007
    rslora: bool = False  # rank-stabilised LoRA: scaling α/√r instead of α/r (PEFT use_rslora)

    @property
    def scaling(self) -> float:
        """The adapter's forward factor: α/r, or α/√r with rsLoRA (PEFT's semantics)."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    def __post_init__(self) -> None:
        check_int("lora.rank", self.rank, lo=1)
        if not isinstance(self.rslora, bool):
            raise bad_value("lora.rslora", self.rslora, "true or false")
        check_number("lora.alpha", self.alpha, lo=0, lo_open=True)
        check_number("lora.dropout", self.dropout, lo=0, hi=1, hi_open=True)
        if not self.target_modules or not all(
            isinstance(m, str) and m for m in self.target_modules
        ):
            raise bad_value("lora.target_modules", self.target_modules, "a non-empty list of names")
        if isinstance(self.layers, str):
            if self.layers != "all":
                raise bad_value("lora.layers", self.layers, '"all" or a positive integer K')
        else:
            check_int("lora.layers", self.layers, lo=1)


RESPONSES = ("label", "option")


def parse_eval_exclude(entry: object) -> tuple[str, int]:
    """One `data.eval_exclude` entry, "TASK:SEED", as (task, seed)."""
    task, sep, seed = entry.rpartition(":") if isinstance(entry, str) else ("", "", "")
    if not sep or not task or not seed.isdigit():
        raise bad_value("data.eval_exclude", entry, '"TASK:SEED" entries, e.g. "arc-e:0"')
    return task, int(seed)


@dataclass(frozen=True)
class DataConfig:
    """Tasks, the federated partition and the evaluation subset."""

    data_dir: str = ""  # LLM-Adapters layout; "" = $FEDLORA_DATA, else the hub
    tasks: tuple[str, ...] = (
        "arc-e",
        "arc-c",
        "obqa",
    )  # training mix (add "boolq" for the full offline mix)
    task_files: tuple[str, ...] = ()  # extra LLM-Adapters JSON files for training
    eval_tasks: tuple[str, ...] = ("arc-e",)
    eval_limit: int = 500  # examples per eval task (seeded subset); 0 = whole test set
    # the stream that draws the evaluation questions: -1 = training.seed (so another training
    # seed also draws other questions); >= 0 fixes the questions whatever the training seed
    eval_seed: int = -1
    # "TASK:SEED": leave out the questions the seed-SEED subset of eval_limit draws from TASK
    # (fresh questions: disjoint from those an earlier study was judged on)
    eval_exclude: tuple[str, ...] = ()
    train_limit: int = 0  # examples per training task (seeded subset); 0 = all
    max_seq_len: int = 128
    n_clients: int = 20  # N
    # task | label | any field of the records (your own data's columns, a "user" field, ...)
    partition_key: str = "task"
    partition_mode: str = "dirichlet"  # dirichlet over the key's values | per_value: a client each
    dirichlet_alpha: float = 0.1
    min_client_examples: int = 8
    # what the training response names after "the correct answer is ": the label ("answer2",
    # the paper's LLM-Adapters target) or the option's text (matches evaluation.scoring option*)
    response: str = "option"
    # your own multiple-choice questions and the field map they are read through: the
    # [data.mc] table (fedlora.config.data_mc; docs/data.md "Your own data")
    mc: McConfig = field(default_factory=McConfig)
    # instruction records (Alpaca instruction/input/output or chat messages; .json, .jsonl):
    # trained on, response tokens only (instruct_files); held out (instruct_eval_files);
    # chat_template: a Jinja file for a tokenizer without one ("" = the tokenizer's own)
    instruct_files: tuple[str, ...] = ()
    instruct_eval_files: tuple[str, ...] = ()
    instruct_task: str = "instruct"
    chat_template: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.mc, McConfig):
            raise bad_value("data.mc", self.mc, "a [data.mc] table (fedlora.config.McConfig)")
        if not (self.tasks or self.task_files or self.mc.files or self.instruct_files):
            raise bad_value("data.tasks", self.tasks, "at least one task or task file")
        if not isinstance(self.instruct_task, str) or not self.instruct_task:
            raise bad_value("data.instruct_task", self.instruct_task, "a non-empty field name")
        for name in ("tasks", "eval_tasks"):
            value = getattr(self, name)
            if len(set(value)) != len(value):
                raise bad_value(f"data.{name}", list(value), "each task at most once")
        check_int("data.eval_limit", self.eval_limit, lo=0)
        check_int("data.eval_seed", self.eval_seed, lo=-1)
        for entry in self.eval_exclude:
            if parse_eval_exclude(entry)[0] not in self.eval_tasks:
                raise bad_value(
                    "data.eval_exclude", entry, f"a task of data.eval_tasks {list(self.eval_tasks)}"
                )
        check_int("data.train_limit", self.train_limit, lo=0)
        check_int("data.max_seq_len", self.max_seq_len, lo=16)
        check_int("data.n_clients", self.n_clients, lo=1)
        if not isinstance(self.partition_key, str) or not self.partition_key.strip():
            raise bad_value("data.partition_key", self.partition_key, "task, label or a field name")
        check_choice("data.partition_mode", self.partition_mode, ("dirichlet", "per_value"))
        check_number("data.dirichlet_alpha", self.dirichlet_alpha, lo=0, lo_open=True)
        check_int("data.min_client_examples", self.min_client_examples, lo=1)
        check_choice("data.response", self.response, RESPONSES)


@dataclass(frozen=True)
class NetworkConfig:
    """Client compute, wireless channel (paper §IV) and cost models (docs/paper.md, rows 4–6).

    Profiles come from `profiles_file` (CSV or JSON, one row per client with `tau_full_s`,
    `t_full`) or are generated: lognormal per-step compute times and a path-loss channel.
    """

    profiles_file: str = ""
    f_tot_hz: float = 20e6  # total uplink band shared by the sampled clients
    step_time_median_s: float = 0.2  # local SGD step at k = γ, median over clients
    step_time_sigma: float = 0.5  # lognormal σ of the per-client step time
    distance_min_m: float = 20.0
    distance_max_m: float = 200.0
    path_loss_exponent: float = 3.5
    path_loss_ref_db: float = 38.0  # path loss at 1 m
    tx_power_dbm: float = 20.0
    noise_psd_dbm_hz: float = -174.0
    fading: str = "none"  # none | rayleigh (block fading, redrawn every round)
    # outage floor on the Rayleigh gain |h|² (a deeper fade is served at the floor's rate);
    # 0 = none: the mean upload time is then infinite (docs/network.md)
    fading_floor: float = 0.0
    bits_per_param: int = 16  # what one uploaded parameter costs on the air
    comm_cost: str = "exact"  # exact (bits actually sent) | linear | quadratic (paper)
    comp_cost: str = "affine"  # affine | linear | quadratic (paper)
    rho: float = 0.9  # affine compute: share of the step that does not shrink with k
    downlink_rate_bps: float = 0.0  # broadcast rate; 0 = downlink is free (paper)

    def __post_init__(self) -> None:
        check_number("network.f_tot_hz", self.f_tot_hz, lo=0, lo_open=True)
        check_number(
            "network.step_time_median_s", self.step_time_median_s, lo=0, hi=1e9, lo_open=True
        )
        check_number("network.step_time_sigma", self.step_time_sigma, lo=0, hi=10)
        check_number("network.distance_min_m", self.distance_min_m, lo=0, lo_open=True)
        check_number("network.distance_max_m", self.distance_max_m, lo=self.distance_min_m, hi=1e9)
        check_number("network.path_loss_exponent", self.path_loss_exponent, lo=0, hi=10)
        check_number("network.path_loss_ref_db", self.path_loss_ref_db, lo=-100, hi=300)
        check_number("network.tx_power_dbm", self.tx_power_dbm, lo=-100, hi=100)
        check_number("network.noise_psd_dbm_hz", self.noise_psd_dbm_hz, lo=-300, hi=0)
        if not self.profiles_file:  # the generated channel: finite, non-zero upload times
            check_snr_range(
                self.tx_power_dbm,
                self.noise_psd_dbm_hz + 10.0 * math.log10(self.f_tot_hz),
                self.path_loss_ref_db,
                self.path_loss_exponent,
                (self.distance_min_m, self.distance_max_m),
            )
        check_choice("network.fading", self.fading, ("none", "rayleigh"))
        check_number("network.fading_floor", self.fading_floor, lo=0)
        check_int("network.bits_per_param", self.bits_per_param, lo=1, hi=64)
        check_choice("network.comm_cost", self.comm_cost, ("exact", "linear", "quadratic"))
        check_choice("network.comp_cost", self.comp_cost, ("affine", "linear", "quadratic"))
        check_number("network.rho", self.rho, lo=0, hi=1)
        check_number("network.downlink_rate_bps", self.downlink_rate_bps, lo=0)


Q_STRATEGIES = ("full", "fixed", "uniform", "weighted")
K_STRATEGIES = ("full", "normal", "uniform")
SERVER_OPTIMIZERS = ("avg", "avgm", "adam", "yogi", "adagrad")  # method.server_optimizer
# method.server_lr's bound: a larger server step overflows or diverges the adapter at once
MAX_SERVER_LR = 1000.0
# the FSLoRA authors' `generate_ranks` distributions on method.rank_range (docs/methods.md)
REFERENCE_RANK_STRATEGIES = ("fslora_uniform", "fslora_normal", "fslora_heavy_tail_low")
# method.ranks (fedlora.federation.methods.ranks)
RANK_STRATEGIES = ("capability", *K_STRATEGIES, *REFERENCE_RANK_STRATEGIES)


@dataclass(frozen=True)
class MethodConfig:
    """The federated method and its per-client sampling probabilities q and sketch sizes k.

    The methods live in `fedlora.federation.methods` (a registry this layer cannot see):
    ``name`` is checked there, by `check_method_config`, before a config becomes a run, and
    so are a method's own options, which it reads from its table ``[method.<name>]``: kept
    here as given, in `options` (table name -> {key: value}; `fedlora.config.method_options`)."""

    name: str = "sketched"  # a registered method (fedlora.federation.methods.method_names())
    q: Union[str, tuple[float, ...]] = "fixed"  # noqa: UP007
    q_fixed: float = 0.2  # the value of the "fixed" strategy
    k: Union[str, tuple[int, ...]] = "uniform"  # noqa: UP007
    clients_per_round: int = 0  # uniform sampling without replacement (fedavg/baselines); 0 = all
    # the clients' rank budgets r_n, for the methods that have them (docs/methods.md):
    # "capability" (from each device's compute time), a k strategy, a .json/.csv file, a list
    ranks: Union[str, tuple[int, ...]] = "capability"  # noqa: UP007
    # [a, b] of the fslora_* rank strategies (the authors' lora_r_min, lora_r_max); [] = [1, γ]
    rank_range: tuple[int, ...] = ()
    # The server optimizer on the aggregated update Δ (a pseudo-gradient; Reddi et al. 2021,
    # docs/methods.md "Server optimizers"), for the methods whose aggregate is X + Δ
    server_optimizer: str = "avg"  # avg | avgm | adam | yogi | adagrad
    server_lr: float = 1.0  # η (avg with η = 1: the method's own aggregate)
    server_momentum: float = 0.9  # avgm: μ
    server_betas: tuple[float, ...] = (0.9, 0.99)  # adam, yogi, adagrad: (β1, β2)
    server_eps: float = 1e-3  # adam, yogi, adagrad: τ (the adaptivity)
    server_bias_correction: bool = False  # adam, yogi: divide m, v by 1 − β^t (torch's Adam)
    server_weight_decay: float = 0.0  # decoupled decay λ: X ← (1 − ηλ) X (torch's AdamW)
    # the references (method.name = centralized | local): the federated method whose expected
    # participation per round sets their budget of client-steps (docs/methods.md, "References")
    budget_of: str = "sketched"
    # the methods' own options, [method.<name>] tables: read and checked by the method's class
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=FrozenTable)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise bad_value("method.name", self.name, "a method name (fedlora.federation.methods)")
        keys = tuple(f.name for f in fields(self))
        object.__setattr__(self, "options", check_option_tables(self.options, keys))
        check_vector_or_strategy("method.q", self.q, Q_STRATEGIES, integer=False)
        check_number("method.q_fixed", self.q_fixed, lo=0, hi=1, lo_open=True)
        check_vector_or_strategy("method.k", self.k, K_STRATEGIES, integer=True)
        check_int("method.clients_per_round", self.clients_per_round, lo=0)
        check_vector_or_strategy("method.ranks", self.ranks, RANK_STRATEGIES, integer=True)
        if self.rank_range:
            if len(self.rank_range) != 2:
                raise bad_value("method.rank_range", self.rank_range, "[] or two integers [a, b]")
            check_int("method.rank_range[0]", self.rank_range[0], lo=1)
            check_int("method.rank_range[1]", self.rank_range[1], lo=self.rank_range[0])
        check_choice("method.server_optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        check_number("method.server_lr", self.server_lr, lo=0, hi=MAX_SERVER_LR, lo_open=True)
        check_number("method.server_momentum", self.server_momentum, lo=0, hi=1, hi_open=True)
        if len(self.server_betas) != 2:
            raise bad_value("method.server_betas", self.server_betas, "two numbers [β1, β2]")
        for i, beta in enumerate(self.server_betas):
            check_number(f"method.server_betas[{i}]", beta, lo=0, hi=1, hi_open=True)
        check_number("method.server_eps", self.server_eps, lo=0, lo_open=True)
        if not isinstance(self.server_bias_correction, bool):
            raise bad_value(
                "method.server_bias_correction", self.server_bias_correction, "true or false"
            )
        check_number("method.server_weight_decay", self.server_weight_decay, lo=0)
        if not isinstance(self.budget_of, str) or not self.budget_of.isidentifier():
            raise bad_value("method.budget_of", self.budget_of, "a method name")
        if self.server_lr * self.server_weight_decay > 1:  # X <- (1 - ηλ) X flips X's sign
            raise bad_value(
                "method.server_weight_decay",
                self.server_weight_decay,
                f"server_lr × server_weight_decay must be <= 1 (the decay factor 1 - ηλ "
                f">= 0); with server_lr = {self.server_lr}: at most {1 / self.server_lr:.6g}",
            )


# output.trackers: names of fedlora.federation.tracking's table (checked there, by
# check_trackers, as method.name by the method registry); these ship with fedlora
TRACKERS = "tensorboard, mlflow"


@dataclass(frozen=True)
class OutputConfig:
    """Where a run writes: ``<dir>/<name>/``."""

    dir: str = "runs"
    name: str = ""  # "" = "<method>-seed<seed>"
    progress: bool = True
    # experiment trackers fed every metrics line (fedlora.federation.tracking; extra `tracking`)
    trackers: tuple[str, ...] = ()  # of TRACKERS
    mlflow_uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else sqlite:///<run dir>/mlflow.db

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise bad_value("output.dir", self.dir, "a non-empty path")
        for i, name in enumerate(self.trackers):  # the names: fedlora.federation.tracking
            if not isinstance(name, str) or not name.isidentifier():
                raise bad_value(f"output.trackers[{i}]", name, f"a tracker name ({TRACKERS})")
        if not isinstance(self.mlflow_uri, str):
            raise bad_value("output.mlflow_uri", self.mlflow_uri, "a tracking URI string")
        if len(set(self.trackers)) != len(self.trackers):
            raise bad_value("output.trackers", list(self.trackers), "each tracker at most once")
        name = self.name if isinstance(self.name, str) else "/"
        if name.startswith("/") or ".." in name.replace("\\", "/").split("/"):
            raise bad_value("output.name", self.name, "a relative name inside output.dir")


SCORINGS = ("label", "option", "option_norm")
# evaluation.format: auto = harness below HARNESS_MAX_PARAMS parameters, else llm-adapters
EVAL_FORMATS = EvalFormat.NAMES


@dataclass(frozen=True)
class EvaluationConfig:
    """How the global adapter is scored on the eval sets (fedlora.llm.evaluation)."""

    # label: log-likelihood of the answer label (the paper's protocol for large models);
    # option: of the option text; option_norm: of the option text per character (acc_norm)
    scoring: str = "option_norm"
    # harness: lm-evaluation-harness's zero-shot contexts and continuations (acc primary,
    # acc_norm beside it), and training in the same format; llm-adapters: the paper's
    # LLM-Adapters prompt with `scoring`; auto: harness for models below 3B parameters
    format: str = EvalFormat.AUTO  # an `EvalFormat` once built
    batch_size: int = 16  # questions (with all their candidates) per forward pass
    predictions: bool = True  # write every question's prediction to predictions.jsonl
    # with lora.layers = K: memory bound (MB) of the eval set's frozen-layer cache; 0 = off
    cache_mb: float = 1024.0

    def __post_init__(self) -> None:
        check_choice("evaluation.scoring", self.scoring, SCORINGS)
        # parsed here, once: every later reader gets an `EvalFormat` (frozen: set directly)
        object.__setattr__(self, "format", EvalFormat(self.format))
        check_int("evaluation.batch_size", self.batch_size, lo=1)
        check_number("evaluation.cache_mb", self.cache_mb, lo=0)
        if not isinstance(self.predictions, bool):
            raise bad_value("evaluation.predictions", self.predictions, "true or false")
