"""The federated training data: the training mix, its Dirichlet partition over the clients,
each client's batches, and the eval sets.

    fed = build_federated_data(cfg.data, tokenizer, seed=0)
    batches = client_batches(fed, client=3, steps=10, batch_size=4, rng=rng, pad_id=0)

The partition is Dirichlet(α) over a key (the task, or the answer label) across N clients, as
flwr-datasets' `DirichletPartitioner`: for each key value, a share vector p ~ Dir(α·1_N)
splits that key's examples over the clients. Minimum-size policy: *redistribute* (never
resample): while a client holds fewer than ``min_size`` examples it takes random examples
from the currently largest client. The aggregation weights are a_n = |D_n| / |D|.

The examples come from `fedlora.llm.tasks`, their tokens from `fedlora.llm.prompts`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora.config.sections import parse_eval_exclude
from fedlora.errors import ConfigError, DataError
from fedlora.llm.harness import EvalFormat, tokenize_harness
from fedlora.llm.instruct import load_instructions, set_chat_template, tokenize_instructions
from fedlora.llm.prompts import TokenizedSet, collate, tokenize_examples
from fedlora.llm.tasks import (
    Example,
    check_task,
    load_task,
    load_task_file,
    resolve_data_dir,
    task_available,
)
from fedlora.llm.user_tasks import FieldMap, load_mc_files

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
    if cfg.mc_files:
        exs = load_mc_files(cfg.mc_files, FieldMap.of(cfg), cfg.mc_task)
        mix.extend(seeded_subset(exs, cfg.train_limit, stream_rng(seed, "train", cfg.mc_task)))
    if not mix and not cfg.instruct_files:
        raise DataError(
            f"data.tasks = {list(cfg.tasks)!r}: none has a train split in {data_dir!r} "
            f"(skipped: {', '.join(skipped)}) and data.task_files and data.mc_files are empty"
        )
    return mix


def training_records(cfg: DataConfig, seed: int) -> int:
    """How many records the training set holds before tokenizing: the multiple-choice mix plus
    the instruction records, each cut to `cfg.train_limit` as `build_federated_data` cuts them
    (records too long for `cfg.max_seq_len` are dropped only later)."""
    n = len(training_mix(cfg, seed))
    if cfg.instruct_files:
        records = len(load_instructions(cfg.instruct_files, cfg.instruct_task))
        n += min(records, cfg.train_limit) if cfg.train_limit else records
    return n


def own_eval_sets(cfg: DataConfig, seed: int) -> dict[str, list[Example]]:
    """The user's multiple-choice eval set (`cfg.mc_eval_files`) as task `cfg.mc_task`: a
    subset of `cfg.eval_limit` questions (0 = all) drawn as `load_eval_sets` draws (with
    `cfg.eval_seed`); empty without such files."""
    if not cfg.mc_eval_files:
        return {}
    exs = load_mc_files(cfg.mc_eval_files, FieldMap.of(cfg), cfg.mc_task)
    eval_seed = seed if cfg.eval_seed < 0 else cfg.eval_seed
    return {cfg.mc_task: eval_questions(exs, cfg.mc_task, cfg.eval_limit, eval_seed)}


# ----------------------------------------------------------------------------- partition


def dirichlet_partition(
    keys: Sequence[str],
    n_clients: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Split example indices over `n_clients` by Dirichlet(α) over `keys`.

    For each distinct key, p ~ Dir(α·1_N) and that key's (shuffled) examples are cut into N
    consecutive pieces of sizes ⌊cumsum(p)·m⌋. Then, while a client has fewer than `min_size`
    examples, it takes random examples from the currently largest client (redistribution,
    so it always terminates and keeps each client's dominant key). Returns sorted int64
    index arrays, one per client, that together cover every index exactly once.
    """
    n = len(keys)
    if n_clients < 1:
        raise DataError(f"n_clients = {n_clients!r} is invalid: must be >= 1")
    if not alpha > 0:
        raise DataError(f"alpha = {alpha!r} is invalid: must be > 0")
    if min_size < 0:
        raise DataError(f"min_size = {min_size!r} is invalid: must be >= 0")
    if n < n_clients * min_size:
        raise DataError(
            f"n_clients = {n_clients} with min_size = {min_size} needs >= {n_clients * min_size} "
            f"examples, the data has {n}"
        )
    key_arr = np.asarray(keys, dtype=object)
    parts: list[list[int]] = [[] for _ in range(n_clients)]
    for k in sorted(set(keys)):
        idx = np.flatnonzero(key_arr == k)
        idx = idx[rng.permutation(len(idx))]
        p = rng.dirichlet(np.full(n_clients, float(alpha)))
        cuts = np.floor(np.cumsum(p)[:-1] * len(idx)).astype(int)
        for c, piece in enumerate(np.split(idx, cuts)):
            parts[c].extend(piece.tolist())
    # minimum-size policy: redistribute from the largest client
    while True:
        sizes = np.array([len(p) for p in parts])
        small = int(np.argmin(sizes))
        if sizes[small] >= min_size:
            break
        big = int(np.argmax(sizes))
        move = min(min_size - sizes[small], sizes[big] - min_size)
        donor = parts[big]
        take = set(rng.choice(len(donor), size=move, replace=False).tolist())
        parts[small].extend(donor[j] for j in take)
        parts[big] = [x for j, x in enumerate(donor) if j not in take]
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def client_weights(client_indices: Sequence[np.ndarray]) -> np.ndarray:
    """a_n = |D_n| / |D| (paper §II-A); sums to 1."""
    sizes = np.array([len(c) for c in client_indices], dtype=np.float64)
    return sizes / sizes.sum()


# ----------------------------------------------------------------------------- federated


@dataclass
class FederatedData:
    """The tokenized training mix, its partition over clients and the evaluation sets."""

    train: TokenizedSet
    examples: list[Example]
    client_indices: list[np.ndarray]
    a: np.ndarray  # a_n = |D_n| / |D|
    eval_sets: dict[str, list[Example]]
    fmt: str = "llm-adapters"  # the training (and evaluation) `EvalFormat`
    lengths: Any = None  # harness: its `LengthReport` (p50/p99 tokens, examples dropped)
    # held-out instruction records per task (`fedlora.llm.instruct.response_loss` scores them)
    instruct_eval: dict[str, list[Any]] = field(default_factory=dict)


def _label(e: Any) -> str:
    if not isinstance(e, Example):
        raise DataError(
            f"data.partition_key = 'label': the instruction records of task {e.task!r} have no "
            "answer label: partition by task or by a field of the records"
        )
    return e.answer


def partition_keys(examples: Sequence[Any], key: str) -> list[str]:
    """The partition key of each example: its task, its answer label, or the value of a field
    of its record (`Example.fields`: your own data's columns). A record without the field
    raises `DataError` naming it and the fields it has."""
    getters: dict[str, Callable[[Any], str]] = {
        "task": lambda e: e.task,
        "label": _label,
    }
    if key in getters:
        return [getters[key](e) for e in examples]
    out = []
    for i, e in enumerate(examples):
        fields = dict(getattr(e, "fields", ()))
        if key not in fields:
            have = ", ".join(["task", "label", *fields])
            raise DataError(
                f"data.partition_key = {key!r}: training example {i} (task {e.task!r}) has no "
                f"such field; it has: {have}"
            )
        out.append(fields[key])
    return out


def per_value_partition(keys: Sequence[str], n_clients: int) -> list[np.ndarray]:
    """One client per distinct key value (sorted): client i holds every example of the i-th
    value. `n_clients` must equal the number of values."""
    values = sorted(set(keys))
    if len(values) != n_clients:
        raise DataError(
            f"data.partition_mode = 'per_value' gives one client per value: the key has "
            f"{len(values)} values ({', '.join(values[:5])}{', ...' if len(values) > 5 else ''}), "
            f"so data.n_clients must be {len(values)}, not {n_clients}"
        )
    arr = np.asarray(keys, dtype=object)
    return [np.flatnonzero(arr == v).astype(np.int64) for v in values]


def eval_questions(
    examples: list[Example],
    task: str,
    limit: int,
    seed: int,
    exclude_seeds: Sequence[int] = (),
) -> list[Example]:
    """The evaluation questions of one task: a seeded subset of `limit` (0 = all) drawn with
    the stream (seed, "eval", task) from the test split, after leaving out every question
    that the subset of the same `limit` for each seed in `exclude_seeds` draws. With no
    exclusions this is exactly the subset earlier versions drew."""
    pool = list(range(len(examples)))
    if exclude_seeds:
        dropped: set[int] = set()
        for s in exclude_seeds:
            dropped.update(_subset_indices(len(examples), limit, stream_rng(s, "eval", task)))
        pool = [i for i in pool if i not in dropped]
        if not pool or len(pool) < limit:
            raise ConfigError(
                f"data.eval_exclude = {[f'{task}:{s}' for s in exclude_seeds]!r} leaves "
                f"{len(pool)} of the {len(examples)} {task} test questions: fewer than "
                f"data.eval_limit = {limit}; exclude fewer subsets or lower the limit"
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
    cfg: DataConfig, tokenizer: Any, seed: int, fmt: str | EvalFormat = "llm-adapters"
) -> FederatedData:
    """Training mix -> tokens -> Dirichlet partition over `cfg.n_clients`; plus eval sets.

    `fmt` (evaluation.format, resolved): ``llm-adapters`` trains on the LLM-Adapters prompt
    and `cfg.response` (prompts cut from the left to `cfg.max_seq_len`); ``harness`` on the
    task's lm-eval context and correct continuation, dropping (never cutting) examples
    longer than `cfg.max_seq_len` (`fedlora.llm.harness.tokenize_harness`)."""
    fmt = EvalFormat(fmt)
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
        fmt=fmt,
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
) -> list[dict[str, torch.Tensor]]:
    """`steps` batches of `batch_size` from one client's data: shuffled epochs, concatenated
    (so no example repeats before all were seen)."""
    if not 0 <= client < len(fed.client_indices):
        raise DataError(
            f"client = {client!r} is invalid: must be in 0..{len(fed.client_indices) - 1}"
        )
    if steps < 1 or batch_size < 1:
        raise DataError(f"steps = {steps!r}, batch_size = {batch_size!r}: both must be >= 1")
    own = fed.client_indices[client]
    if len(own) == 0:
        raise DataError(f"client {client} holds no examples")
    need = steps * batch_size
    stream = np.concatenate([own[rng.permutation(len(own))] for _ in range(-(-need // len(own)))])
    return [
        collate(fed.train, stream[s * batch_size : (s + 1) * batch_size].tolist(), pad_id)
        for s in range(steps)
    ]
