"""Every task fedlora reads, one declaration each (`TaskSpec`): its LLM-Adapters folder, its
hub source and how a hub record reads, its lm-evaluation-harness request, its lead-in and its
metrics. Adding a task is adding one `TaskSpec` (here for a built-in task, or with
`register_task` from your own code: docs/data.md, "Adding a task").

The requests are lm-eval 0.4's zero-shot ones (see `fedlora.llm.harness`):

    task (fedlora / lm-eval)        context                         continuations
    arc-e, arc-c / arc_easy, ...    "Question: {question}\\nAnswer:"  " {option}"
    obqa / openbookqa               "{question_stem}"                " {option}"
    piqa / piqa                     "Question: {goal}\\nAnswer:"      " {solution}"
    siqa / social_iqa               "Q: {context} {question}\\nA:"    " {answer}"
    hellaswag / hellaswag           preprocess("{label}: {ctx}")     " " + preprocess(ending)
    winogrande / winogrande         sentence[:blank] + option        " " + sentence after blank
    boolq / boolq                   "Question: {question}?\\nAnswer:" " no", " yes"
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fedlora.config.registry import Registry
from fedlora.errors import DataError
from fedlora.llm.task_types import (
    TARGET_DELIMITER,
    HarnessRequest,
    HubSource,
    TaskSpec,
    shared_request,
)

QUESTION_LEAD_IN = "Please choose the correct answer to the question:"


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag text cleaning (WikiHow's bracket artifacts, double spaces)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def letter_index(key: str, labels: Sequence[str]) -> int:
    """The index of the answer key `key` among the choice labels (A, B, ... or 1, 2, ...)."""
    if key in labels:
        return list(labels).index(key)
    raise DataError(f"answer key {key!r} is not one of the choice labels {list(labels)}")


# ----------------------------------------------------------------------------- requests


def question_answer(name: str, q: str, options: tuple[str, ...], gold: int, inp: str):
    """``Question: {q}\\nAnswer:`` then each option (arc, piqa; a context first if given)."""
    head = f"{inp}\n" if inp else ""
    return shared_request(name, f"{head}Question: {q}\nAnswer:", options, gold)


def _bare(name: str, q: str, options: tuple[str, ...], gold: int, inp: str) -> HarnessRequest:
    return shared_request(name, q, options, gold)


def _siqa(name: str, q: str, options: tuple[str, ...], gold: int, inp: str) -> HarnessRequest:
    return shared_request(name, f"Q: {q}\nA:", options, gold)  # q: "{context} {question}"


def _hellaswag(name: str, q: str, options: tuple[str, ...], gold: int, inp: str):
    opts = [hellaswag_preprocess(o) for o in options]
    return shared_request(name, hellaswag_preprocess(q), opts, gold)


def _winogrande(name: str, q: str, options: tuple[str, ...], gold: int, inp: str):
    """Partial scoring: the blank filled by each option, the rest of the sentence scored."""
    blank = q.find("_")
    if blank < 0:
        raise DataError(f"task {name!r}: no '_' blank in sentence {q!r:.100}")
    contexts = tuple(q[:blank] + o for o in options)
    tail = TARGET_DELIMITER + q[blank + 1 :].strip()
    return HarnessRequest(name, contexts, (tail,) * len(options), contexts, gold)


def _boolq(name: str, q: str, options: tuple[str, ...], gold: int, inp: str):
    answer = options[gold]
    if answer not in ("true", "false"):
        raise DataError(f"task 'boolq': answer {answer!r} is not true/false")
    q = q[:-1] if q.endswith("?") else q  # LLM-Adapters added "?"
    return shared_request(name, f"Question: {q}?\nAnswer:", ("no", "yes"), int(answer == "true"))


# ----------------------------------------------------------------------------- hub records


def _choices(rec: Mapping[str, Any], stem: str) -> tuple[str, Sequence[str], int]:
    ch = rec["choices"]
    return rec[stem], ch["text"], letter_index(str(rec["answerKey"]), [str(x) for x in ch["label"]])


def _hellaswag_hub(rec: Mapping[str, Any]) -> tuple[str, Sequence[str], int]:
    ctx = rec["ctx"]  # ctx_b capitalised as lm-eval does, so the harness reads its context
    if "ctx_a" in rec and "ctx_b" in rec:
        ctx = f"{rec['ctx_a']} {rec['ctx_b'].capitalize()}".strip()
    if rec.get("activity_label"):
        ctx = f"{rec['activity_label']}: {ctx}"
    return ctx, rec["endings"], int(rec["label"])


def _boolq_hub(rec: Mapping[str, Any]) -> tuple[str, Sequence[str], int]:
    return rec["question"].rstrip("?") + "?", ("true", "false"), 0 if rec["answer"] else 1


def _hub(repo: str, config: str | None, test: str, read: Any) -> HubSource:
    return HubSource(repo, config, {"train": "train", "test": test}, read)


BUILTIN_TASKS: tuple[TaskSpec, ...] = (
    TaskSpec(
        "arc-e",
        "ARC-Easy",
        "arc_easy",
        QUESTION_LEAD_IN,
        "answer",
        question_answer,
        _hub("allenai/ai2_arc", "ARC-Easy", "test", lambda r: _choices(r, "question")),
    ),
    TaskSpec(
        "arc-c",
        "ARC-Challenge",
        "arc_challenge",
        QUESTION_LEAD_IN,
        "answer",
        question_answer,
        _hub("allenai/ai2_arc", "ARC-Challenge", "test", lambda r: _choices(r, "question")),
    ),
    TaskSpec(
        "obqa",
        "openbookqa",
        "openbookqa",
        QUESTION_LEAD_IN,
        "answer",
        _bare,
        _hub("allenai/openbookqa", "main", "test", lambda r: _choices(r, "question_stem")),
    ),
    TaskSpec(
        "siqa",
        "social_i_qa",
        "social_iqa",
        QUESTION_LEAD_IN,
        "answer",
        _siqa,
        _hub(
            "allenai/social_i_qa",
            None,
            "validation",
            lambda r: (
                f"{r['context']} {r['question']}",
                [r["answerA"], r["answerB"], r["answerC"]],
                int(r["label"]) - 1,
            ),
        ),
        metrics=("acc",),
    ),
    TaskSpec(
        "boolq",
        "boolq",
        "boolq",
        "Please answer the following question with true or false, question:",
        None,
        _boolq,
        _hub("google/boolq", None, "validation", _boolq_hub),
        metrics=("acc",),
    ),
    TaskSpec(
        "piqa",
        "piqa",
        "piqa",
        "Please choose the correct solution to the question:",
        "solution",
        question_answer,
        _hub(
            "ybisk/piqa",
            None,
            "validation",
            lambda r: (r["goal"], [r["sol1"], r["sol2"]], int(r["label"])),
        ),
    ),
    TaskSpec(
        "winogrande",
        "winogrande",
        "winogrande",
        "Please choose the correct answer to fill in the blank to complete the given sentence:",
        "option",
        _winogrande,
        _hub(
            "allenai/winogrande",
            "winogrande_xl",
            "validation",
            lambda r: (r["sentence"], [r["option1"], r["option2"]], int(r["answer"]) - 1),
        ),
        metrics=("acc",),
    ),
    TaskSpec(
        "hellaswag",
        "hellaswag",
        "hellaswag",
        "Please choose the correct ending to complete the given sentence:",
        "ending",
        _hellaswag,
        _hub("Rowan/hellaswag", None, "validation", _hellaswag_hub),
    ),
)

TASK_GROUP = "fedlora.tasks"  # another package's tasks: entry points naming a TaskSpec


def _check_folder(name: str, spec: TaskSpec) -> None:
    """A task's name is its spec's, and its folder is no other task's (DataError)."""
    if not isinstance(spec, TaskSpec) or spec.name != name:
        raise DataError(f"task {name!r}: {spec!r:.100} is not a TaskSpec named {name!r}")
    for other in TASKS.values():
        if spec.folder and other.name != spec.name and other.folder == spec.folder:
            raise DataError(f"task {spec.name!r}: folder {spec.folder!r} is task {other.name!r}'s")


# name -> declaration: the built-in tasks, then any `register_task` (or entry point) added
TASK_REGISTRY: Registry[TaskSpec] = Registry(
    "data.tasks",
    TASK_GROUP,
    kind="task",
    accepts=lambda obj: isinstance(obj, TaskSpec),
    on_add=_check_folder,
    sorted_names=False,  # the built-in tasks in their order, then the added ones
)
TASKS = TASK_REGISTRY.table


def register_task(spec: TaskSpec) -> TaskSpec:
    """Add a task (or declare the same one again). A different declaration under a name
    already taken, or a folder another task uses, raises `DataError`. A task without a
    folder (`folder=""`) has no LLM-Adapters files: its examples come from elsewhere.
    Another package may instead name its `TaskSpec` in the ``fedlora.tasks`` entry-point
    group (loaded when the task is asked for)."""
    old = TASKS.get(spec.name)
    if old is not None and old != spec:
        raise DataError(f"task {spec.name!r} is already declared differently")
    return TASK_REGISTRY.add(spec.name, spec)


for _spec in BUILTIN_TASKS:
    register_task(_spec)


def task_names() -> tuple[str, ...]:
    """Every task name: the built-in ones, the registered ones, the entry points."""
    return TASK_REGISTRY.names()


def find_task(name: str) -> TaskSpec | None:
    """The declaration of a task, named by its fedlora name, its LLM-Adapters folder or an
    entry point of ``fedlora.tasks``."""
    spec = TASKS.get(name)
    if spec is None:
        spec = next((s for s in TASKS.values() if s.folder == name), None)
    return spec if spec is not None else TASK_REGISTRY.find(name)


def get_task(name: str) -> TaskSpec:
    """`find_task`, raising `DataError` listing the tasks when `name` is none of them."""
    spec = find_task(name)
    if spec is None:
        raise DataError(f"task = {name!r} is invalid: allowed: {', '.join(task_names())}")
    return spec
