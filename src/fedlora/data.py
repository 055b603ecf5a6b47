"""Commonsense tasks, LLM-Adapters prompts, tokenization and the federated partition.

Records come from a directory in the LLM-Adapters layout (``<dir>/<Folder>/{train,test}.json``,
see ``../shared/data/README.md``), from any single LLM-Adapters JSON file, or from the
Hugging Face hub (needs the optional ``datasets`` package). Every record becomes an `Example`
whose allowed answers (``labels``) are read from the record itself: the instruction's
``Answer format: answer1/answer2/...`` line, else the set of answers in the file.

    fed = build_federated_data(cfg.data, tokenizer, seed=0)
    batches = client_batches(fed, client=3, steps=10, batch_size=4, rng=rng, pad_id=0)

The partition is Dirichlet(α) over a key (the task, or the answer label) across N clients, as
flwr-datasets' `DirichletPartitioner`: for each key value, a share vector p ~ Dir(α·1_N)
splits that key's examples over the clients. Minimum-size policy: *redistribute* (never
resample): while a client holds fewer than ``min_size`` examples it takes random examples
from the currently largest client. The aggregation weights are a_n = |D_n| / |D|.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from fedlora.config import DataConfig

# ----------------------------------------------------------------------------- tasks

# task name -> folder in the LLM-Adapters layout
TASK_FOLDERS: dict[str, str] = {
    "arc-e": "ARC-Easy",
    "arc-c": "ARC-Challenge",
    "obqa": "openbookqa",
    "siqa": "social_i_qa",
    "boolq": "boolq",
    "piqa": "piqa",
    "winogrande": "winogrande",
    "hellaswag": "hellaswag",
}
SPLITS = ("train", "test")

PROMPT_HEADER = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request."
)
PROMPT_HEADER_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request."
)
RESPONSE_PREFIX = "the correct answer is "
IGNORE_INDEX = -100

_FORMAT_RE = re.compile(r"Answer format:\s*([^\n]+?)\s*$", re.IGNORECASE | re.MULTILINE)
_OUTPUT_RE = re.compile(r"the correct answer is\s+(\S+)", re.IGNORECASE)


@dataclass(frozen=True)
class Example:
    """One multiple-choice record. `labels` are the allowed answers, in the file's order;
    `answer` is one of them; `output` is the LLM-Adapters target ("the correct answer is X")."""

    task: str
    instruction: str
    output: str
    answer: str
    labels: tuple[str, ...]
    input: str = ""  # LLM-Adapters' optional context; empty for all commonsense tasks


def _natural_key(s: str) -> tuple[Any, ...]:
    """answer2 < answer10: compare digit runs as numbers."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))


def parse_answer_format(instruction: str) -> tuple[str, ...] | None:
    """The labels of an ``Answer format: a/b/c`` line, or None when there is none."""
    m = _FORMAT_RE.search(instruction)
    if m is None:
        return None
    labels = tuple(t.strip() for t in m.group(1).split("/") if t.strip())
    return labels or None


def records_to_examples(records: Any, source: str, task: str) -> list[Example]:
    """Validate LLM-Adapters records (a JSON list of objects) and build `Example`s.

    Labels: the instruction's ``Answer format`` line when present, else the file's set of
    answers (natural order). Raises `DataError` naming `source` and the record index.
    """
    if not isinstance(records, list):
        raise DataError(f"{source}: expected a JSON list of records, got {type(records).__name__}")
    if not records:
        raise DataError(f"{source}: the file holds no records")
    parsed: list[tuple[str, str, str, str]] = []  # instruction, input, output, answer
    for i, rec in enumerate(records):
        where = f"{source}: record {i}"
        if not isinstance(rec, dict):
            raise DataError(f"{where} is not an object: {rec!r:.80}")
        instruction = rec.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise DataError(
                f"{where}: 'instruction' must be a non-empty string, got {instruction!r:.80}"
            )
        inp = rec.get("input", "") or ""
        if not isinstance(inp, str):
            raise DataError(f"{where}: 'input' must be a string, got {inp!r:.80}")
        answer = rec.get("answer")
        output = rec.get("output")
        if output is not None and not isinstance(output, str):
            raise DataError(f"{where}: 'output' must be a string, got {output!r:.80}")
        if answer is None and output:
            m = _OUTPUT_RE.search(output)
            answer = m.group(1).rstrip(".") if m else None
        if isinstance(answer, bool):
            answer = str(answer).lower()
        if not isinstance(answer, str) or not answer.strip():
            raise DataError(
                f"{where}: no answer: 'answer' is {rec.get('answer')!r:.40} and 'output' "
                f"{output!r:.60} does not read 'the correct answer is X'"
            )
        answer = answer.strip()
        parsed.append((instruction, inp, output or RESPONSE_PREFIX + answer, answer))

    file_labels = tuple(sorted({p[3] for p in parsed}, key=_natural_key))
    examples = []
    for i, (instruction, inp, output, answer) in enumerate(parsed):
        labels = parse_answer_format(instruction) or file_labels
        if len(labels) < 2:
            raise DataError(
                f"{source}: record {i}: cannot parse the label set: no 'Answer format: a/b/...' "
                f"line and the file's answers are only {list(file_labels)}; need >= 2 labels"
            )
        if answer not in labels:
            raise DataError(
                f"{source}: record {i}: answer {answer!r} is not one of the labels {list(labels)}"
            )
        examples.append(Example(task, instruction, output, answer, labels, inp))
    return examples


def load_task_file(path: str, task: str | None = None) -> list[Example]:
    """Load any LLM-Adapters JSON file; `task` defaults to the file's parent folder name."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"task file {str(p)!r} does not exist")
    try:
        records = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read task file {str(p)!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"task file {str(p)!r} is not valid JSON: {e}") from None
    return records_to_examples(records, str(p), task or p.parent.name or p.stem)


def resolve_data_dir(data_dir: str) -> str | None:
    """The data directory to use: `data_dir`, else ``$FEDLORA_DATA``, else None (the hub)."""
    if data_dir:
        return data_dir
    return os.environ.get("FEDLORA_DATA") or None


def _check_task(name: str) -> None:
    if name not in TASK_FOLDERS:
        raise DataError(f"task = {name!r} is invalid: allowed: {', '.join(TASK_FOLDERS)}")


def task_path(name: str, data_dir: str, split: str) -> Path:
    """The JSON file of a task's split in an LLM-Adapters directory (checked to exist)."""
    _check_task(name)
    if split not in SPLITS:
        raise DataError(f"split = {split!r} is invalid: allowed: {', '.join(SPLITS)}")
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"data directory {str(root)!r} does not exist")
    folder = root / TASK_FOLDERS[name]
    if not folder.is_dir():
        present = sorted(d.name for d in root.iterdir() if d.is_dir())
        raise DataError(
            f"task {name!r}: folder {str(folder)!r} does not exist; "
            f"{str(root)!r} holds: {', '.join(present) or 'no folders'}"
        )
    path = folder / f"{split}.json"
    if not path.is_file():
        present = sorted(f.name for f in folder.glob("*.json"))
        raise DataError(
            f"task {name!r}: split file {str(path)!r} does not exist; "
            f"{str(folder)!r} holds: {', '.join(present) or 'no JSON files'}"
        )
    return path


def task_available(name: str, data_dir: str | None, split: str) -> bool:
    """Whether `load_task` can find the split locally (always True for the hub)."""
    if data_dir is None:
        return True
    try:
        task_path(name, data_dir, split)
    except DataError:
        return False
    return True


def load_task(name: str, data_dir: str | None, split: str) -> list[Example]:
    """A task's split from an LLM-Adapters directory, or from the hub when `data_dir` is None."""
    _check_task(name)
    if data_dir is None:
        return load_hub_task(name, split)
    return load_task_file(str(task_path(name, data_dir, split)), task=name)


# ----------------------------------------------------------------------------- hub


def _options_text(prefix: str, options: Sequence[str]) -> str:
    return " ".join(f"{prefix}{i + 1}: {o}" for i, o in enumerate(options))


def _mc_example(task: str, head: str, options: Sequence[str], correct: int, word: str) -> Example:
    """The LLM-Adapters instruction for a multiple-choice question (word: answer/solution/...)."""
    labels = tuple(f"{word}{i + 1}" for i in range(len(options)))
    instruction = (
        f"{head}\n\n{_options_text(word.capitalize(), options)}\n\n"
        f"Answer format: {'/'.join(labels)}"
    )
    answer = labels[correct]
    return Example(task, instruction, RESPONSE_PREFIX + answer, answer, labels)


def _letter_index(key: str, labels: Sequence[str]) -> int:
    if key in labels:
        return list(labels).index(key)
    raise DataError(f"answer key {key!r} is not one of the choice labels {list(labels)}")


def convert_hub_record(task: str, rec: dict[str, Any]) -> Example:
    """One hub record (allenai/ai2_arc, allenai/openbookqa, allenai/social_i_qa, google/boolq,
    piqa, winogrande, hellaswag) as the LLM-Adapters `Example`."""
    q = "Please choose the correct answer to the question: "
    if task in ("arc-e", "arc-c"):
        ch = rec["choices"]
        i = _letter_index(str(rec["answerKey"]), [str(x) for x in ch["label"]])
        return _mc_example(task, q + rec["question"], ch["text"], i, "answer")
    if task == "obqa":
        ch = rec["choices"]
        i = _letter_index(str(rec["answerKey"]), [str(x) for x in ch["label"]])
        return _mc_example(task, q + rec["question_stem"], ch["text"], i, "answer")
    if task == "siqa":
        opts = [rec["answerA"], rec["answerB"], rec["answerC"]]
        head = q + f"{rec['context']} {rec['question']}"
        return _mc_example(task, head, opts, int(rec["label"]) - 1, "answer")
    if task == "boolq":
        question = rec["question"].rstrip("?")
        instruction = (
            "Please answer the following question with true or false, question: "
            f"{question}?\n\nAnswer format: true/false"
        )
        answer = "true" if rec["answer"] else "false"
        return Example(task, instruction, RESPONSE_PREFIX + answer, answer, ("true", "false"))
    if task == "piqa":
        head = f"Please choose the correct solution to the question: {rec['goal']}"
        return _mc_example(task, head, [rec["sol1"], rec["sol2"]], int(rec["label"]), "solution")
    if task == "winogrande":
        head = (
            "Please choose the correct answer to fill in the blank to complete the given "
            f"sentence: {rec['sentence']}"
        )
        opts = [rec["option1"], rec["option2"]]
        return _mc_example(task, head, opts, int(rec["answer"]) - 1, "option")
    if task == "hellaswag":
        head = f"Please choose the correct ending to complete the given sentence: {rec['ctx']}"
        return _mc_example(task, head, rec["endings"], int(rec["label"]), "ending")
    _check_task(task)
    raise DataError(f"task {task!r} has no hub converter")  # pragma: no cover


# task -> (hub id, config, {our split: hub split}); labelled test sets are hub validation sets
HUB_SOURCES: dict[str, tuple[str, str | None, dict[str, str]]] = {
    "arc-e": ("allenai/ai2_arc", "ARC-Easy", {"train": "train", "test": "test"}),
    "arc-c": ("allenai/ai2_arc", "ARC-Challenge", {"train": "train", "test": "test"}),
    "obqa": ("allenai/openbookqa", "main", {"train": "train", "test": "test"}),
    "siqa": ("allenai/social_i_qa", None, {"train": "train", "test": "validation"}),
    "boolq": ("google/boolq", None, {"train": "train", "test": "validation"}),
    "piqa": ("ybisk/piqa", None, {"train": "train", "test": "validation"}),
    "winogrande": ("allenai/winogrande", "winogrande_xl", {"train": "train", "test": "validation"}),
    "hellaswag": ("Rowan/hellaswag", None, {"train": "train", "test": "validation"}),
}


def load_hub_task(name: str, split: str) -> list[Example]:
    """A task's split from the Hugging Face hub, converted to LLM-Adapters examples."""
    _check_task(name)
    if split not in SPLITS:
        raise DataError(f"split = {split!r} is invalid: allowed: {', '.join(SPLITS)}")
    try:
        import datasets  # noqa: PLC0415 (optional, heavy)
    except ImportError:
        raise DataError(
            f"task {name!r}: no data directory was given (--data-dir, data.data_dir or "
            "$FEDLORA_DATA) and loading from the hub needs the 'datasets' package: "
            "pip install datasets, or give a directory in the LLM-Adapters layout"
        ) from None
    repo, config, splits = HUB_SOURCES[name]
    try:
        ds = datasets.load_dataset(repo, config, split=splits[split])
    except Exception as e:  # network, missing dataset, ... : report, do not trace
        raise DataError(
            f"task {name!r}: cannot load {repo} ({splits[split]}) from the hub: {e}"
        ) from None
    out = []
    for i, rec in enumerate(ds):
        try:
            out.append(convert_hub_record(name, rec))
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise DataError(f"{repo} {splits[split]}: record {i} is malformed: {e!r}") from None
    return out


# ----------------------------------------------------------------------------- mixes


def stream_rng(seed: int, *keys: str | int) -> np.random.Generator:
    """An independent, reproducible stream per (seed, purpose, ...)."""
    words = [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in keys]
    return np.random.default_rng([seed, *words])


def seeded_subset(examples: list[Example], limit: int, rng: np.random.Generator) -> list[Example]:
    """`limit` examples drawn without replacement, in their original order (0 = all)."""
    if limit <= 0 or limit >= len(examples):
        return list(examples)
    keep = np.sort(rng.choice(len(examples), size=limit, replace=False))
    return [examples[i] for i in keep]


def training_mix(cfg: DataConfig, seed: int) -> list[Example]:
    """The training mix: the train split of each of `cfg.tasks` that is present (tasks without
    a train split are skipped, e.g. siqa here) plus every `cfg.task_files` file, each cut to a
    seeded subset of `cfg.train_limit` examples."""
    data_dir = resolve_data_dir(cfg.data_dir)
    mix: list[Example] = []
    skipped = []
    for task in cfg.tasks:
        _check_task(task)
        if not task_available(task, data_dir, "train"):
            skipped.append(task)
            continue
        exs = load_task(task, data_dir, "train")
        mix.extend(seeded_subset(exs, cfg.train_limit, stream_rng(seed, "train", task)))
    for path in cfg.task_files:
        exs = load_task_file(path)
        mix.extend(seeded_subset(exs, cfg.train_limit, stream_rng(seed, "train", path)))
    if not mix:
        raise DataError(
            f"data.tasks = {list(cfg.tasks)!r}: none has a train split in {data_dir!r} "
            f"(skipped: {', '.join(skipped)}) and data.task_files is empty"
        )
    return mix


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


# ----------------------------------------------------------------------------- prompts


def format_prompt(ex: Example) -> str:
    """The LLM-Adapters (Alpaca) prompt up to and including ``### Response:\\n``."""
    if ex.input:
        return (
            f"{PROMPT_HEADER_INPUT}\n\n### Instruction:\n{ex.instruction}\n\n"
            f"### Input:\n{ex.input}\n\n### Response:\n"
        )
    return f"{PROMPT_HEADER}\n\n### Instruction:\n{ex.instruction}\n\n### Response:\n"


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Prompt tokens, with the tokenizer's BOS (if it adds one)."""
    return _encode(tokenizer, prompt, True)


def encode_continuation(tokenizer: Any, prefix: str, text: str) -> tuple[list[int], int]:
    """Tokens of ``prefix + text`` (no special tokens) and how many of them belong to `text`.

    Tokenized together so that the tokens are those the model sees in training; when the
    tokens of `prefix` alone are not a prefix of them, `text` is tokenized on its own."""
    whole = _encode(tokenizer, prefix + text, False)
    head = _encode(tokenizer, prefix.rstrip(" "), False) if prefix else []
    if whole[: len(head)] == head and len(whole) > len(head):
        return whole, len(whole) - len(head)
    tail = _encode(tokenizer, (" " if prefix.endswith(" ") else "") + text, False)
    return head + tail, len(tail)


@dataclass
class TokenizedSet:
    """Token ids per example and the training labels (IGNORE_INDEX = -100 off the response)."""

    input_ids: list[np.ndarray]
    labels: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.input_ids)


def response_text(ex: Example, response: str = "label") -> str:
    """The training target of `ex`: its LLM-Adapters output ("the correct answer is answer2")
    for ``response="label"``, or "the correct answer is " + the correct option's text for
    ``"option"`` (what ``evaluation.scoring = option | option_norm`` scores)."""
    if response == "label":
        return ex.output
    if response == "option":
        from fedlora.evaluation import parse_options  # noqa: PLC0415 (evaluation imports data)

        return RESPONSE_PREFIX + parse_options(ex)[ex.labels.index(ex.answer)]
    raise DataError(f"data.response = {response!r} is invalid: allowed: label, option")


def tokenize_examples(
    examples: Sequence[Example], tokenizer: Any, max_len: int, response: str = "label"
) -> TokenizedSet:
    """Prompt + response (+ EOS); loss only on the response and EOS (`response_text`: the
    label or the option text). Too long: the prompt is cut from the LEFT (its BOS kept) so
    the response is always whole (cut only if it alone exceeds `max_len`)."""
    if max_len < 2:
        raise DataError(f"max_len = {max_len!r} is invalid: must be >= 2")
    eos = getattr(tokenizer, "eos_token_id", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    ids_out, labels_out = [], []
    for ex in examples:
        prompt = encode_prompt(tokenizer, format_prompt(ex))
        target = _encode(tokenizer, response_text(ex, response), False)
        target = (target + ([eos] if eos is not None else []))[:max_len]
        room = max_len - len(target)
        if len(prompt) > room:
            if room == 0:
                prompt = []
            elif bos is not None and prompt[0] == bos:
                prompt = [bos] + prompt[len(prompt) - (room - 1) :]
            else:
                prompt = prompt[len(prompt) - room :]
        ids = np.asarray(prompt + target, dtype=np.int64)
        labels = ids.copy()
        labels[: len(prompt)] = IGNORE_INDEX
        ids_out.append(ids)
        labels_out.append(labels)
    return TokenizedSet(ids_out, labels_out)


def collate(ts: TokenizedSet, idx: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask (1 on tokens) and labels (-100 on pad)."""
    import torch

    if len(idx) == 0:
        raise DataError("collate: empty batch")
    t = max(len(ts.input_ids[i]) for i in idx)
    input_ids = torch.full((len(idx), t), int(pad_id), dtype=torch.long)
    labels = torch.full((len(idx), t), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(idx), t), dtype=torch.long)
    for row, i in enumerate(idx):
        n = len(ts.input_ids[i])
        input_ids[row, :n] = torch.from_numpy(ts.input_ids[i])
        labels[row, :n] = torch.from_numpy(ts.labels[i])
        mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


# ----------------------------------------------------------------------------- federated


@dataclass
class FederatedData:
    """The tokenized training mix, its partition over clients and the evaluation sets."""

    train: TokenizedSet
    examples: list[Example]
    client_indices: list[np.ndarray]
    a: np.ndarray  # a_n = |D_n| / |D|
    eval_sets: dict[str, list[Example]]


def partition_keys(examples: Sequence[Example], key: str) -> list[str]:
    """The partition key of each example: its task or its answer label."""
    getters: dict[str, Callable[[Example], str]] = {
        "task": lambda e: e.task,
        "label": lambda e: e.answer,
    }
    if key not in getters:
        raise DataError(f"data.partition_key = {key!r} is invalid: allowed: task, label")
    return [getters[key](e) for e in examples]


def load_eval_sets(cfg: DataConfig, seed: int) -> dict[str, list[Example]]:
    """A seeded subset (`cfg.eval_limit`, 0 = all) of each eval task's test split."""
    data_dir = resolve_data_dir(cfg.data_dir)
    return {
        task: seeded_subset(
            load_task(task, data_dir, "test"), cfg.eval_limit, stream_rng(seed, "eval", task)
        )
        for task in cfg.eval_tasks
    }


def build_federated_data(cfg: DataConfig, tokenizer: Any, seed: int) -> FederatedData:
    """Training mix -> tokens -> Dirichlet partition over `cfg.n_clients`; plus eval sets."""
    examples = training_mix(cfg, seed)
    train = tokenize_examples(examples, tokenizer, cfg.max_seq_len, cfg.response)
    clients = dirichlet_partition(
        partition_keys(examples, cfg.partition_key),
        cfg.n_clients,
        cfg.dirichlet_alpha,
        cfg.min_client_examples,
        stream_rng(seed, "partition"),
    )
    return FederatedData(
        train, examples, clients, client_weights(clients), load_eval_sets(cfg, seed)
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
