"""Every bad input of tests/reliability_cases.py: exit 2, one error line, no traceback, no
file lost or changed (the table of docs/reliability.md is generated from the same cases)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability_cases import CASES, DATA, make_finished_run, message, run_case
from reliability_table import TABLE_CASES

pytestmark = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "run"
    make_finished_run(path)
    return path


def test_at_least_forty_cases_with_distinct_names():
    names = [c.name for c in CASES]
    assert len(names) >= 40 and len(set(names)) == len(names)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_exit_2_and_loses_nothing(case, template, tmp_path):
    out = run_case(case, tmp_path / "case", template)
    assert out.rc == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert "error:" in out.stderr, out.stderr
    assert case.expect in out.stderr, out.stderr
    assert out.lost == [], f"changed or removed: {out.lost}"
    assert out.present == [], f"must not exist: {out.present}"
    assert message(out, tmp_path / "case")


def test_docs_table_lists_every_case():
    text = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "| 2 |" in line]
    assert len(rows) == len(TABLE_CASES)  # with the other case files' (reliability_table)
    for case in CASES:
        assert f"| {case.name} |" in text, case.name
