"""The federated training data: the training mix, its Dirichlet partition over the clients,
each client's batches, and the eval sets.

    fed = build_federated_data(cfg.data, tokenizer, seed=0)
    batches = client_batches(fed, client=3, steps=10, batch_size=4, rng=rng, pad_id=0)

The partition over the clients (Dirichlet(α) over a key, or one client per value) and the
aggregation weights a_n = |D_n| / |D| are `fedlora.llm.partition`'s.

The examples come from `fedlora.llm.tasks`, their tokens from `fedlora.llm.prompts`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora.config.eval_format import EvalFormat
from fedlora.config.sections import parse_eval_exclude
from fedlora.errors import ConfigError, DataError
from fedlora.llm.harness import tokenize_harness
from fedlora.llm.instruct import load_instructions, set_chat_template, tokenize_instructions
from fedlora.llm.partition import (
    client_weights,
    dirichlet_partition,
    partition_keys,
    per_value_partition,
)
from fedlora.llm.prompts import TokenizedSet, collate, tokenize_examples
from fedlora.llm.tasks import (
    Example,
    check_task,
    load_task,
    load_task_file,
    resolve_data_dir,
    task_available,
)
from fedlora.llm.user_tasks import load_mc_files

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from fedlora.config.sections import DataConfig

# ----------------------------------------------------------------------------- mixes


def stream_rng(seed: int, *keys: str | int) -> np.random.Generator:
    """An independent, reproducible stream per (seed, purpose, ...)."""
    words = [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in keys]
    return np.random.default_rng([seed, *words])


def seeded_subset(examples: list[Example], limit: int, rng: np.random.Generator) -> list[Example]:
    """`limit` examples drawn without replacement, in their original order (0 = all)."""
    return [examples[i] for i in _subset_indices(len(examples), limit, rng)]


def training_mix(cfg: DataConfig, seed: int) -> list[Example]:
    """The training mix: the train split of each of `cfg.tasks` that is present (tasks without
    a train split are skipped, e.g. siqa here) plus every `cfg.task_files` file, each cut to a
    seeded subset of `cfg.train_limit` examples."""
    data_dir = resolve_data_dir(cfg.data_dir)
    mix: list[Example] = []
    skipped = []
    for task in cfg.tasks:
        check_task(task)
        if not task_available(task, data_dir, "train"):
            skipped.append(task)
            continue
        exs = load_task(task, data_dir, "train")
        mix.extend(seeded_subset(exs, cfg.train_limit, stream_rng(seed, "train", task)))
    for path in cfg.task_files:
        exs = load_task_file(path)
        mix.extend(seeded_subset(exs, cfg.train_limit, stream_rng(seed, "train", path)))
    if cfg.mc.files:
        exs = load_mc_files(cfg.mc.files, cfg.mc)
        mix.extend(seeded_subset(exs, cfg.train_limit, stream_rng(seed, "train", cfg.mc.task)))
    if not mix and not cfg.instruct_files:
        raise DataError(
            f"data.tasks = {list(cfg.tasks)!r}: none has a train split in {data_dir!r} "
            f"(skipped: {', '.join(skipped)}) and data.task_files and data.mc.files are empty"
        )
    return mix


def training_records(cfg: DataConfig, seed: int) -> list[Any]:
    """The training set's records before tokenizing: the multiple-choice mix plus the
    instruction records, each cut to `cfg.train_limit` as `build_federated_data` cuts them
    (records too long for `cfg.max_seq_len` are dropped only later)."""
    records: list[Any] = training_mix(cfg, seed)
    if cfg.instruct_files:
        recs = load_instructions(cfg.instruct_files, cfg.instruct_task)
        records += seeded_subset(
            recs, cfg.train_limit, stream_rng(seed, "train", cfg.instruct_task)
        )
    return records


def own_eval_sets(cfg: DataConfig, seed: int) -> dict[str, list[Example]]:
    """The user's multiple-choice eval set (`cfg.mc.eval_files`) as task `cfg.mc.task`: a
    subset of `cfg.eval_limit` questions (0 = all) drawn as `load_eval_sets` draws (with
    `cfg.eval_seed`); empty without such files."""
    mc = cfg.mc
    if not mc.eval_files:
        return {}
    exs = load_mc_files(mc.eval_files, mc)
    eval_seed = seed if cfg.eval_seed < 0 else cfg.eval_seed
    return {mc.task: eval_questions(exs, mc.task, cfg.eval_limit, eval_seed)}


# ----------------------------------------------------------------------------- federated


@dataclass
class FederatedData:
    """The tokenized training mix, its partition over clients and the evaluation sets."""

    train: TokenizedSet
    examples: list[Example]
    client_indices: list[np.ndarray]
    a: np.ndarray  # a_n = |D_n| / |D|
    eval_sets: dict[str, list[Example]]
    lengths: Any = None  # harness: its `LengthReport` (p50/p99 tokens, examples dropped)
    # held-out instruction records per task (`fedlora.llm.instruct.response_loss` scores them)
    instruct_eval: dict[str, list[Any]] = field(default_factory=dict)


def eval_questions(
    examples: list[Example],
    task: str,
    limit: int,
    seed: int,
    exclude_seeds: Sequence[int] = (),
    names: tuple[str, str] = ("data.eval_exclude", "data.eval_limit"),
) -> list[Example]:
    """The evaluation questions of one task: a seeded subset of `limit` (0 = all) drawn with
    the stream (seed, "eval", task) from the test split, after leaving out every question
    that the subset of the same `limit` for each seed in `exclude_seeds` draws. With no
    exclusions this is exactly the subset earlier versions drew. `names`: what an error calls
    the exclusions and the limit (the config's keys; `fedlora eval`'s flags)."""
    pool = list(range(len(examples)))
    if exclude_seeds:
        dropped: set[int] = set()
        for s in exclude_seeds:
            dropped.update(_subset_indices(len(examples), limit, stream_rng(s, "eval", task)))
        pool = [i for i in pool if i not in dropped]
        if not pool or len(pool) < limit:
            excluded = [f"{task}:{s}" for s in exclude_seeds]
            if names[0].startswith("--"):
                excluded = [str(s) for s in exclude_seeds]
            raise ConfigError(
                f"{names[0]} = {', '.join(excluded)} leaves {len(pool)} of the "
                f"{len(examples)} {task} test questions: fewer than {names[1]} = {limit}; "
                "exclude fewer subsets or lower the limit"
            )
    keep = _subset_indices(len(pool), limit, stream_rng(seed, "eval", task))
    return [examples[pool[i]] for i in keep]


def _subset_indices(n: int, limit: int, rng: np.random.Generator) -> list[int]:
    """The positions `seeded_subset` keeps of n items (the same draws), in order."""
    if limit <= 0 or limit >= n:
        return list(range(n))
    return np.sort(rng.choice(n, size=limit, replace=False)).tolist()


def load_eval_sets(cfg: DataConfig, seed: int) -> dict[str, list[Example]]:
    """Each eval task's questions (`eval_questions`): a subset of `cfg.eval_limit` of its test
    split, drawn with `cfg.eval_seed` (-1: the training `seed`), leaving out the subsets
    `cfg.eval_exclude` names."""
    data_dir = resolve_data_dir(cfg.data_dir)
    eval_seed = seed if cfg.eval_seed < 0 else cfg.eval_seed
    excluded = [parse_eval_exclude(e) for e in cfg.eval_exclude]
    return {
        task: eval_questions(
            load_task(task, data_dir, "test"),
            task,
            cfg.eval_limit,
            eval_seed,
            [s for t, s in excluded if t == task],
        )
        for task in cfg.eval_tasks
    }


def build_federated_data(
    cfg: DataConfig, tokenizer: Any, seed: int, fmt: str | EvalFormat = EvalFormat.LLM_ADAPTERS
) -> FederatedData:
    """Training mix -> tokens -> Dirichlet partition over `cfg.n_clients`; plus eval sets.

    `fmt` (evaluation.format, resolved): ``llm-adapters`` trains on the LLM-Adapters prompt
    and `cfg.response` (prompts cut from the left to `cfg.max_seq_len`); ``harness`` on the
    task's lm-eval context and correct continuation, dropping (never cutting) examples
    longer than `cfg.max_seq_len` (`fedlora.llm.harness.tokenize_harness`)."""
    fmt = EvalFormat(fmt).concrete()  # the run's own copy: cfg.evaluation.format
    examples: list[Any] = training_mix(cfg, seed)
    lengths = None
    if fmt.harness:
        train, kept, lengths = tokenize_harness(examples, tokenizer, cfg.max_seq_len)
        examples = [examples[i] for i in kept]
        if not examples and not cfg.instruct_files:
            raise DataError(
                f"data.max_seq_len = {cfg.max_seq_len}: every training example is longer "
                f"({lengths.describe()})"
            )
    else:
        train = tokenize_examples(examples, tokenizer, cfg.max_seq_len, cfg.response)
    instruct_eval = {}
    if cfg.instruct_files or cfg.instruct_eval_files:
        set_chat_template(tokenizer, cfg.chat_template)
    if cfg.instruct_files:
        recs = load_instructions(cfg.instruct_files, cfg.instruct_task)
        recs = seeded_subset(recs, cfg.train_limit, stream_rng(seed, "train", cfg.instruct_task))
        its, kept = tokenize_instructions(recs, tokenizer, cfg.max_seq_len)
        if not kept:
            raise DataError(
                f"data.instruct_files: no record fits data.max_seq_len = {cfg.max_seq_len} tokens"
            )
        train = TokenizedSet(train.input_ids + its.input_ids, train.labels + its.labels, train.cut)
        examples += [recs[i] for i in kept]
    if cfg.instruct_eval_files:
        recs = load_instructions(cfg.instruct_eval_files, cfg.instruct_task)
        rng = stream_rng(seed, "eval", cfg.instruct_task)
        instruct_eval = {cfg.instruct_task: seeded_subset(recs, cfg.eval_limit, rng)}
    keys = partition_keys(examples, cfg.partition_key)
    if cfg.partition_mode == "per_value":
        clients = per_value_partition(keys, cfg.n_clients)
    else:
        clients = dirichlet_partition(
            keys,
            cfg.n_clients,
            cfg.dirichlet_alpha,
            cfg.min_client_examples,
            stream_rng(seed, "partition"),
        )
    return FederatedData(
        train,
        examples,
        clients,
        client_weights(clients),
        {**load_eval_sets(cfg, seed), **own_eval_sets(cfg, seed)},
        lengths=lengths,
        instruct_eval=instruct_eval,
    )


def client_batches(
    fed: FederatedData,
    client: int,
    steps: int,
    batch_size: int,
    rng: np.random.Generator,
    pad_id: int,
    *,
    pooled: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """`steps` batches of `batch_size` from one client's data (`pooled`: from the union of
    every client's data, in record order): shuffled epochs, concatenated (so no example
    repeats before all were seen)."""
    if not 0 <= client < len(fed.client_indices):
        raise DataError(
            f"client = {client!r} is invalid: must be in 0..{len(fed.client_indices) - 1}"
        )
    if steps < 1 or batch_size < 1:
        raise DataError(f"steps = {steps!r}, batch_size = {batch_size!r}: both must be >= 1")
    own = np.sort(np.concatenate(fed.client_indices)) if pooled else fed.client_indices[client]
    if len(own) == 0:
        raise DataError(f"client {client} holds no examples")
    need = steps * batch_size
    stream = np.concatenate([own[rng.permutation(len(own))] for _ in range(-(-need // len(own)))])
    return [
        collate(fed.train, stream[s * batch_size : (s + 1) * batch_size].tolist(), pad_id)
        for s in range(steps)
    ]
