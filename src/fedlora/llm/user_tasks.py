"""Your own multiple-choice questions: JSON, JSONL or CSV records read through a field map,
the ``[data.mc]`` table (`fedlora.config.data_mc.McConfig`, its defaults and checks):

    [data.mc]
    files = ["quiz_train.csv"]        # trained on (one task, named data.mc.task)
    eval_files = ["quiz_test.csv"]    # evaluated on, as that task
    question = "question"
    choices = ["A", "B", "C", "D"]    # one column per choice, or one field holding a list
    answer = "answer"
    answer_type = "label"             # index (0-based) | label (A, B, .. or the column) | text
    context = ""                      # optional: a passage read before the question

Each record becomes the LLM-Adapters question ``Please choose the correct answer to the
question: {question}`` with ``Answer1: ...`` options and the context as its input, so it
trains and evaluates in both formats; its lm-eval request is arc's (``{context}\\nQuestion:
{question}\\nAnswer:`` and each option). A record that does not fit raises `DataError` naming
the file, the line (the record's first line) and the field.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fedlora.config.data_mc import McConfig
from fedlora.errors import DataError, shown
from fedlora.files.data import read_data_records, read_once
from fedlora.llm.harness import harness_request
from fedlora.llm.task_registry import QUESTION_LEAD_IN, TASKS, question_answer, register_task
from fedlora.llm.task_types import TaskSpec
from fedlora.llm.tasks import Example, mc_example, refuse_local_shadow


def user_task(name: str) -> TaskSpec:
    """The declaration of a user's multiple-choice task (registered once per name)."""
    spec = TaskSpec(
        name=name,
        folder="",
        lm_eval=name,
        lead_in=QUESTION_LEAD_IN,
        option_word="answer",
        request=question_answer,
    )
    old = TASKS.get(name)
    if old is not None and old.folder:
        raise DataError(f"data.mc.task = {name!r} is a built-in task: choose another name")
    return register_task(spec)


# ----------------------------------------------------------------------------- files

HUB_PREFIX = "hf:"  # hf:owner/name[:config]@split, e.g. hf:allenai/sciq@train
# the hub's own rule for a name (huggingface_hub's `validate_repo_id`): letters, digits,
# "-", "_", "."; at most 96 characters; no "--" or ".."; no "-" or "." at either end
_HUB_NAME = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?", re.ASCII)
_HUB_SPLIT = re.compile(r"[\w.%+:\[\]-]{1,100}", re.ASCII)  # train, train[:10%], a+b
HUB_FORM = "hf:owner/name[:config]@split (owner and name as the hub spells them, never a path)"


def parse_hub_spec(spec: str) -> tuple[str, str, str]:
    """(repo ``owner/name``, config or "", split) of ``hf:owner/name[:config]@split``;
    `DataError` unless owner and name each follow the hub's naming rule: a path (``..``,
    ``/``, ``~``) is no hub name, so it never reaches `datasets.load_dataset`, which would
    read a local folder of that name."""
    body = spec[len(HUB_PREFIX) :]
    name, at, split = body.rpartition("@")
    repo, _, config = name.partition(":")
    parts = repo.split("/")
    ok = (
        at
        and _HUB_SPLIT.fullmatch(split)
        and len(parts) == 2
        and all(_HUB_NAME.fullmatch(x) for x in parts)
        and (not config or _HUB_NAME.fullmatch(config))
    )
    if not ok:
        raise DataError(f"{shown(spec)} is invalid: a hub dataset reads {HUB_FORM}")
    return repo, config, split


def hub_records(spec: str) -> list[tuple[str, Any]]:
    """(where, record) for every record of a hub dataset ``hf:owner/name[:config]@split``,
    through the `datasets` package; online only (offline: one line saying so)."""
    repo, config, split = parse_hub_spec(spec)
    refuse_local_shadow(shown(spec), repo)
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v) == "1"]
    if offline:
        raise DataError(
            f"{spec!r}: hub datasets load online only and {offline[0]}=1 is set: unset it, or "
            "save the dataset as a .jsonl file and name that file"
        )
    try:
        import datasets  # noqa: PLC0415 (optional, heavy)
    except ImportError:
        raise DataError(
            f"{spec!r}: hub datasets need the 'datasets' package: pip install datasets"
        ) from None
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as e:  # noqa: BLE001 - network, missing dataset, ...: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"{spec!r}: cannot load {repo} ({split}) from the hub: {first}") from None
    return [(f"{spec}: record {i}", dict(rec)) for i, rec in enumerate(ds)]


def read_records(path: str) -> list[tuple[str, Any]]:
    """(where, record) for every record of a .json (a list), .jsonl or .csv file (`where`
    names the file and the line the record starts on; `fedlora.files.data.read_data_records`: a
    regular file, bounded), or of a hub dataset ``hf:owner/name[:config]@split``
    (`hub_records`: the record's index). Within `fedlora.files.data.reading_once` (a run),
    each file or dataset is read once."""
    if path.startswith(HUB_PREFIX):
        out = read_once(path, lambda: hub_records(path))
        if not out:
            raise DataError(f"{path!r} holds no records")
        return out
    return read_data_records(path)


# ----------------------------------------------------------------------------- records


# Errors about a record name the file, the line and the field, never the record's text: the
# file may not be the user's data (a link to /etc/shadow read as CSV makes its first line the
# header), so a value is described by its kind, and field names are shown only when they
# look like names.
_NAME = re.compile(r"[\w .()/-]{1,64}")


def kind(value: Any) -> str:
    """What a JSON value is, without its text (for error messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "an empty string" if not value.strip() else "a string"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return "an object" if isinstance(value, dict) else type(value).__name__


def field_names(rec: Mapping[str, Any]) -> str:
    """The record's field names for an error message: those that look like names (letters,
    digits, spaces, ``_.()/-``; at most 64 characters), and how many others there are."""
    names = [str(k) for k in rec]
    shown_names = [n for n in names if _NAME.fullmatch(n)]
    other = len(names) - len(shown_names)
    hidden = f"{other} not shown: not names; is this a data file?" if other else ""
    return "; ".join(x for x in (", ".join(shown_names), hidden) if x) or "none"


def _field(rec: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in rec or rec[name] is None or rec[name] == "":
        raise DataError(f"{where}: field {name!r} is missing or empty (fields: {field_names(rec)})")
    return rec[name]


def _choices(rec: Mapping[str, Any], fm: McConfig, where: str) -> tuple[list[str], list[str]]:
    """The option texts and their labels (A, B, ... or the choice columns' names)."""
    if len(fm.choices) == 1:
        value = _field(rec, fm.choices[0], where)
        if isinstance(value, str):  # a CSV cell holding a JSON list
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):  # not JSON, too deep, too many digits
                value = None
        if not isinstance(value, list):
            raise DataError(
                f"{where}: field {fm.choices[0]!r} must be a list of choices (in CSV: a JSON "
                f"list), got {kind(rec[fm.choices[0]])}; or name one field per choice"
            )
        fields = [f"{fm.choices[0]}[{i}]" for i in range(len(value))]
        labels = [chr(ord("A") + i) for i in range(len(value))]
    else:
        value = [_field(rec, name, where) for name in fm.choices]
        fields, labels = list(fm.choices), list(fm.choices)
    if len(value) < 2:
        raise DataError(f"{where}: field {fm.choices[0]!r} needs >= 2 choices, got {len(value)}")
    texts = []
    for f, v in zip(fields, value):
        text = str(v).strip() if isinstance(v, (str, int, float)) else ""
        if not text:
            raise DataError(f"{where}: choice {f!r} is empty or not text: {kind(v)}")
        texts.append(text)
    return texts, labels


def _gold(value: Any, texts: list[str], labels: list[str], fm: McConfig, where: str) -> int:
    # the answer field's own value (a scalar) is shown: the record read as the user's data
    scalar = isinstance(value, (str, int, float))
    field = (
        f"field {fm.answer!r} = {value!r:.80}" if scalar else f"field {fm.answer!r} ({kind(value)})"
    )
    if fm.answer_type == "index":
        try:
            i = int(str(value).strip()) if not isinstance(value, bool) else -1
        except ValueError:
            i = -1
        if not 0 <= i < len(texts):
            raise DataError(f"{where}: {field} is not a choice index 0..{len(texts) - 1}")
        return i
    if fm.answer_type == "label":
        by_label = {lab.strip().lower(): i for i, lab in enumerate(labels)}
        i = by_label.get(str(value).strip().lower(), -1)
        if i < 0:
            raise DataError(f"{where}: {field} is not one of the choice labels {labels}")
        return i
    if str(value).strip() not in texts:
        raise DataError(f"{where}: {field} is not among the choices {texts!r:.200}")
    return texts.index(str(value).strip())


def scalars(rec: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The record's scalar fields as (name, text) pairs (for data.partition_key)."""
    return tuple(
        (str(k), str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in rec.items()
        if isinstance(v, (str, int, float, bool))
    )


def non_scalars(rec: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The record's other fields as (name, kind) pairs: a partition key naming one of them
    is refused as not scalar, not as missing."""
    return tuple(
        (str(k), kind(v)) for k, v in rec.items() if not isinstance(v, (str, int, float, bool))
    )


def record_to_example(rec: Any, fm: McConfig, task: str, where: str) -> Example:
    """One user record as the LLM-Adapters `Example` of task `task` (its harness request
    checked to read back the same question and options)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a record must be an object, got {kind(rec)}")
    question = str(_field(rec, fm.question, where)).strip()
    texts, labels = _choices(rec, fm, where)
    gold = _gold(_field(rec, fm.answer, where), texts, labels, fm, where)
    context = str(_field(rec, fm.context, where)).strip() if fm.context else ""
    spec = user_task(task)
    ex = mc_example(spec, question, texts, gold)
    ex = Example(
        ex.task,
        ex.instruction,
        ex.output,
        ex.answer,
        ex.labels,
        context,
        scalars(rec),
        source=where,
        non_scalar=non_scalars(rec),
    )
    try:
        req = harness_request(ex)
    except DataError as e:
        raise DataError(
            f"{where}: field {fm.question!r} or the choices cannot be read: {e}"
        ) from None
    if req.choices != tuple(texts) or f"Question: {question}\n" not in req.contexts[0]:
        raise DataError(
            f"{where}: field {fm.question!r} or a choice holds an 'AnswerN:' marker or an "
            "'Answer format:' line, which the question format reserves"
        )
    return ex


def load_mc_files(paths: Sequence[str], fm: McConfig) -> list[Example]:
    """Every record of the user's files `paths` (`fm.files` or `fm.eval_files`) read through
    the field map `fm`, as `Example`s of task `fm.task`."""
    return [
        record_to_example(rec, fm, fm.task, where)
        for path in paths
        for where, rec in read_records(path)
    ]
