"""lm-evaluation-harness's zero-shot task definitions, rebuilt from LLM-Adapters records.

lm-evaluation-harness (0.4.x) scores a multiple-choice question as a set of
(context, continuation) requests: the summed log-likelihood of each continuation's tokens
after its context. For every task fedlora reads, its declaration
(`fedlora.llm.task_registry`) gives the same strings and this module applies it:

    (the table of every task's context and continuations is in `fedlora.llm.task_registry`)

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
from typing import Any

import numpy as np

from fedlora.config.eval_format import EvalFormat
from fedlora.errors import DataError
from fedlora.llm.prompts import IGNORE_INDEX, TokenizedSet, parse_options
from fedlora.llm.task_registry import (  # noqa: F401 (hellaswag_preprocess: a public name here)
    BUILTIN_TASKS,
    TASKS,
    find_task,
    get_task,
    hellaswag_preprocess,
)
from fedlora.llm.task_types import HarnessRequest, TaskSpec
from fedlora.llm.tasks import Example

# evaluation.format = "auto": harness below this many parameters (a small model answers the
# cloze form near its published score, the LLM-Adapters prompt near chance), else llm-adapters
HARNESS_MAX_PARAMS = 3_000_000_000

# fedlora task -> lm-eval task name (the built-in tasks; each declared in `task_registry`)
HARNESS_TASKS: dict[str, str] = {spec.name: spec.lm_eval for spec in BUILTIN_TASKS}


def harness_task(task: str) -> str:
    """The fedlora name of a task with an lm-eval definition (given its name or its
    LLM-Adapters folder name)."""
    spec = find_task(task)
    if spec is None:
        raise DataError(
            f"task {task!r} has no lm-evaluation-harness definition: evaluation.format = "
            f"'harness' supports {', '.join(TASKS)}; use evaluation.format = "
            "'llm-adapters' for other task files"
        )
    return spec.name


def _question(ex: Example, spec: TaskSpec) -> str:
    """The text between LLM-Adapters' lead-in and the first option marker / answer format."""
    text = ex.instruction
    lead = spec.lead_in
    if not text.startswith(lead):
        raise DataError(
            f"task {ex.task!r}: instruction {text!r:.100} does not start with the LLM-Adapters "
            f"lead-in {lead!r}"
        )
    stops = [m.start() for m in (re.search(r"\n?\s*Answer format:", text, re.IGNORECASE),) if m]
    for label in ex.labels if spec.option_word is not None else ():
        m = re.search(rf"(?<![A-Za-z0-9]){re.escape(label)}\s*:", text, re.IGNORECASE)
        if m is not None:
            stops.append(m.start())
    question = text[len(lead) : min(stops, default=len(text))].strip()
    if not question:
        raise DataError(f"task {ex.task!r}: empty question in {text!r:.100}")
    return question


def harness_request(ex: Example) -> HarnessRequest:
    """lm-eval's zero-shot requests for the question of `ex`: its task's declared request
    (`TaskSpec.request`) of the question, the options and the gold index."""
    spec = get_task(harness_task(ex.task))
    question = _question(ex, spec)
    options = ex.labels if spec.option_word is None else parse_options(ex)
    return spec.request(spec.lm_eval, question, options, ex.labels.index(ex.answer), ex.input)


def harness_training_text(ex: Example) -> tuple[str, str]:
    """(context, continuation) of the correct option: what a harness-format training example
    reads (the loss on the continuation and EOS)."""
    req = harness_request(ex)
    return req.contexts[req.gold], req.continuations[req.gold]


def resolve_eval_format(fmt: str, n_params: int, tasks: Sequence[str] = ()) -> EvalFormat:
    """evaluation.format made concrete: ``auto`` is ``harness`` for a model of fewer than
    `HARNESS_MAX_PARAMS` parameters whose `tasks` (training and eval) all have an lm-eval
    definition, else ``llm-adapters`` (the paper's protocol); a concrete format is itself."""
    fmt = EvalFormat(fmt)
    if fmt.auto:
        known = all(find_task(t) is not None for t in tasks)
        small = n_params < HARNESS_MAX_PARAMS
        return EvalFormat(EvalFormat.HARNESS if small and known else EvalFormat.LLM_ADAPTERS)
    return fmt


# ----------------------------------------------------------------------------- tokens


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])  # the tokenizer's own special tokens, as lm-eval


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's tokens of one request (HFLM ``_encode_pair``): trailing spaces of the context
    move to the continuation; the context's tokens alone, then the tokens of the whole string
    after as many tokens as the context has."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    ctx = _ids(tokenizer, context)
    return ctx, _ids(tokenizer, context + continuation)[len(ctx) :]


@dataclass(frozen=True)
class LengthReport:
    """Token lengths of the harness-format training examples (context + continuation + EOS)
    and how many were dropped for exceeding ``data.max_seq_len`` (none is ever cut)."""

    n: int
    dropped: int
    max_len: int
    p50: float
    p99: float
    longest: int

    def describe(self) -> str:
        return (
            f"training examples (harness format): {self.n - self.dropped} of {self.n} kept, "
            f"{self.dropped} dropped (longer than data.max_seq_len = {self.max_len} tokens; "
            f"none is cut); tokens p50 {self.p50:.0f}, p99 {self.p99:.0f}, max {self.longest}"
        )


def tokenize_harness(
    examples: Sequence[Example], tokenizer: Any, max_len: int
) -> tuple[TokenizedSet, list[int], LengthReport]:
    """Training in the format evaluated in: the task's context and the correct continuation
    (lm-eval's tokens, `encode_pair`) and EOS; loss on the continuation and EOS only.
    An example longer than `max_len` is dropped, never cut. Returns the tokenized set, the
    indices in `examples` it kept, and the length report."""
    if max_len < 2:
        raise DataError(f"max_len = {max_len!r} is invalid: must be >= 2")
    eos = getattr(tokenizer, "eos_token_id", None)
    ids_out, labels_out, kept, lengths = [], [], [], []
    for i, ex in enumerate(examples):
        ctx, cont = encode_pair(tokenizer, *harness_training_text(ex))
        target = cont + ([eos] if eos is not None else [])
        lengths.append(len(ctx) + len(target))
        if lengths[-1] > max_len:
            continue
        ids = np.asarray(ctx + target, dtype=np.int64)
        labels = ids.copy()
        labels[: len(ctx)] = IGNORE_INDEX
        ids_out.append(ids)
        labels_out.append(labels)
        kept.append(i)
    lens = np.asarray(lengths or [0], dtype=np.float64)
    report = LengthReport(
        n=len(examples),
        dropped=len(examples) - len(kept),
        max_len=max_len,
        p50=float(np.percentile(lens, 50)),
        p99=float(np.percentile(lens, 99)),
        longest=int(lens.max()),
    )
    return TokenizedSet(ids_out, labels_out), kept, report


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
