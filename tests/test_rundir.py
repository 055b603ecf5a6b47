"""The run directory (issue 15): resume keeps the saved config, --overwrite never loses data,
an old run directory resumes, metrics agree with checkpoints, one writer at a time, and a run
killed at random points resumes bit-identically. The bad-input cases themselves (exit 2,
one line) are in tests/reliability_cases.py; the checkpoint files in test_checkpoints.py, the
metrics file in test_runfiles.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fedlora.federation.engine as engine
from fedlora.cli import main
from fedlora.config import dump_toml, load_config, toml_string
from fedlora.errors import ConfigError
from fedlora.federation.checkpoints import load_checkpoint
from fedlora.federation.metrics_file import read_metrics_lines
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.federation.rundir import run_dir_lock
from reliability_cases import DATA, TINY

pytestmark = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


def _main(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, err.getvalue()


def _rounds(run_dir: Path) -> list[int]:
    return [json.loads(x)["round"] for x in read_metrics_lines(run_dir / "metrics.jsonl")]


def _without_timing(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in read_metrics_lines(run_dir / "metrics.jsonl")]
    for line in lines:
        line.pop("compute_s", None)
    return lines


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def _same_run(a: Path, b: Path) -> None:
    assert _without_timing(a) == _without_timing(b)
    x, y = _adapter(a), _adapter(b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("wall_s", "compute_s"):
        sa.pop(key), sb.pop(key)
    assert sa == sb


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished two-round tiny run (checkpoints at rounds 1 and 2)."""
    path = tmp_path_factory.mktemp("finished") / "run"
    assert _main("run", *TINY, "--out", str(path), "-q")[0] == 0
    return path


def _copy(finished: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


# ----------------------------------------------------------------------------- 1. --force


def test_resume_force_applies_the_override_on_the_saved_config(finished, tmp_path):
    run = _copy(finished, tmp_path)
    saved = load_config(run / "config.toml")
    rc, err = _main("run", "--resume", str(run), "--force", "training.rounds=3", "-q")
    assert rc == 0, err
    now = load_config(run / "config.toml")
    assert now == saved.replace(training=saved.training.__class__(
        **{**saved.training.__dict__, "rounds": 3}))  # fmt: skip
    assert _rounds(run) == [0, 1, 2, 3]
    # and the directory stays resumable
    assert _main("run", "--resume", str(run), "-q")[0] == 0


def test_resume_refusal_names_only_the_changed_keys(finished, tmp_path):
    run = _copy(finished, tmp_path)
    rc, err = _main("run", "--resume", str(run), "training.rounds=3", "training.lr=0.5")
    assert rc == 2
    assert "in training.rounds, training.lr; use --force" in err


def test_resume_with_the_same_out_is_accepted(finished, tmp_path):
    run = _copy(finished, tmp_path)
    assert _main("run", "--resume", str(run), "--out", str(run), "-q")[0] == 0


# ----------------------------------------------------------------------------- 2. --overwrite


def test_overwrite_replaces_a_run_and_keeps_its_lock(finished, tmp_path):
    run = _copy(finished, tmp_path)
    (run / ".lock").write_text("1\n")
    rc, err = _main("run", *TINY, "training.rounds=1", "--out", str(run), "--overwrite", "-q")
    assert rc == 0, err
    assert _rounds(run) == [0, 1] and (run / ".lock").exists()


def test_a_run_that_failed_before_its_first_round_is_reused(tmp_path):
    out = tmp_path / "failed"
    prepare_run_dir(load_config(None, TINY), out)  # what a run that died while loading leaves
    (out / "clients.csv.tmp").write_text("partial")
    rc, err = _main("run", *TINY, "training.rounds=1", "--out", str(out), "-q")
    assert rc == 0, err
    assert _rounds(out) == [0, 1]


def test_overwrite_refused_before_validation_keeps_every_file(tmp_path):
    # the reproduction: a user directory holding a config.toml
    p = tmp_path / "P"
    (p / "src").mkdir(parents=True)
    for rel in ("config.toml", "notes.txt", "src/a.py"):
        (p / rel).write_text("x")
    rc, err = _main("run", *TINY, "--out", str(p), "--overwrite", "--data-dir", "/nonexistent")
    assert rc == 2
    assert sorted(x.name for x in p.rglob("*")) == ["a.py", "config.toml", "notes.txt", "src"]


# ----------------------------------------------------------------------------- 3. checkpoints


def test_an_old_run_directory_resumes_bit_identically(finished, tmp_path):
    """A run of an older fedlora (round-*.pt, no metrics lines in it) resumes as before."""
    run = _copy(finished, tmp_path)
    state = load_checkpoint(run)
    assert state["round"] == 2
    for p in (run / "checkpoints").iterdir():
        p.unlink()
    del state["metrics"]
    state["progress"] = {**state["progress"]}
    torch.save(state, run / "checkpoints/round-000002.pt")
    rc, err = _main("run", "--resume", str(run), "--force", "training.rounds=3", "-q")
    assert rc == 0, err
    ref = tmp_path / "ref"
    assert _main("run", *TINY, "training.rounds=3", "--out", str(ref), "-q")[0] == 0
    _same_run(ref, run)


# ----------------------------------------------------------------------------- 4. metrics


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b"", id="emptied"),
        pytest.param(lambda b: b[: len(b) // 2], id="truncated-mid-line"),
        pytest.param(lambda b: b"\xff\xfe" + b[5:], id="not-utf8"),
        pytest.param(lambda b: b + b'{"round": 7}\n', id="extra-line"),
    ],
)
def test_resume_rewrites_a_damaged_metrics_file_from_the_checkpoint(finished, tmp_path, damage):
    run = _copy(finished, tmp_path)
    want = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(damage(want))
    rc, err = _main("run", "--resume", str(run), "-q")
    assert rc == 0, err
    assert (run / "metrics.jsonl").read_bytes() == want
    # lines after the checkpoint are normal (rounds it will redo): no warning for those
    assert ("rewrote its 3 lines" in err) == (damage(b"x\n") != b'x\n{"round": 7}\n')
    assert _main("report", str(run), "--target", "arc-e=0.5")[0] == 0


# ----------------------------------------------------------------------------- 5. lock


def test_lock_is_exclusive_across_processes_and_within_one(tmp_path):
    code = (
        "import sys; from fedlora.federation.rundir import run_dir_lock\n"
        "try:\n    with run_dir_lock(sys.argv[1]): pass\n"
        "except Exception as e: print(e); sys.exit(2)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    with run_dir_lock(tmp_path):
        # taken once per run: a second take in this process is refused too (not re-entrant)
        with pytest.raises(ConfigError, match=f"in use by process {os.getpid()}"):
            with run_dir_lock(tmp_path):
                pass
        other = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env
        )
        assert other.returncode == 2
        assert f"in use by process {os.getpid()}" in other.stdout
    free = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env)
    assert free.returncode == 0


# ----------------------------------------------------------------------------- 8. smaller


def test_data_dir_with_a_quote_and_overrides_after_options(tmp_path):
    odd = tmp_path / 'it\'s "here"'
    odd.symlink_to(Path(DATA).resolve())  # a relative FEDLORA_DATA (make test) must not dangle
    out = tmp_path / "out"
    tiny = [t for t in TINY if not t.startswith("data.data_dir")]
    rc, err = _main("run", *tiny[:3], "--out", str(out), *tiny[3:8], "--data-dir", str(odd),
                    *tiny[8:], "training.rounds=1", "-q")  # fmt: skip
    assert rc == 0, err
    cfg = load_config(out / "config.toml")
    assert cfg.data.data_dir == str(odd) and cfg.data.n_clients == 2 and cfg.training.rounds == 1


def test_an_override_after_an_option_is_parsed_as_one():
    rc, err = _main("run", "--out", "/nonexistent/x", "training.rounds=1", "-q", "training.lr=-1")
    assert rc == 2 and "training.lr = -1" in err


def test_control_characters_survive_the_config_file(tmp_path):
    name = "a\x01b\x7fc\td\ne\"f\\g'h\x1f"
    cfg = load_config(None, [f"output.name={toml_string(name)}"])
    assert cfg.output.name == name
    (tmp_path / "c.toml").write_text(dump_toml(cfg), encoding="utf-8")
    assert load_config(tmp_path / "c.toml") == cfg


def test_plan_refuses_a_degenerate_result():
    from fedlora.system.planner import Constants, PlanResult, check_plan

    good = PlanResult(np.array([0.5, 1.0]), np.array([2, 4]), 3.0, 1.0, 3.0,
                      Constants(1, 1, 1, 1), 1, "exact", "fixed_point")  # fmt: skip
    check_plan(good)
    for q, objective in (([0.0, 1.0], 3.0), ([0.5, 1.0], float("inf"))):
        bad = PlanResult(np.array(q), good.k, objective, 1.0, 3.0, good.constants, 1, "exact", "x")
        with pytest.raises(ConfigError, match="no usable plan"):
            check_plan(bad)


def test_preflight_runs_before_the_model_loads(monkeypatch, tmp_path):
    import fedlora.llm.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(fedlora.llm.models, "load_model", no_load)
    for bad in ('data.tasks=["arc-x"]', "lora.layers=3", "data.eval_tasks=[]",
                'data.task_files=["/nope.json"]', 'network.profiles_file="/nope.csv"'):  # fmt: skip
        out = tmp_path / bad[:6]
        rc, err = _main("run", *TINY, bad, "--out", str(out))
        assert rc == 2 and "error:" in err, (bad, err)
        assert not out.exists()


# ----------------------------------------------------------------------------- kill and resume


class _Killed(BaseException):
    """A simulated SIGKILL: nothing after it runs (not even `except Exception`)."""


class _Killer:
    """Counts the run's durable writes (fsync, rename, metrics line) and dies at one of them:
    before a rename (the .tmp is left), after a write but before its fsync, or halfway
    through a metrics line (a torn line)."""

    def __init__(self, monkeypatch) -> None:
        self.events = 0
        self.kill_at: int | None = None
        fsync, replace, append = os.fsync, os.replace, engine.append_metrics

        def hit() -> bool:
            self.events += 1
            return self.kill_at is not None and self.events == self.kill_at

        def k_fsync(fd):
            if hit():
                raise _Killed
            return fsync(fd)

        def k_replace(src, dst):
            if hit():
                raise _Killed
            return replace(src, dst)

        def k_append(path, line):
            if hit():
                with open(path, "a", encoding="utf-8") as f:
                    text = json.dumps(line)
                    f.write(text[: len(text) // 2])
                raise _Killed
            return append(path, line)

        monkeypatch.setattr(os, "fsync", k_fsync)
        monkeypatch.setattr(os, "replace", k_replace)
        monkeypatch.setattr(engine, "append_metrics", k_append)

    def run(self, cfg, run_dir: Path, *, resume: bool, kill_at: int | None) -> bool:
        """True when the run finished, False when it was killed."""
        self.events, self.kill_at = 0, kill_at
        try:
            run_experiment(cfg, run_dir, resume=resume, quiet=True, log=lambda m: None)
        except _Killed:
            return False
        return True


def test_killed_at_random_points_resumes_bit_identically(tmp_path, monkeypatch):
    extra = ["training.rounds=4", "training.checkpoint_every=2", "training.eval_every=2"]
    cfg = load_config(None, [*TINY, *extra])
    killer = _Killer(monkeypatch)
    ref = tmp_path / "ref"
    prepare_run_dir(cfg, ref)
    assert killer.run(cfg, ref, resume=False, kill_at=None)
    total = killer.events  # durable writes of an uninterrupted run
    rng = np.random.default_rng(15)
    kills = 0
    for trial, first in enumerate(sorted(rng.choice(np.arange(1, total + 1), 10, replace=False))):
        run_dir = tmp_path / f"t{trial}"
        prepare_run_dir(cfg, run_dir)
        finished = killer.run(cfg, run_dir, resume=False, kill_at=int(first))
        kills += not finished
        second = int(rng.integers(1, total + 1))  # and once more while resuming
        finished = killer.run(cfg, run_dir, resume=True, kill_at=second)
        kills += not finished
        assert killer.run(cfg, run_dir, resume=True, kill_at=None)
        _same_run(ref, run_dir)
        assert _rounds(run_dir) == [0, 1, 2, 3, 4]
    assert kills >= 10
