"""Paired tests on the questions: each evaluation writes, per task, which questions the adapter
answered right (predictions.jsonl); two runs' last evaluations pair on the question
ids they share, and McNemar's exact test compares them (one pair of runs, or pooled over the
seeds of two methods).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.errors import DataError
from fedlora.llm.eval_stats import mcnemar_p
from fedlora.studies.runs import RunRecord

PREDICTIONS_FILE = "predictions.jsonl"


def read_predictions(run_dir: Path) -> dict[str, dict[str, Any]]:
    """task -> the predictions line of the run's last evaluation of that task ({} if the run
    wrote none). A collected run's predictions.jsonl.gz (tools/collect_runs.py) is read when
    predictions.jsonl is absent."""
    path = Path(run_dir) / PREDICTIONS_FILE
    last: dict[str, dict[str, Any]] = {}
    packed = path.with_name(PREDICTIONS_FILE + ".gz")
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif packed.is_file():
        import gzip

        path, text = packed, gzip.decompress(packed.read_bytes()).decode("utf-8")
    else:
        return last
    for i, raw in enumerate(text.splitlines()):
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a torn line of a killed run
        if not isinstance(line, dict) or not {"round", "task", "ids", "correct"} <= set(line):
            raise DataError(f"{path}: line {i + 1} is not a fedlora predictions line")
        if line["task"] not in last or line["round"] >= last[line["task"]]["round"]:
            last[line["task"]] = line
    return last


@dataclass
class PairedTest:
    """McNemar's test of two runs' last evaluations on the questions they share."""

    task: str
    n: int  # paired questions
    both: int  # right in both runs
    a_only: int  # b: right only in run A
    b_only: int  # c: right only in run B
    neither: int
    p_value: float

    @property
    def accuracy_a(self) -> float:
        return (self.both + self.a_only) / self.n if self.n else math.nan

    @property
    def accuracy_b(self) -> float:
        return (self.both + self.b_only) / self.n if self.n else math.nan


def _keyed(line: dict[str, Any]) -> dict[tuple[str, int], int]:
    """(question id, occurrence) -> correct, so repeated questions pair in order."""
    seen: dict[str, int] = {}
    out = {}
    for qid, ok in zip(line["ids"], line["correct"]):
        k = seen.get(qid, 0)
        seen[qid] = k + 1
        out[(qid, k)] = int(ok)
    return out


def paired_tests(run_a: Path, run_b: Path) -> list[PairedTest]:
    """Per task both runs evaluated: McNemar on the questions of their last evaluations that
    both scored (matched by question id). A run without predictions.jsonl is an error."""
    pa, pb = read_predictions(run_a), read_predictions(run_b)
    for path, p in ((run_a, pa), (run_b, pb)):
        if not p:
            raise DataError(
                f"{str(path)!r} has no {PREDICTIONS_FILE} (older runs, or runs with "
                "evaluation.predictions = false, cannot be paired)"
            )
    tests = []
    for task in [t for t in pa if t in pb]:
        a, b = _keyed(pa[task]), _keyed(pb[task])
        common = [k for k in a if k in b]
        both = sum(1 for k in common if a[k] and b[k])
        a_only = sum(1 for k in common if a[k] and not b[k])
        b_only = sum(1 for k in common if b[k] and not a[k])
        neither = len(common) - both - a_only - b_only
        tests.append(
            PairedTest(task, len(common), both, a_only, b_only, neither, mcnemar_p(a_only, b_only))
        )
    return tests


def pooled_mcnemar(a: Sequence[RunRecord], b: Sequence[RunRecord], task: str) -> tuple | None:
    """McNemar's exact test on the questions of the last evaluations, pooled over the seeds
    (pairs of runs of one seed, `paired_tests`): (questions, only a right, only b right, p).
    None when a run has no predictions."""
    n = only_a = only_b = 0
    for x, y in zip(a, b):
        try:
            tests = [t for t in paired_tests(x.path, y.path) if t.task == task]
        except DataError:
            return None
        for t in tests:
            n, only_a, only_b = n + t.n, only_a + t.a_only, only_b + t.b_only
    return (n, only_a, only_b, mcnemar_p(only_a, only_b)) if n else None
