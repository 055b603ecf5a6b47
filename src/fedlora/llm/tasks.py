"""The commonsense tasks as `Example`s: LLM-Adapters files, directories and the hub.

Records come from a directory in the LLM-Adapters layout (``<dir>/<Folder>/{train,test}.json``,
see docs/data.md), from any single LLM-Adapters JSON file, or from the
Hugging Face hub (needs the optional ``datasets`` package). Every record becomes an `Example`
whose allowed answers (``labels``) are read from the record itself: the instruction's
``Answer format: answer1/answer2/...`` line, else the set of answers in the file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlora.errors import DataError, cut
from fedlora.files.data import json_list_records, read_data_text
from fedlora.llm.task_registry import BUILTIN_TASKS, TASKS, get_task
from fedlora.llm.task_types import TaskSpec

# task name -> folder in the LLM-Adapters layout (the built-in tasks; `task_registry.TASKS`)
TASK_FOLDERS: dict[str, str] = {spec.name: spec.folder for spec in BUILTIN_TASKS}
SPLITS = ("train", "test")
RESPONSE_PREFIX = "the correct answer is "  # the LLM-Adapters target: prefix + label

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
    # the record's other fields (your own data's columns), for data.partition_key
    fields: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    source: str = field(default="", compare=False)  # "file: line N" of your own records
    # (name, kind) of the record's fields that are lists, objects or null
    non_scalar: tuple[tuple[str, str], ...] = field(default=(), compare=False)


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
            raise DataError(f"{where} is not an object: {type(rec).__name__}")
        instruction = rec.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise DataError(
                f"{where}: 'instruction' must be a non-empty string, got "
                f"{type(instruction).__name__}"
            )
        inp = rec.get("input", "") or ""
        if not isinstance(inp, str):
            raise DataError(f"{where}: 'input' must be a string, got {type(inp).__name__}")
        answer = rec.get("answer")
        output = rec.get("output")
        if output is not None and not isinstance(output, str):
            raise DataError(f"{where}: 'output' must be a string, got {type(output).__name__}")
        if answer is None and output:
            m = _OUTPUT_RE.search(output)
            answer = m.group(1).rstrip(".") if m else None
        if isinstance(answer, bool):
            answer = str(answer).lower()
        if not isinstance(answer, str) or not answer.strip():
            raise DataError(
                f"{where}: no answer: 'answer' is missing or empty and 'output' does not read "
                "'the correct answer is X'"
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
    """Load any LLM-Adapters JSON file (a regular file of at most `MAX_DATA_BYTES`, parsed a
    record at a time so that an error names its line); `task` defaults to the file's parent
    folder name."""
    p = Path(path)
    text = read_data_text(p, "task file")
    records = [rec for _, rec in json_list_records(text, cut(str(p)))]
    return records_to_examples(records, str(p), task or p.parent.name or p.stem)


def resolve_data_dir(data_dir: str) -> str | None:
    """The data directory to use: `data_dir`, else ``$FEDLORA_DATA``, else None (the hub)."""
    if data_dir:
        return data_dir
    return os.environ.get("FEDLORA_DATA") or None


def check_task(name: str) -> None:
    """Raise `DataError` unless `name` is a declared task (`task_registry.TASKS`)."""
    if name not in TASKS:
        raise DataError(f"task = {name!r} is invalid: allowed: {', '.join(TASKS)}")


def task_path(name: str, data_dir: str, split: str) -> Path:
    """The JSON file of a task's split in an LLM-Adapters directory (checked to exist)."""
    check_task(name)
    if split not in SPLITS:
        raise DataError(f"split = {split!r} is invalid: allowed: {', '.join(SPLITS)}")
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"data directory {str(root)!r} does not exist")
    if not TASKS[name].folder:
        raise DataError(f"task {name!r} has no folder in the LLM-Adapters layout")
    folder = root / TASKS[name].folder
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
    check_task(name)
    if data_dir is None:
        return load_hub_task(name, split)
    return load_task_file(str(task_path(name, data_dir, split)), task=name)


# ----------------------------------------------------------------------------- hub


def mc_example(spec: TaskSpec, question: str, options: Sequence[str], gold: int) -> Example:
    """The LLM-Adapters record of a question: ``{lead-in} {question}``, the options marked
    ``{Word}1: ...`` (none when the labels are the options, as true/false) and the
    ``Answer format`` line; the answer is option `gold`'s label."""
    if spec.option_word is None:
        labels = tuple(options)
        body = ""
    else:
        word = spec.option_word
        labels = tuple(f"{word}{i + 1}" for i in range(len(options)))
        marked = " ".join(f"{word.capitalize()}{i + 1}: {o}" for i, o in enumerate(options))
        body = f"\n\n{marked}"
    instruction = f"{spec.lead_in} {question}{body}\n\nAnswer format: {'/'.join(labels)}"
    answer = labels[gold]
    return Example(spec.name, instruction, RESPONSE_PREFIX + answer, answer, labels)


def convert_hub_record(task: str, rec: dict[str, Any]) -> Example:
    """One hub record (allenai/ai2_arc, allenai/openbookqa, allenai/social_i_qa, google/boolq,
    piqa, winogrande, hellaswag) as the LLM-Adapters `Example`."""
    spec = get_task(task)
    if spec.hub is None:
        raise DataError(f"task {task!r} has no hub source")
    question, options, gold = spec.hub.read(rec)
    if not 0 <= gold < len(options):
        raise DataError(f"task {task!r}: answer index {gold} is not in 0..{len(options) - 1}")
    return mc_example(spec, question, options, gold)


# task -> (hub id, config, {our split: hub split}); labelled test sets are hub validation sets
HUB_SOURCES: dict[str, tuple[str, str | None, dict[str, str]]] = {
    s.name: (s.hub.repo, s.hub.config, dict(s.hub.splits)) for s in BUILTIN_TASKS if s.hub
}


def refuse_local_shadow(what: str, repo: str) -> None:
    """`datasets.load_dataset(repo)` reads a local folder or file named `repo` (relative to
    the working directory) before it asks the hub: refuse (naming `what`) when one exists."""
    if os.path.lexists(repo):
        raise DataError(
            f"{what}: {repo!r} is also a path here, and the datasets package would read "
            "it instead of the hub: run from another folder, or name the local files directly"
        )


def load_hub_task(name: str, split: str) -> list[Example]:
    """A task's split from the Hugging Face hub, converted to LLM-Adapters examples."""
    check_task(name)
    if split not in SPLITS:
        raise DataError(f"split = {split!r} is invalid: allowed: {', '.join(SPLITS)}")
    hub = TASKS[name].hub
    if hub is None:
        raise DataError(f"task {name!r} has no hub source: give its files (--data-dir)")
    try:
        import datasets  # noqa: PLC0415 (optional, heavy)
    except ImportError:
        raise DataError(
            f"task {name!r}: no data directory was given (--data-dir, data.data_dir or "
            "$FEDLORA_DATA) and loading from the hub needs the 'datasets' package: "
            "pip install datasets, or give a directory in the LLM-Adapters layout"
        ) from None
    repo, config, splits = hub.repo, hub.config, hub.splits
    refuse_local_shadow(f"task {name!r}", repo)
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
