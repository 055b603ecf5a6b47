"""The one way into a run (`fedlora.federation.run.run`, issue 23): `fedlora run` checks the
inputs, locks the run directory and resolves model.device / model.dtype exactly once per run
(counted by wrapping every binding of those functions in fedlora's modules), for a sketched
run, a `proposed` run with Algorithm 2's separate calibration (four calibration runs inside)
and a resume; and a resume whose checkpoints were deleted is refused without touching
metrics.jsonl (issue 24). Tiny random-init model, real data."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import fedlora.federation.run  # noqa: F401  (loaded, so its bindings are counted too)
from fedlora.cli import main
from fedlora.config import load_config

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
pytestmark = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

TINY = [
    "model.name=tiny-llama",
    "model.dtype=auto",  # resolved (to fp32 on a CPU without native bf16): once
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e"]',
    "data.train_limit=16",
    "data.eval_limit=4",
    "data.max_seq_len=64",
    "data.n_clients=2",
    "data.min_client_examples=2",
    "lora.rank=2",
    'lora.layers="all"',
    "training.local_steps=1",
    "training.batch_size=2",
    "training.eval_every=1",
    "training.checkpoint_every=1",
    "output.progress=false",
]
SKETCHED = ["method.name=sketched", "method.q=[1.0, 0.5]", "method.k=[1, 2]"]
SEPARATE = [
    "method.name=proposed",
    "planner.calibration=separate",
    "planner.calibration_rounds=2",
    "training.seed=3",
]  # seed 3: every calibration run has a round with participants
# (module, name) of what a run must do once: every module binding the same object is wrapped
ONCE = {
    "run_dir_lock": "fedlora.federation.rundir",
    "check_inputs": "fedlora.federation.preflight",
    "resolve_runtime": "fedlora.llm.device",
    "resolve_device": "fedlora.llm.device",
    "resolve_dtype": "fedlora.llm.device",
}


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count calls of the `ONCE` functions, through whichever module binds them, and the
    exclusive `flock`s taken (a lock on any directory, calibration runs' included)."""
    counts: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        for name, home in ONCE.items():
            original = getattr(sys.modules[home], name)

            def wrapper(*args, _name=name, _original=original, **kwargs):
                counts[_name] += 1
                return _original(*args, **kwargs)

            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("fedlora"):
                    if getattr(module, name, None) is original:
                        mp.setattr(module, name, wrapper)
        flock = fcntl.flock

        def counted_flock(fd, operation):
            if operation & fcntl.LOCK_EX:
                counts["flock"] += 1
            return flock(fd, operation)

        mp.setattr(fcntl, "flock", counted_flock)
        yield counts


def _once(counts: Counter) -> None:
    assert {k: counts[k] for k in (*ONCE, "flock")} == dict.fromkeys((*ONCE, "flock"), 1)


def _run(*argv: str) -> int:
    return main(["run", "--quiet", *argv])


def test_sketched_run_and_its_resume_check_lock_and_resolve_once(tmp_path):
    run_dir = tmp_path / "sk"
    with counting() as counts:
        assert _run("--out", str(run_dir), *TINY, *SKETCHED, "training.rounds=2") == 0
    _once(counts)
    assert load_config(run_dir / "config.toml").model.dtype == "fp32"  # resolved, saved
    with counting() as counts:
        assert _run("--resume", str(run_dir), "--force", "training.rounds=3") == 0
    _once(counts)
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 3


def test_proposed_with_separate_calibration_checks_locks_and_resolves_once(tmp_path):
    run_dir = tmp_path / "prop"
    with counting() as counts:
        assert _run("--out", str(run_dir), *TINY, *SEPARATE, "training.rounds=2") == 0
    _once(counts)  # four calibration runs and the run: one check, one lock, one resolution
    subs = sorted((run_dir / "calibration").iterdir())
    assert len(subs) == 4
    for sub in subs:  # under the run's lock (none of their own), on the run's device/dtype
        assert not (sub / ".lock").exists()
        model = load_config(sub / "config.toml").model
        assert (model.device, model.dtype) == ("cpu", "fp32")
    assert json.loads((run_dir / "summary.json").read_text())["plan"] is not None
    with counting() as counts:  # plan.json is read back: no calibration run again
        assert _run("--resume", str(run_dir), "--force", "training.rounds=3") == 0
    _once(counts)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 3-round sketched run with a checkpoint after every round."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert _run("--out", str(run_dir), *TINY, *SKETCHED, "training.rounds=3") == 0
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


@pytest.mark.parametrize("finished", [False, True])
def test_resume_without_checkpoints_is_refused_and_keeps_the_metrics(
    finished_run, tmp_path, capsys, finished
):
    # Prepare: the checkpoints deleted; an unfinished run is one without summary.json
    run_dir = _copy(finished_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    if not finished:
        (run_dir / "summary.json").unlink()
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    # Execute
    rc = _run("--resume", str(run_dir))
    # Assert: exit 2, one error line naming the directory and --overwrite; nothing changed
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(errors) == 1, err
    assert str(run_dir) in errors[0] and "--overwrite" in errors[0] and "Traceback" not in err
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert not (run_dir / "checkpoints").exists()
    assert (run_dir / "summary.json").exists() == finished


def test_run_killed_before_its_first_checkpoint_starts_over(finished_run, tmp_path):
    # metrics.jsonl up to round 1 = checkpoint_every and no checkpoint: the run may have died
    # between recording round 1 and checkpointing it; nothing is lost by starting over
    run_dir = _copy(finished_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "summary.json").unlink()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    assert _run("--resume", str(run_dir)) == 0
    rounds = [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- every path in


def test_run_experiment_and_prepare_run_dir_check_resolve_and_lock_once(tmp_path):
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(None, [*TINY, *SKETCHED, "training.rounds=1"])
    with counting() as counts:
        run_experiment(cfg, tmp_path / "a", quiet=True, log=lambda m: None)
    _once(counts)
    with counting() as counts:  # a prepared directory is taken over as it is
        prepare_run_dir(cfg, tmp_path / "b")
    _once(counts)
    marker = (tmp_path / "b" / ".fedlora-run.json").read_bytes()
    with counting() as counts:
        run_experiment(cfg, tmp_path / "b", quiet=True, log=lambda m: None)
    _once(counts)
    assert (tmp_path / "b" / ".fedlora-run.json").read_bytes() == marker


def test_compare_checks_resolves_and_locks_once_per_run(tmp_path):
    out = tmp_path / "suite"
    argv = ["compare", "--suite", "table1", "--methods", "fslora", "--out", str(out), "-q"]
    argv += ["--target", "arc-e=0.25", *TINY, "training.rounds=1"]
    with counting() as counts:
        assert main(argv) == 0
    _once(counts)
    assert json.loads((out / "fslora-seed0" / "summary.json").read_text())["rounds"] == 1


def _serverapp_stub(monkeypatch, seen: list):
    """The ServerApp's rounds replaced by a record of what they were handed (no Flower run)."""
    from fedlora.federation.flower import server_app

    def fake(grid, runtime, opts, run_dir, wall_start, log, *, resume=False):
        seen.append((runtime, run_dir, resume))
        return {"rounds": 0}

    monkeypatch.setattr(server_app, "_run_server", fake)
    return server_app


def test_serverapp_enters_once_and_not_again_under_simulate(tmp_path, monkeypatch, capsys):
    # the ServerApp of run-local (another process): one check, resolution and lock of its own
    from fedlora.federation.flower.common import FlowerOptions

    seen: list = []
    server_app = _serverapp_stub(monkeypatch, seen)
    cfg = load_config(None, [*TINY, *SKETCHED])
    with counting() as counts:
        server_app.run_server(None, cfg, FlowerOptions(out_dir=str(tmp_path / "a")))
    _once(counts)
    assert seen[0][0].cfg.model.dtype == "fp32" and (tmp_path / "a" / "config.toml").is_file()
    # flower simulate: the command enters the run once; its ServerApp runs on that entry
    from fedlora.federation.flower import simulation

    def fake_simulation(cfg, opts, *, num_cpus=None, client_num_cpus=1.0, resume=False):
        return server_app.run_server(None, cfg, opts, resume=resume)

    monkeypatch.setattr(simulation, "run_simulation", fake_simulation)
    pytest.importorskip("ray")
    with counting() as counts:
        rc = main(["flower", "simulate", "--out", str(tmp_path / "s"), *TINY, *SKETCHED])
    assert rc == 0, capsys.readouterr().err
    _once(counts)
    assert seen[1][1] == (tmp_path / "s").resolve() and seen[1][0].cfg.model.dtype == "fp32"


def test_run_local_command_enters_once_before_anything_starts(tmp_path, monkeypatch):
    from fedlora.commands import flower

    started: list = []
    monkeypatch.setattr(flower, "_deploy", lambda *a: started.append(a) or _summary(a[2]))
    with counting() as counts:
        assert main(["flower", "run-local", "--out", str(tmp_path / "r"), *TINY, *SKETCHED]) == 0
    _once(counts)
    assert started and started[0][3]["overwrite"] is False  # prepared: nothing to replace


def _summary(out: Path) -> None:
    (out / "summary.json").write_text("{}")


# bad inputs `fedlora run` refuses; a fresh `flower simulate` refuses each with the same
# message, before Ray starts and before anything is written
REFUSED = [
    'data.tasks=["arc-x"]',
    "lora.layers=3",
    'lora.target_modules=["nope"]',
    'method.q="/nonexistent/q.json"',
    "data.eval_tasks=[]",
    "lora.rank=1000000000000",
    "data.min_client_examples=20",
]


@pytest.mark.parametrize("bad", REFUSED)
def test_flower_simulate_refuses_what_run_refuses_with_the_same_message(
    bad, tmp_path, monkeypatch, capsys
):
    from fedlora.federation.flower import simulation

    pytest.importorskip("ray")
    monkeypatch.setattr(simulation, "run_simulation", lambda *a, **k: pytest.fail("started"))
    lines = []
    for argv in (["run", "--quiet"], ["flower", "simulate"]):
        out = tmp_path / argv[0]
        assert main([*argv, "--out", str(out), *TINY, *SKETCHED, bad]) == 2
        err = capsys.readouterr().err
        errors = [x for x in err.splitlines() if "error:" in x]
        assert len(errors) == 1 and "Traceback" not in err, err
        lines.append(errors[0].split("error: ", 1)[1])
        assert not out.exists()
    assert lines[0] == lines[1]
