"""lm-evaluation-harness itself on fedlora's local records (offline): `fedlora eval --harness`.

`fedlora.llm.harness` rebuilds lm-eval's zero-shot requests; this module checks them against
lm-eval, not against a copy of it. From LLM-Adapters records (parsed by `harness_request`) it
writes, per task, a JSON-lines file in the Hugging Face schema lm-eval's task expects and a
task YAML that ``include``s lm-eval's own task definition (its prompt, choices, target,
metrics, preprocessing) and overrides only where the documents come from::

    include: <lm_eval>/tasks/arc/arc_easy.yaml
    task: fedlora_arc_easy
    dataset_path: json
    dataset_kwargs: {data_files: {test: <dir>/arc_easy.jsonl}}
    test_split: test        (training/validation/fewshot splits: none; zero-shot)

then runs lm-eval's `simple_evaluate` with its ``HFLM`` on a model instance (base model, or a
PEFT adapter applied to it) and returns lm-eval's per-question log-likelihoods and acc /
acc_norm. lm_eval is imported lazily (the optional extra ``fedlora[harness]``).

Documents per task (fields lm-eval reads; the rest is not needed for zero-shot):

    arc_easy, arc_challenge  question, choices {text, label A..}, answerKey
    openbookqa               question_stem, choices, answerKey
    piqa                     goal, sol1, sol2, label
    social_iqa               context + question (the joined text split at its last space:
                             lm-eval joins them with one space), answerA..C, label "1".."3"
    winogrande               sentence (with "_"), option1, option2, answer "1"/"2"
    hellaswag                activity_label, ctx_a, ctx_b = "", endings, label (lm-eval's
                             process_docs runs again on the already-cleaned text)
    boolq                    question, passage = "", label; LLM-Adapters keeps no passage, so
                             doc_to_text is lm-eval's template without its "{passage}\\n"
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError, DataError
from fedlora.llm.harness import harness_request
from fedlora.llm.prompts import parse_options
from fedlora.llm.task_types import HarnessRequest
from fedlora.llm.tasks import Example

__all__ = ["HarnessQuestion", "lm_eval_available", "run_lm_eval", "write_tasks"]

# lm-eval task -> its YAML under lm_eval/tasks
_TASK_YAMLS = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "piqa": "piqa/piqa.yaml",
    "social_iqa": "siqa/siqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "boolq": "super_glue/boolq/default.yaml",
}
_PREFIX = "fedlora_"
_LETTERS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class HarnessQuestion:
    """lm-eval's result for one question: the summed log-likelihood of each option's
    continuation (option order), and its acc / acc_norm (0 or 1)."""

    task: str  # lm-eval task name
    doc_id: int
    logliks: tuple[float, ...]
    acc: float
    acc_norm: float


def lm_eval_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def _lm_eval_tasks_dir() -> Path:
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(
            "lm-evaluation-harness is not installed: pip install 'fedlora[harness]' "
            "(lm-eval>=0.4,<0.5)"
        ) from None
    return Path(lm_eval.__file__).parent / "tasks"


def _strip(text: str, head: str, tail: str, task: str) -> str:
    if not (text.startswith(head) and text.endswith(tail)):
        raise DataError(f"{task}: context {text!r:.80} is not {head!r}...{tail!r}")
    return text[len(head) : len(text) - len(tail)]


def _doc(ex: Example, req: HarnessRequest) -> dict[str, Any]:
    """The Hugging Face document of one question, in the schema lm-eval's task reads."""
    t, ch, gold = req.task, list(req.choices), req.gold
    if t in ("arc_easy", "arc_challenge", "openbookqa"):
        choices = {"text": ch, "label": list(_LETTERS[: len(ch)])}
        if t == "openbookqa":
            return {"question_stem": req.context, "choices": choices, "answerKey": _LETTERS[gold]}
        q = _strip(req.context, "Question: ", "\nAnswer:", t)
        return {"question": q, "choices": choices, "answerKey": _LETTERS[gold]}
    if t == "piqa":
        q = _strip(req.context, "Question: ", "\nAnswer:", t)
        return {"goal": q, "sol1": ch[0], "sol2": ch[1], "label": gold}
    if t == "social_iqa":
        joined = _strip(req.context, "Q: ", "\nA:", t)
        context, _, question = joined.rpartition(" ")
        doc = {"context": context, "question": question, "label": str(gold + 1)}
        return doc | {f"answer{c}": o for c, o in zip("ABC", ch)}
    if t == "winogrande":
        options = parse_options(ex)
        prefix = req.contexts[0][: len(req.contexts[0]) - len(options[0])]
        sentence = prefix + "_ " + req.continuations[0].lstrip()
        return {
            "sentence": sentence,
            "option1": options[0],
            "option2": options[1],
            "answer": str(gold + 1),
        }
    if t == "hellaswag":
        label, sep, ctx = req.context.partition(": ")
        if not sep:
            raise DataError(f"hellaswag: context {req.context!r:.80} has no 'label: ' head")
        return {
            "activity_label": label,
            "ctx_a": ctx,
            "ctx_b": "",
            "ctx": ctx,
            "endings": ch,
            "label": str(gold),
        }
    if t == "boolq":
        q = _strip(req.context, "Question: ", "?\nAnswer:", t)
        return {"question": q, "passage": "", "label": gold}
    raise DataError(f"no lm-eval document schema for task {t!r}")  # pragma: no cover


def write_tasks(examples: Sequence[Example], out_dir: str | Path) -> dict[str, list[int]]:
    """Write each task's documents (JSON lines) and its task YAML into `out_dir`. Returns per
    fedlora-registered lm-eval task name (``fedlora_<task>``) the indices into `examples` of
    its documents, in document order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks_dir = _lm_eval_tasks_dir()
    docs: dict[str, list[dict[str, Any]]] = {}
    where: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        req = harness_request(ex)
        docs.setdefault(req.task, []).append(_doc(ex, req))
        where.setdefault(_PREFIX + req.task, []).append(i)
    for task, rows in docs.items():
        data = out / f"{task}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        lines = [
            f"include: {json.dumps(str(tasks_dir / _TASK_YAMLS[task]))}",
            f"task: {_PREFIX}{task}",
            "tag: null",
            "dataset_path: json",
            "dataset_name: null",
            f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(data))}}}}}",
            "training_split: null",
            "validation_split: null",
            "fewshot_split: null",
            "test_split: test",
        ]
        if task == "boolq":  # no passage in LLM-Adapters' BoolQ
            lines.append('doc_to_text: "Question: {{question}}?\\nAnswer:"')
        (out / f"{_PREFIX}{task}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return where


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    work_dir: str | Path,
    *,
    batch_size: int = 16,
    quiet: bool = True,
) -> dict[int, HarnessQuestion]:
    """lm-eval's `simple_evaluate` (zero-shot, its HFLM on the model instance) on `examples`,
    written to `work_dir` by `write_tasks`. Returns per index into `examples` lm-eval's
    per-question result. `quiet`: lm-eval's and datasets' logs, warnings and progress bars
    are not shown (`quiet_libraries`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    where = write_tasks(examples, work_dir)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with quiet_libraries() if quiet else contextlib.nullcontext():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        manager = TaskManager(include_path=str(work_dir))
        results = simple_evaluate(
            model=lm,
            tasks=sorted(where),
            task_manager=manager,
            num_fewshot=0,
            log_samples=True,
            bootstrap_iters=0,
            verbosity="ERROR" if quiet else None,
        )
    out: dict[int, HarnessQuestion] = {}
    for name, idx in where.items():
        for s in results["samples"][name]:
            lls = tuple(
                float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0])
                for r in s["resps"]
            )
            d = int(s["doc_id"])
            out[idx[d]] = HarnessQuestion(
                name[len(_PREFIX) :], d, lls, float(s["acc"]), float(s.get("acc_norm", "nan"))
            )
    return out


_LIBRARY_LOGGERS = ("lm_eval", "lm-eval", "datasets", "transformers", "evaluate", "fsspec")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For the block: lm-eval's and datasets' log lines, Python warnings and progress bars
    (tqdm writes to ``sys.stderr``), and what child processes or C code write to file
    descriptor 2 (lm-eval runs ``git describe``), go nowhere. An exception still propagates
    (the command prints it as one line)."""
    levels = {name: logging.getLogger(name).level for name in _LIBRARY_LOGGERS}
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fd, null_fd = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    saved_stderr = sys.stderr
    os.dup2(null_fd, 2)
    sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stderr.close()
        sys.stderr = saved_stderr
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(null_fd)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
