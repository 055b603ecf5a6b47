"""lm-evaluation-harness's zero-shot task definitions, rebuilt from LLM-Adapters records.

lm-evaluation-harness (0.4.x) scores a multiple-choice question as a set of
(context, continuation) requests: the summed log-likelihood of each continuation's tokens
after its context. For every task fedlora reads, this module gives the same strings:

    task (fedlora / lm-eval)        context                         continuations
    arc-e, arc-c / arc_easy, ...    "Question: {question}\\nAnswer:"  " {option}"
    obqa / openbookqa               "{question_stem}"                " {option}"
    piqa / piqa                     "Question: {goal}\\nAnswer:"      " {solution}"
    siqa / social_iqa               "Q: {context} {question}\\nA:"    " {answer}"
    hellaswag / hellaswag           preprocess("{label}: {ctx}")     " " + preprocess(ending)
    winogrande / winogrande         sentence[:blank] + option        " " + sentence after blank
    boolq / boolq                   "Question: {question}?\\nAnswer:" " no", " yes"

(target_delimiter " "; no few-shot examples, no description, no BOS.) Winogrande is
"partial scoring": the context varies per option and the continuation is the shared tail.
LLM-Adapters' BoolQ records carry no passage, so fedlora's BoolQ context is lm-eval's
template without its ``{passage}\\n`` line (docs/data.md lists each field's source).

The metrics are lm-eval's: ``acc`` is the arg-max of the summed log-likelihoods (ties: the
first), ``acc_norm`` the arg-max of the log-likelihood divided by the length in characters of
lm-eval's *choice* string (the option text without the leading delimiter; for winogrande the
per-option context). ``mc_loss`` is −log softmax over the options' scores of the gold one
(chance: ln n_options).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedlora.errors import DataError
from fedlora.llm.prompts import parse_options
from fedlora.llm.tasks import TASK_FOLDERS, Example

TARGET_DELIMITER = " "  # lm-eval's default target_delimiter

# fedlora task -> lm-eval task name
HARNESS_TASKS: dict[str, str] = {
    "arc-e": "arc_easy",
    "arc-c": "arc_challenge",
    "obqa": "openbookqa",
    "piqa": "piqa",
    "siqa": "social_iqa",
    "winogrande": "winogrande",
    "hellaswag": "hellaswag",
    "boolq": "boolq",
}
_FOLDER_TASKS = {folder: task for task, folder in TASK_FOLDERS.items()}

# the lead-in LLM-Adapters writes before the question, per task
_LEAD_INS: dict[str, str] = {
    "arc-e": "Please choose the correct answer to the question:",
    "arc-c": "Please choose the correct answer to the question:",
    "obqa": "Please choose the correct answer to the question:",
    "siqa": "Please choose the correct answer to the question:",
    "piqa": "Please choose the correct solution to the question:",
    "winogrande": (
        "Please choose the correct answer to fill in the blank to complete the given sentence:"
    ),
    "hellaswag": "Please choose the correct ending to complete the given sentence:",
    "boolq": "Please answer the following question with true or false, question:",
}


@dataclass(frozen=True)
class HarnessRequest:
    """One question as lm-eval's loglikelihood requests: option i is scored as the
    continuation ``continuations[i]`` after ``contexts[i]``. ``choices[i]`` is lm-eval's
    choice string (its length in characters normalises ``acc_norm``); ``gold`` indexes them."""

    task: str  # the lm-eval task name
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    choices: tuple[str, ...]
    gold: int

    def __post_init__(self) -> None:
        n = len(self.choices)
        if n < 2 or len(self.contexts) != n or len(self.continuations) != n:
            raise DataError(
                f"{self.task}: a request needs >= 2 options with one context and continuation "
                f"each, got {len(self.contexts)} contexts, {len(self.continuations)} "
                f"continuations, {n} choices"
            )
        if not 0 <= self.gold < n:
            raise DataError(f"{self.task}: gold = {self.gold} is not in 0..{n - 1}")

    @property
    def shared_context(self) -> bool:
        """Whether every option has the same context (all tasks but winogrande)."""
        return len(set(self.contexts)) == 1

    @property
    def context(self) -> str:
        """The context all options share (raises for winogrande's per-option contexts)."""
        if not self.shared_context:
            raise ValueError(f"{self.task}: the options have different contexts")
        return self.contexts[0]

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """(context, continuation) per option: lm-eval's loglikelihood requests."""
        return list(zip(self.contexts, self.continuations))


def harness_task(task: str) -> str:
    """The lm-eval task name of a fedlora task (or of its LLM-Adapters folder name)."""
    key = _FOLDER_TASKS.get(task, task)
    if key not in HARNESS_TASKS:
        raise DataError(
            f"task {task!r} has no lm-evaluation-harness definition: evaluation.format = "
            f"'harness' supports {', '.join(HARNESS_TASKS)}; use evaluation.format = "
            "'llm-adapters' for other task files"
        )
    return key


def _question(ex: Example, task: str) -> str:
    """The text between LLM-Adapters' lead-in and the first option marker / answer format."""
    text = ex.instruction
    lead = _LEAD_INS[task]
    if not text.startswith(lead):
        raise DataError(
            f"task {ex.task!r}: instruction {text!r:.100} does not start with the LLM-Adapters "
            f"lead-in {lead!r}"
        )
    stops = [m.start() for m in (re.search(r"\n?\s*Answer format:", text, re.IGNORECASE),) if m]
    for label in ex.labels if task != "boolq" else ():
        m = re.search(rf"(?<![A-Za-z0-9]){re.escape(label)}\s*:", text, re.IGNORECASE)
        if m is not None:
            stops.append(m.start())
    question = text[len(lead) : min(stops, default=len(text))].strip()
    if not question:
        raise DataError(f"task {ex.task!r}: empty question in {text!r:.100}")
    return question


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag text cleaning (WikiHow's bracket artifacts, double spaces)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _shared(task: str, context: str, choices: Sequence[str], gold: int) -> HarnessRequest:
    conts = tuple(TARGET_DELIMITER + c for c in choices)
    return HarnessRequest(task, (context,) * len(choices), conts, tuple(choices), gold)


def harness_request(ex: Example) -> HarnessRequest:
    """lm-eval's zero-shot requests for the question of `ex` (see the module docstring)."""
    task = harness_task(ex.task)
    name = HARNESS_TASKS[task]
    question = _question(ex, task)
    if task == "boolq":
        if ex.answer not in ("true", "false"):
            raise DataError(f"task {ex.task!r}: answer {ex.answer!r} is not true/false")
        q = question[:-1] if question.endswith("?") else question  # LLM-Adapters added "?"
        return _shared(name, f"Question: {q}?\nAnswer:", ("no", "yes"), int(ex.answer == "true"))
    options = parse_options(ex)
    gold = ex.labels.index(ex.answer)
    if task in ("arc-e", "arc-c", "piqa"):
        return _shared(name, f"Question: {question}\nAnswer:", options, gold)
    if task == "obqa":
        return _shared(name, question, options, gold)
    if task == "siqa":  # LLM-Adapters joined "{context} {question}" with one space
        return _shared(name, f"Q: {question}\nA:", options, gold)
    if task == "hellaswag":
        return _shared(
            name,
            hellaswag_preprocess(question),
            [hellaswag_preprocess(o) for o in options],
            gold,
        )
    # winogrande: partial scoring, the blank filled by each option, the rest scored
    blank = question.find("_")
    if blank < 0:
        raise DataError(f"task {ex.task!r}: no '_' blank in sentence {question!r:.100}")
    contexts = tuple(question[:blank] + o for o in options)
    tail = TARGET_DELIMITER + question[blank + 1 :].strip()
    return HarnessRequest(name, contexts, (tail,) * len(options), contexts, gold)


def harness_training_text(ex: Example) -> tuple[str, str]:
    """(context, continuation) of the correct option: what a harness-format training example
    reads (the loss on the continuation and EOS)."""
    req = harness_request(ex)
    return req.contexts[req.gold], req.continuations[req.gold]


# ----------------------------------------------------------------------------- metrics


def acc_pred(logliks: Sequence[float]) -> int:
    """lm-eval's ``acc`` prediction: the arg-max of the summed log-likelihoods (ties: first)."""
    return int(np.argmax(np.asarray(logliks, dtype=np.float64)))


def acc_norm_pred(logliks: Sequence[float], choices: Sequence[str]) -> int:
    """lm-eval's ``acc_norm`` prediction: arg-max of loglik / len(choice) in characters."""
    lens = np.array([float(len(c)) for c in choices])
    if len(lens) != len(logliks) or np.any(lens == 0):
        raise DataError(f"acc_norm needs one non-empty choice per option, got {list(choices)!r}")
    return int(np.argmax(np.asarray(logliks, dtype=np.float64) / lens))


def mc_loss(scores: Sequence[float], gold: int) -> float:
    """−log softmax(scores)[gold]: the loss that falls only as the gold option gains on the
    others (ln n for equal scores)."""
    s = np.asarray(scores, dtype=np.float64)
    m = float(np.max(s))
    return float(m + math.log(float(np.sum(np.exp(s - m)))) - s[gold])
