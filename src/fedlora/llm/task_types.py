"""What a task is declared with: a `TaskSpec` (one task's files, hub source, lm-eval request,
lead-in and metrics) and the `HarnessRequest` its request builder returns (one question as
lm-evaluation-harness's loglikelihood requests). The built-in declarations live in
`fedlora.llm.task_registry`; the questions themselves are `fedlora.llm.tasks.Example`s."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedlora.errors import DataError

TARGET_DELIMITER = " "  # lm-eval's default target_delimiter


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


def shared_request(name: str, context: str, choices: Sequence[str], gold: int) -> HarnessRequest:
    """The request of a task whose options share one context: each option is scored as
    ``" " + option`` after it."""
    conts = tuple(TARGET_DELIMITER + c for c in choices)
    return HarnessRequest(name, (context,) * len(choices), conts, tuple(choices), gold)


# (lm-eval name, question, options, gold, the record's input) -> the request
RequestBuilder = Callable[[str, str, tuple[str, ...], int, str], HarnessRequest]
# a hub record -> (question, options, gold): what follows the lead-in, the option texts
HubReader = Callable[[Mapping[str, Any]], tuple[str, Sequence[str], int]]


@dataclass(frozen=True)
class HubSource:
    """Where a task lives on the Hugging Face hub and how one of its records reads."""

    repo: str
    config: str | None
    splits: Mapping[str, str]  # our split (train | test) -> the hub's split
    read: HubReader


@dataclass(frozen=True)
class TaskSpec:
    """One task, declared once. `folder`: its folder in the LLM-Adapters layout;
    `lm_eval`: lm-evaluation-harness's task name; `lead_in`: the text LLM-Adapters writes
    before the question; `option_word`: the options' marker word (``answer`` writes
    ``Answer1: ...`` and labels ``answer1``..), or None when the labels are the options
    themselves (true/false); `request`: the lm-eval requests of one question; `hub`: its hub
    source (None: local files only); `metrics`: what lm-eval reports for it."""

    name: str
    folder: str
    lm_eval: str
    lead_in: str
    option_word: str | None
    request: RequestBuilder
    hub: HubSource | None = None
    metrics: tuple[str, ...] = ("acc", "acc_norm")

    def __post_init__(self) -> None:
        if not self.name or not self.lm_eval or not self.lead_in:
            raise DataError(
                f"task {self.name!r}: name, lm_eval and lead_in must be non-empty strings"
            )
        if not self.metrics or not set(self.metrics) <= {"acc", "acc_norm"}:
            raise DataError(
                f"task {self.name!r}: metrics = {list(self.metrics)!r} is invalid: "
                "allowed: acc, acc_norm (acc first)"
            )
