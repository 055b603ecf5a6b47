"""fedlora.federation.runfiles and metrics_file: atomic writes and metrics.jsonl, read back up
to a torn line and cut back to what a checkpoint recorded (split from test_rundir.py, issue 11)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from fedlora.errors import DataError
from fedlora.federation.metrics_file import append_metrics, read_metrics_lines, restore_metrics
from fedlora.federation.runfiles import os_error_message
from fedlora.files import atomic_write

R0, R1 = '{"round": 0, "sim_time_s": 0.0}', '{"round": 1, "sim_time_s": 1.0}'


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text("old")
    atomic_write(path, b"new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_atomic_write_to_a_folder_is_refused_before_writing_and_names_it(tmp_path: Path) -> None:
    folder = tmp_path / "report.md"
    folder.mkdir()
    (folder / "mine.txt").write_text("the user's")
    with pytest.raises(IsADirectoryError) as e:
        atomic_write(folder, b"new")
    assert e.value.filename == str(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]  # no report.md.tmp
    assert (folder / "mine.txt").read_text() == "the user's"


def test_atomic_write_whose_rename_fails_removes_its_temporary(tmp_path, monkeypatch) -> None:
    import errno
    import os

    def fail(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", src, None, dst)

    path = tmp_path / "summary.json"
    path.write_text("old")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError) as e:
        atomic_write(path, b"new")
    assert e.value.errno == errno.EXDEV and e.value.filename == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert path.read_text() == "old"


def test_metrics_lines_drop_a_torn_last_line_and_refuse_a_foreign_middle_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    append_metrics(path, {"round": 0, "sim_time_s": 0.0})
    append_metrics(path, {"round": 1, "sim_time_s": 1.0})
    assert read_metrics_lines(path) == [R0, R1]
    path.write_text(f'{R0}\n{R1}\n{{"rou')
    assert read_metrics_lines(path) == [R0, R1]
    path.write_text(f'{R0}\n[1, 2]\n{R1}\n{{"rou')
    with pytest.raises(DataError, match="line 2 is not a fedlora metrics line"):
        read_metrics_lines(path)
    assert read_metrics_lines(tmp_path / "missing.jsonl") == []


def test_metrics_that_are_not_utf8_are_a_data_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"round": 0}\n\xff\n')
    with pytest.raises(DataError, match="metrics.jsonl.*not UTF-8"):
        read_metrics_lines(path)


def test_a_full_disk_is_named_in_the_message() -> None:
    e = OSError(errno.ENOSPC, "No space left on device", "/run/x/metrics.jsonl")
    assert os_error_message(e).startswith("no space left on device while writing '/run/x/")


def test_old_checkpoint_with_missing_rounds_is_refused_naming_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{R0}\n{R1}\n{{"rou')
    with pytest.raises(DataError, match=r"holds 2 complete lines .* recorded 4 \(rounds 2..3"):
        restore_metrics(path, {"progress": {"metrics_lines": 4}})
    restore_metrics(path, {"progress": {"metrics_lines": 1}})
    assert path.read_text() == R0 + "\n"
