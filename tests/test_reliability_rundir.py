"""Issue 24, cases 2 and 3: a run directory is reused only when it is provably fedlora's.

The refusals (exit 2, nothing lost) are cases of tests/reliability_cases.py; here: what the
marker holds, which entries the manifest claims, and the reuses that must keep working
(`fedlora report`'s outputs, runs written before the marker)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from fedlora.federation.runmarker import MANIFEST, MARKER_NAME, sort_entries
from reliability_cases import DATA, RUN, make_finished_run

needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


def _main(*argv: str) -> tuple[int, str]:
    from fedlora.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("finished") / "run"
    make_finished_run(path)
    return path


def _copy(src: Path, tmp: Path) -> Path:
    shutil.copytree(src, tmp / "run")
    return tmp / "run"


def _touch(root: Path, *rels: str) -> None:
    for rel in rels:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x\n")


def test_manifest_claims_fedlora_names_only(tmp_path):
    _touch(
        tmp_path,
        # fedlora's, atomic writes' leftovers included
        "config.toml",
        "config.toml.tmp",
        "metrics.jsonl",
        "predictions.jsonl",
        "report.md",
        "accuracy_bands.png",
        "checkpoints/round-000002.safetensors",
        "checkpoints/round-000003.safetensors.tmp",
        "adapter/adapter_config.json",
        # the user's, however fedlora-like their names
        "evaluation_scripts/score.py",
        "predictions_v2.csv",
        "eval.py",
        "chapter3.tmp",
        "my_plot.png",
    )
    (tmp_path / ".lock").write_text("1\n")
    (tmp_path / MARKER_NAME).write_text("{}")
    owned, foreign = sort_entries(tmp_path, MANIFEST)
    assert sorted(p.name for p in owned) == [
        "accuracy_bands.png",
        "adapter",
        "checkpoints",
        "config.toml",
        "config.toml.tmp",
        "metrics.jsonl",
        "predictions.jsonl",
        "report.md",
    ]
    assert foreign == [
        "chapter3.tmp",
        "eval.py",
        "evaluation_scripts/",
        "my_plot.png",
        "predictions_v2.csv",
    ]
    # a folder fedlora writes is claimed only when all of it is fedlora's
    _touch(tmp_path, "checkpoints/notes.txt")
    assert "checkpoints/notes.txt" in sort_entries(tmp_path, MANIFEST)[1]


@needs_data
def test_marker_names_the_run_and_its_manifest(finished, tmp_path):
    from fedlora import __version__

    marker = json.loads((finished / MARKER_NAME).read_text())
    assert marker["format"] == 1 and marker["fedlora_version"] == __version__
    assert len(marker["run_id"]) == 32 and int(marker["run_id"], 16) >= 0
    assert marker["manifest"] == json.loads(json.dumps(MANIFEST))
    # everything the run wrote is in its manifest
    assert sort_entries(finished, marker["manifest"])[1] == []


@needs_data
def test_overwrite_after_fedlora_report_deletes_only_the_manifest(finished, tmp_path):
    run = _copy(finished, tmp_path)
    rc, err = _main("report", str(run), "--target", "arc-e=0.5")
    assert rc == 0, err
    written = {p.name for p in run.iterdir()} - {p.name for p in finished.iterdir()}
    assert "report.md" in written and any(n.endswith(".png") for n in written)
    old_id = json.loads((run / MARKER_NAME).read_text())["run_id"]
    (run / ".lock").write_text("1\n")
    rc, err = _main(*RUN, "training.rounds=1", "--out", str(run), "--overwrite")
    assert rc == 0, err
    assert not (run / "report.md").exists() and (run / ".lock").exists()
    assert json.loads((run / MARKER_NAME).read_text())["run_id"] != old_id
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()][
        -1
    ] == 1


@needs_data
def test_run_written_before_the_marker_resumes_and_overwrites(finished, tmp_path):
    run = _copy(finished, tmp_path)
    (run / MARKER_NAME).unlink()  # as an older fedlora left it
    metrics = (run / "metrics.jsonl").read_bytes()
    rc, err = _main("run", "--resume", str(run), "-q")
    assert rc == 0, err
    assert (run / "metrics.jsonl").read_bytes() == metrics
    # --overwrite: the legacy manifest (today's names); the user's file stops it
    (run / "notes.txt").write_text("mine\n")
    rc, err = _main(*RUN, "--out", str(run), "--overwrite")
    assert rc == 2 and "notes.txt" in err and (run / "notes.txt").exists()
    (run / "notes.txt").unlink()
    rc, err = _main(*RUN, "--out", str(run), "--overwrite")
    assert rc == 0, err
    assert json.loads((run / MARKER_NAME).read_text())["format"] == 1


@needs_data
def test_run_whose_marker_predates_machine_jsonl_resumes_and_still_overwrites(finished, tmp_path):
    run = _copy(finished, tmp_path)
    marker = json.loads((run / MARKER_NAME).read_text())
    marker["manifest"]["files"].remove("machine.jsonl")  # as a fedlora before the file wrote it
    (run / MARKER_NAME).write_text(json.dumps(marker))
    (run / "machine.jsonl").unlink()
    rc, err = _main("run", "--resume", str(run), "-q")
    assert rc == 0, err
    resumed = json.loads((run / MARKER_NAME).read_text())
    assert resumed["run_id"] == marker["run_id"]  # the same run, its manifest admits the file
    assert resumed["manifest"]["files"] == [*marker["manifest"]["files"], "machine.jsonl"]
    assert (run / "machine.jsonl").is_file()
    rc, err = _main(*RUN, "training.rounds=1", "--out", str(run), "--overwrite")
    assert rc == 0, err


def test_manifest_lists_every_plot_and_report_fedlora_writes():
    # `fedlora report` writes into the first run directory by default: each of its outputs
    # must be in the manifest, or a later --overwrite of that run would refuse
    import re

    src = Path(__file__).parents[1] / "src" / "fedlora" / "studies"
    names = set()
    for path in src.glob("*.py"):
        names |= set(re.findall(r"[\"']([\w.-]+\.(?:png|md|html))[\"']", path.read_text()))
    assert {"report.md", "accuracy_bands.png", "eval_loss_paired.png"} <= names
    assert names <= set(MANIFEST["files"]), names - set(MANIFEST["files"])


@needs_data
def test_legacy_evidence_is_fedlora_records_not_names(finished, tmp_path):
    from fedlora.federation.runmarker import has_legacy_evidence

    assert has_legacy_evidence(finished)
    for rel, text in (
        ("metrics.jsonl", '{"epoch": 1, "loss": 0.5}\n'),
        ("summary.json", '{"accuracy": 0.9}\n'),
        ("checkpoints/model.pt", "weights\n"),
    ):
        d = tmp_path / rel.replace("/", "_")
        (d / rel).parent.mkdir(parents=True)
        (d / rel).write_text(text)
        assert not has_legacy_evidence(d), rel
    for rel in ("metrics.jsonl", "summary.json", "checkpoints"):
        d = tmp_path / f"fedlora_{rel}"
        d.mkdir()
        src = finished / rel
        (shutil.copytree if src.is_dir() else shutil.copy)(src, d / rel)
        assert has_legacy_evidence(d), rel
