"""``[data.mc]``: your own multiple-choice questions (docs/data.md, "Your own data"), the
files and the field map they are read through, declared once: `fedlora.llm.user_tasks` reads
the records through this dataclass.

    [data.mc]
    files = ["quiz_train.csv"]        # trained on, as task `task`
    eval_files = ["quiz_test.csv"]    # evaluated on, as that task
    choices = ["A", "B", "C", "D"]    # one field holding a list, or one field per choice
    answer_type = "label"             # index (0-based) | label (A, B, ... / the column) | text

The flat keys written before (``data.mc_files``, ..., ``data.mc_context``) are still read,
with a FutureWarning naming the new spelling (`fedlora.config.method_options.RENAMED_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedlora.config.checks import check_choice
from fedlora.errors import bad_value

ANSWER_TYPES = ("index", "label", "text")  # data.mc.answer_type
FILES_ALLOWED = "a list of paths (.json, .jsonl, .csv) or hf:owner/name[:config]@split"


@dataclass(frozen=True)
class McConfig:
    """Which files hold your questions and which record field holds what (``[data.mc]``)."""

    files: tuple[str, ...] = ()  # trained on (added to the training mix)
    eval_files: tuple[str, ...] = ()  # evaluated on (a seeded subset of data.eval_limit)
    task: str = "mine"  # the questions' task name (not a built-in task's)
    question: str = "question"
    choices: tuple[str, ...] = ("choices",)  # one field holding a list, or one per choice
    answer: str = "answer"
    answer_type: str = "index"  # index (0-based) | label (A, B, ... / the column) | text
    context: str = ""  # a passage read before the question; "" = none

    def __post_init__(self) -> None:
        for name in ("files", "eval_files", "choices"):  # a list given in Python: a tuple
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        for name in ("files", "eval_files"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                raise bad_value(f"data.mc.{name}", value, FILES_ALLOWED)
            if not all(isinstance(p, str) and p for p in value):
                raise bad_value(f"data.mc.{name}", list(value), FILES_ALLOWED)
        for name in ("task", "question", "answer"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                what = "a non-empty task name" if name == "task" else "a non-empty field name"
                raise bad_value(f"data.mc.{name}", value, what)
        choices = self.choices
        if (
            not isinstance(choices, tuple)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
            or len(set(choices)) != len(choices)
        ):
            shown_choices = list(choices) if isinstance(choices, tuple) else choices
            raise bad_value("data.mc.choices", shown_choices, "distinct field names")
        check_choice("data.mc.answer_type", self.answer_type, ANSWER_TYPES)
        if not isinstance(self.context, str):
            raise bad_value("data.mc.context", self.context, 'a field name, or "" for none')
