"""Issue 24: a full disk while a run writes a checkpoint or its adapter, and a damaged
predictions.jsonl on resume (refused with its remedy, which then works).

The full disk is real: the temporary file the write goes through is /dev/full, so the kernel
answers ENOSPC (no root; fedlora never writes through a link, so /dev/full is handed to its
one opener of written files, `reliability_cases.dev_full_at`). Each case must exit 2 with one
line naming the file and "no space left", keep the previous checkpoint (or adapter) byte for
byte, and resume to the end once there is space again."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from fedlora.cli import main
from reliability_cases import DATA, dev_full_at, make_finished_run

pytestmark = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "run"
    make_finished_run(path)
    return path


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    return lines[0]


def test_disk_full_while_writing_a_checkpoint(template, tmp_path, capsys) -> None:
    # Prepare: a finished 2-round run, continued to round 3 on a disk that is full
    run = tmp_path / "run"
    shutil.copytree(template, run)
    before = _hashes(run / "checkpoints")
    undo = dev_full_at(run / "checkpoints" / "round-000003.safetensors.tmp")
    argv = ["run", "--resume", str(run), "--force", "training.rounds=3", "-q"]
    # Execute
    try:
        rc, err = _run(argv, capsys)
    finally:
        undo()
    # Assert: exit 2, one line naming the file; the older checkpoints as they were, no .tmp
    assert rc == 2, err
    line = _one_error_line(err)
    path = run / "checkpoints" / "round-000003.safetensors"
    assert f"no space left on device while writing {str(path)!r}" in line
    assert _hashes(run / "checkpoints") == before
    # ... and with space again the same command finishes the run
    rc, err = _run(argv, capsys)
    assert rc == 0, err
    rounds = [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["rounds"] == 3


@pytest.mark.parametrize(
    "name", ["adapter_model.safetensors", "adapter_config.json", "fedlora_adapter.json"]
)
def test_disk_full_while_writing_the_adapter(name, template, tmp_path, capsys) -> None:
    # Prepare: a finished run whose adapter is written again (resume) on a full disk
    run = tmp_path / "run"
    shutil.copytree(template, run)
    adapter = _hashes(run / "adapter")
    undo = dev_full_at(run / "adapter" / f"{name}.tmp")
    # Execute
    try:
        rc, err = _run(["run", "--resume", str(run), "-q"], capsys)
    finally:
        undo()
    # Assert: exit 2, one line naming the file; the old file whole; the checkpoint resumable
    assert rc == 2, err
    line = _one_error_line(err)
    assert f"no space left on device while writing {str(run / 'adapter' / name)!r}" in line
    assert _hashes(run / "adapter")[name] == adapter[name]
    assert not (run / "adapter" / f"{name}.tmp").exists()
    rc, err = _run(["run", "--resume", str(run), "-q"], capsys)
    assert rc == 0, err
    assert _hashes(run / "adapter") == adapter  # the same adapter, byte for byte


def test_damaged_predictions_file_is_refused_then_moved_away(template, tmp_path, capsys) -> None:
    # Prepare: predictions.jsonl changed outside fedlora (not UTF-8); two more rounds asked
    run = tmp_path / "run"
    shutil.copytree(template, run)
    damaged = (run / "predictions.jsonl").read_bytes() + b"\xff\n"
    (run / "predictions.jsonl").write_bytes(damaged)
    argv = ["run", "--resume", str(run), "--force", "training.rounds=3", "-q"]
    # Execute / Assert: refused the same way each time, the file kept as it was
    for _ in range(2):
        rc, err = _run(argv, capsys)
        assert rc == 2 and "move it away to resume" in _one_error_line(err)
        assert (run / "predictions.jsonl").read_bytes() == damaged
    # ... the remedy the message gives: move it away, resume; round 3's predictions written
    (run / "predictions.jsonl").rename(tmp_path / "predictions.jsonl")
    rc, err = _run(argv, capsys)
    assert rc == 0, err
    lines = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]
    assert {x["round"] for x in lines} == {3}
