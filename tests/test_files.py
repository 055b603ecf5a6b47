"""fedlora.files: the readers of user files, one error style (the config key or the file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlora.errors import ConfigError
from fedlora.files import load_problem, read_vector
from planner_cases import raw_problem


def test_read_vector_json_list_object_and_csv(tmp_path: Path) -> None:
    (tmp_path / "q.json").write_text("[0.5, 1.0]")
    (tmp_path / "qk.json").write_text('{"q": [0.25], "k": [3]}')
    (tmp_path / "k.csv").write_text("client,k\n0,2\n1,4\n")
    assert read_vector(tmp_path / "q.json", "q") == [0.5, 1.0]
    assert read_vector(tmp_path / "qk.json", "k") == [3]
    assert read_vector(tmp_path / "k.csv", "k") == [2.0, 4.0]


def test_read_vector_accepts_a_spreadsheet_bom(tmp_path: Path) -> None:
    path = tmp_path / "q.csv"
    path.write_bytes("\ufeffq\n0.5\n".encode())
    assert read_vector(path, "q") == [0.5]


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("q.json", b"[0.5,", r"q\.json: invalid JSON at line 1"),
        ("q.json", b'{"k": [1]}', r"q\.json: no key 'q' \(keys: k\)"),
        ("q.json", b'{"q": 0.5}', r"expected a list of numbers for q"),
        ("q.csv", b"k\n1\n", r"expected a CSV with a column named 'q'"),
        ("q.csv", b"q\nhalf\n", r"column 'q' has a non-number"),
        ("q.csv", b"q\n\xff\xfe\n", r"method\.q = '.*q\.csv': not UTF-8 text"),
    ],
)
def test_read_vector_rejects_bad_files(tmp_path: Path, name: str, content: bytes, pattern: str):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=pattern):
        read_vector(path, "q")


def test_read_vector_names_the_key_of_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"method\.k = '.*nope\.csv': cannot read"):
        read_vector(tmp_path / "nope.csv", "k")


def test_default_cache_dir_follows_fedlora_cache(monkeypatch, tmp_path: Path) -> None:
    from fedlora.files import default_cache_dir
    from fedlora.llm import models

    monkeypatch.setenv("FEDLORA_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert models.default_cache_dir is default_cache_dir  # still importable from models
    monkeypatch.setenv("FEDLORA_CACHE", "  ")
    assert default_cache_dir() == Path.home() / ".cache" / "fedlora"


def test_load_problem_names_the_file_and_position_of_bad_json(tmp_path):
    path = tmp_path / "problem.json"
    path.write_text('{"gamma": 16,\n "f_tot": }\n')
    with pytest.raises(ConfigError, match=r"problem.json: invalid JSON at line 2 column 11"):
        load_problem(path)
    with pytest.raises(ConfigError, match=r"cannot read"):
        load_problem(tmp_path / "missing.json")


def test_load_problem_reads_the_documented_example(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw_problem()))
    p, o = load_problem(path, {"solver": "cvxpy"})
    assert o.solver == "cvxpy" and p.n == 2
