"""research/study_planner/study_planner.py park: an unfinished run's resumable state is committed (its files,
its marker, its newest checkpoint only) and untracked again once the run has finished."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tiny_runs import load_script


def _bench():
    return load_script("research/study_planner/study_planner.py")


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(
        ["git", *argv], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def _tracked(repo: Path) -> set[str]:
    return set(_git(repo, "ls-files").split())


def _run_dir(path: Path, rounds: tuple[int, ...], done: bool = False) -> None:
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.toml").write_text("[training]\nrounds = 10\n")
    (path / "metrics.jsonl").write_text('{"round": 1}\n')
    (path / ".fedlora-run.json").write_text("{}")
    (path / ".lock").write_text("123")
    for r in rounds:
        (path / "checkpoints" / f"round-{r:06d}.safetensors").write_bytes(b"x")
        (path / "checkpoints" / f"round-{r:06d}.pt").write_bytes(b"y")
    if done:
        (path / "summary.json").write_text(json.dumps({"rounds": 10}))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    # the project's rule: checkpoints and markers of study runs are ignored
    (tmp_path / ".gitignore").write_text(
        "results/study*/**/checkpoints/\nresults/study*/**/.lock\n"
        "results/study*/**/.fedlora-run.json\n"
    )
    _git(tmp_path, "add", ".gitignore")
    _git(tmp_path, "commit", "-q", "-m", "init")
    return tmp_path


def test_park_commits_the_newest_checkpoint_then_untracks_it_once_finished(repo: Path) -> None:
    bench = _bench()
    out = repo / "results" / "study_x"
    _run_dir(out / "pilot" / "a-seed7", (5, 10))
    _run_dir(out / "pilot" / "b-seed7", (5,), done=True)
    parked = bench.park(out)
    assert parked == [Path("pilot/a-seed7")]
    a = "results/study_x/pilot/a-seed7"
    assert _tracked(repo) == {
        ".gitignore",
        f"{a}/config.toml",
        f"{a}/metrics.jsonl",
        f"{a}/.fedlora-run.json",
        f"{a}/checkpoints/round-000010.safetensors",
        f"{a}/checkpoints/round-000010.pt",
    }
    assert _git(repo, "status", "--porcelain", "--untracked-files=no") == ""
    # the run goes on (a newer checkpoint, the older one rotated away), parked again
    (out / "pilot" / "a-seed7" / "checkpoints" / "round-000010.pt").unlink()
    (out / "pilot" / "a-seed7" / "checkpoints" / "round-000010.safetensors").unlink()
    for suffix in ("safetensors", "pt"):
        (out / "pilot" / "a-seed7" / "checkpoints" / f"round-000015.{suffix}").write_bytes(b"z")
    bench.park(out)
    assert {n for n in _tracked(repo) if "/checkpoints/" in n} == {
        f"{a}/checkpoints/round-000015.safetensors",
        f"{a}/checkpoints/round-000015.pt",
    }
    # finished: its state leaves the index (its results are the runner's --commit's job)
    (out / "pilot" / "a-seed7" / "summary.json").write_text(json.dumps({"rounds": 10}))
    assert bench.park(out) == []
    assert {n for n in _tracked(repo) if "/checkpoints/" in n or n.endswith(".json")} == set()
    assert (out / "pilot" / "a-seed7" / "checkpoints" / "round-000015.pt").is_file()
    assert _git(repo, "status", "--porcelain", "--untracked-files=no") == ""


def test_park_refuses_when_other_changes_are_staged(repo: Path) -> None:
    from fedlora.errors import ConfigError

    out = repo / "results" / "study_x"
    _run_dir(out / "pilot" / "a-seed7", (5,))
    (repo / "notes.txt").write_text("mine")
    _git(repo, "add", "notes.txt")
    with pytest.raises(ConfigError, match="staged changes"):
        _bench().park(out)
    assert _tracked(repo) == {".gitignore", "notes.txt"}
