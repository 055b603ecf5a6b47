"""The run directory: creating, replacing and locking it, and the config it was started with.

A run directory is what a user trusts with hours of compute, so every operation here either
completes or leaves the directory as it was:

- `write_run_dir` (the last step of the run's entry, `fedlora.federation.run.entered`, with
  the lock held and every check passed) writes the marker ``.fedlora-run.json`` (`fedlora.federation.runmarker`: run id, version, the
  manifest of what fedlora writes there) and replaces an existing
  directory only with `overwrite`, only when it is provably fedlora's (its marker, or a
  legacy run), only when everything in it is in the manifest, and only after the caller
  validated the new run's inputs (`fedlora.federation.preflight`); it deletes nothing else.
- `run_dir_lock` holds an exclusive `flock` on ``<run>/.lock`` while a run writes, taken
  once per run (not re-entrant); a second taker gets `ConfigError` naming the PID that
  holds it.
- `resume_config` is the saved config with only what the user gives on top; keys the
  checkpoints depend on cannot change (`FIXED_ON_RESUME`).

What is written inside it lives next door: atomic writes and metrics.jsonl in
`fedlora.federation.runfiles`, checkpoints in `fedlora.federation.checkpoints`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedlora.config.experiment import SECTIONS, ExperimentConfig, config_from_dict, diff_configs
from fedlora.config.method_options import upgrade_renamed_keys
from fedlora.config.toml_io import apply_overrides, dump_toml, read_toml
from fedlora.errors import ConfigError, DataError
from fedlora.federation.methods.registry import resolve_method_options
from fedlora.federation.runmarker import (
    MANIFEST,
    MARKER_NAME,
    folder_names,
    has_legacy_evidence,
    is_never_started,
    linked_names,
    read_marker,
    sort_entries,
    write_marker,
)
from fedlora.files import atomic_write, open_lock_file

__all__ = [
    "FIXED_EXCEPTIONS",
    "FIXED_ON_RESUME",
    "LEGACY_DEFAULTS",
    "LOCK_NAME",
    "check_run_dir",
    "refuse_unsafe_names",
    "config_changes",
    "load_run_config",
    "load_saved_config",
    "saved_config_from_table",
    "make_run_dir",
    "never_started",
    "resume_config",
    "resume_given",
    "run_dir_for",
    "run_dir_lock",
    "write_run_dir",
]

LOCK_NAME = ".lock"
# Keys --force may not change on resume: the checkpoints' shapes and the partition depend on them.
FIXED_ON_RESUME = ("model.name", "lora.", "data.", "method.name", "training.seed")
FIXED_EXCEPTIONS = ("data.data_dir",)  # the same data moved elsewhere


def run_dir_for(cfg: ExperimentConfig, out: str | None = None) -> Path:
    if out:
        return Path(out)
    name = cfg.output.name or f"{cfg.method.name}-seed{cfg.training.seed}"
    return Path(cfg.output.dir) / name


# ----------------------------------------------------------------------------- lock


def _lock_holder(path: Path) -> str:
    try:
        pid = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


class RunDirInUse(ConfigError):
    """The run directory's lock is held by another process (a run going on there)."""


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on `run_dir` while a run writes there.

    Taken once per run, by its entry (`fedlora.federation.run.run`; the Flower ServerApp,
    another process, takes its own). Not re-entrant: a second take, from another process or
    from this one, gets `ConfigError` naming the PID that holds it; the kernel drops the
    lock when its holder dies, so a killed run never leaves it stuck."""
    run_dir = Path(run_dir)
    make_run_dir(run_dir)
    path = run_dir / LOCK_NAME
    try:  # never through a link: a link at .lock is refused (ConfigError) naming it
        f = open_lock_file(path)
    except OSError as e:
        raise ConfigError(
            f"run directory {str(run_dir)!r}: cannot lock: {e.strerror or e}"
        ) from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RunDirInUse(
            f"run directory {str(run_dir)!r} is in use by {_lock_holder(path)} (it holds "
            f"{str(path)!r}); wait for that run to finish or stop it, then try again"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    try:
        yield
    finally:
        f.close()


# ----------------------------------------------------------------------------- creating


def _is_run_config(path: Path) -> bool:
    """Whether `path` is a config.toml fedlora wrote: every section, and valid."""
    try:
        raw = read_toml(path)
        config_from_dict(raw)
    except (ConfigError, DataError):
        return False
    return set(raw) == set(SECTIONS)


def _entries(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.iterdir() if p.name != LOCK_NAME)


def never_started(run_dir: Path) -> bool:
    """A fedlora run that failed before recording anything (its marker, config and the like)."""
    names = [p.name for p in _entries(run_dir) if p.name != MARKER_NAME]
    return read_marker(run_dir) is not None and is_never_started(run_dir, names)


def _manifest(run_dir: Path, names: Sequence[str]) -> dict[str, Any]:
    """What fedlora may delete in `run_dir`: its marker's manifest, or for a run written
    before the marker (a fedlora config.toml and a recorded round) the current `MANIFEST`;
    any other non-empty directory is refused."""
    marker = read_marker(run_dir)
    if marker is not None:
        return marker["manifest"]
    if _is_run_config(run_dir / "config.toml") and has_legacy_evidence(run_dir):
        return MANIFEST
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    raise ConfigError(
        f"refusing to use {str(run_dir)!r}: it is not a fedlora run directory (no "
        f"{MARKER_NAME} and no run recorded by an older fedlora) and it holds {shown}: "
        "choose another --out (a new or empty directory)"
    )


def refuse_unsafe_names(run_dir: Path) -> None:
    """Refuse (ConfigError naming them) a run directory whose names fedlora writes or deletes
    are symbolic links (`linked_names`) or, where fedlora writes a file, folders
    (`folder_names`): a run, a resume, or --overwrite there would write or delete through a
    link, or fail at its first write into the folder after the rounds it trained."""
    try:
        links = linked_names(run_dir) if run_dir.is_dir() else []
        folders = folder_names(run_dir) if run_dir.is_dir() else []
    except OSError as e:
        raise ConfigError(f"run directory {str(run_dir)!r}: {e.strerror or e}") from None
    if links:
        raise ConfigError(
            f"run directory {str(run_dir)!r}: {', '.join(links)} "
            f"{'is a symbolic link' if len(links) == 1 else 'are symbolic links'} where fedlora "
            "writes its own files; fedlora never writes or deletes through a link: replace "
            f"{'it' if len(links) == 1 else 'them'} with the real files or folders, or choose "
            "another directory"
        )
    if folders:
        one = len(folders) == 1
        raise ConfigError(
            f"run directory {str(run_dir)!r}: {', '.join(folders)} "
            f"{'is a folder' if one else 'are folders'} where fedlora writes "
            f"{'a file' if one else 'files'}; fedlora never deletes a folder it did not write: "
            f"move {'it' if one else 'them'} away, or choose another directory"
        )


def check_run_dir(run_dir: Path, *, overwrite: bool = False) -> None:
    """Refuse, before anything is written, an output path a new run may not use."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            f"output directory {str(run_dir)!r} exists and is not a directory: choose another --out"
        )
    if not run_dir.is_dir():
        return
    try:
        entries = _entries(run_dir)
    except OSError as e:
        raise ConfigError(f"output directory {str(run_dir)!r}: {e.strerror or e}") from None
    refuse_unsafe_names(run_dir)
    if not entries or never_started(run_dir):
        return
    manifest = _manifest(run_dir, [p.name + ("/" if p.is_dir() else "") for p in entries])
    if not overwrite:
        raise ConfigError(
            f"output directory {str(run_dir)!r} exists: use --resume {run_dir} to continue it "
            "or --overwrite to replace it"
        )
    _, foreign = sort_entries(run_dir, manifest)
    if foreign:
        raise ConfigError(
            f"refusing to overwrite {str(run_dir)!r}: it holds files fedlora did not write "
            f"({', '.join(foreign)}); move them away or choose another --out"
        )


def make_run_dir(run_dir: Path) -> None:
    """Create `run_dir` (and its parents); an OSError becomes a one-line ConfigError."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"output directory {str(run_dir)!r}: cannot create: {e.strerror or e}"
        ) from None


def write_run_dir(cfg: ExperimentConfig, run_dir: Path, *, overwrite: bool = False) -> None:
    """With the caller holding the lock (or on a directory no run uses yet), the inputs
    checked and `cfg`'s device and dtype resolved: refuse a path a new run may not use,
    remove what an earlier run of `run_dir` left (with `overwrite`; only entries the marker's
    manifest lists, never the lock file), then write the marker and config.toml."""
    run_dir = Path(run_dir)
    if "auto" in (cfg.model.device, cfg.model.dtype):
        raise ValueError("write_run_dir: resolve model.device/dtype first (resolve_runtime)")
    check_run_dir(run_dir, overwrite=overwrite)
    text = dump_toml(cfg).encode()
    if _prepared(run_dir, text):  # written by this entry already (a prepared directory)
        return
    if run_dir.is_dir() and _entries(run_dir):
        names = [p.name for p in _entries(run_dir)]
        owned, _ = sort_entries(run_dir, _manifest(run_dir, names))
        for p in owned:  # only what the manifest lists (check_run_dir refused the rest)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    make_run_dir(run_dir)
    write_marker(run_dir)
    atomic_write(run_dir / "config.toml", text)


def _prepared(run_dir: Path, text: bytes) -> bool:
    """`run_dir` holds only its marker and a config.toml of exactly `text`: a directory the
    entry prepared for this run (`fedlora.federation.run.prepare_run_dir`), kept as it is."""
    if not run_dir.is_dir() or [p.name for p in _entries(run_dir)] != [MARKER_NAME, "config.toml"]:
        return False
    try:
        return read_marker(run_dir) is not None and (run_dir / "config.toml").read_bytes() == text
    except OSError:
        return False


# ----------------------------------------------------------------------------- config


# Keys whose default changed after run directories were written without them: such a run
# resumes with the value it was started with (the CPU protocols changed these defaults).
LEGACY_DEFAULTS = {
    ("data", "response"): "label",
    ("evaluation", "scoring"): "label",
    ("evaluation", "format"): "llm-adapters",  # before the harness format
    ("training", "sketch_step"): "paper",
}


def load_saved_config(path: Path) -> ExperimentConfig:
    """A run directory's config.toml; keys it lacks take `LEGACY_DEFAULTS`, else the defaults.
    Its method options as a run records them (`resolve_method_options`): the flat keys that
    fedlora wrote before (``method.heterolora_pruning``) are read without a warning (the
    file is fedlora's, not the user's), and equal their ``[method.<name>]`` table."""
    return saved_config_from_table(read_toml(path), source=str(path))


def saved_config_from_table(raw: dict[str, Any], *, source: str) -> ExperimentConfig:
    """`load_saved_config` of a config.toml already read (`raw` is not changed): the config the
    run ran with, every key present (the reports compare runs written by different versions
    of fedlora at their resolved values, not at the keys their files happen to hold)."""
    raw = upgrade_renamed_keys(
        {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()},
        source=source,
        warn=False,
    )
    for (section, key), value in LEGACY_DEFAULTS.items():
        table = raw.setdefault(section, {})
        if isinstance(table, dict):
            table.setdefault(key, value)
    return resolve_method_options(config_from_dict(raw, source=source))


def config_changes(
    saved: ExperimentConfig, given: ExperimentConfig
) -> tuple[ExperimentConfig, list[str]]:
    """`given` as it applies to a run started with `saved` (its ``auto`` device/dtype take the
    values the run resolved and saved, its method options resolved as a run records them),
    and the ``section.key`` names that still differ."""
    from fedlora.llm.device import inherit_auto

    given = resolve_method_options(inherit_auto(given, saved))
    return given, diff_configs(resolve_method_options(saved), given)


def load_run_config(
    run_dir: Path,
    given: ExperimentConfig | None = None,
    *,
    force: bool = False,
    write: bool = True,
) -> ExperimentConfig:
    """The config a run was started with; with `given`, refuse differences unless `force`
    (then the merged config, written to config.toml unless `write` is False: the run's entry
    writes it once it holds the lock)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--resume {str(run_dir)!r}: no such directory")
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ConfigError(f"--resume {str(run_dir)!r}: no config.toml there (not a fedlora run)")
    saved = load_saved_config(path)
    if given is None:
        return saved
    given, differing = config_changes(saved, given)
    if differing and not force:
        raise ConfigError(
            f"--resume {str(run_dir)!r}: the config differs from the run's in "
            f"{', '.join(differing)}; use --force to resume with the new values"
        )
    if differing:
        fixed = [
            k for k in differing if k.startswith(FIXED_ON_RESUME) and k not in FIXED_EXCEPTIONS
        ]
        if fixed:
            raise ConfigError(
                f"--resume {str(run_dir)!r} --force: {', '.join(fixed)} cannot change on "
                "resume (the checkpoints and the data partition depend on them); start a new "
                "run with --out instead"
            )
        if write:
            atomic_write(path, dump_toml(given).encode())
        return given
    return saved


def resume_config(
    run_dir: Path,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    *,
    force: bool = False,
) -> ExperimentConfig:
    """The config to resume `run_dir` with: its saved config, then the file at `config_path`
    (if any) and the overrides on top of it, so that only what is given can differ."""
    return load_run_config(run_dir, resume_given(run_dir, config_path, overrides), force=force)


def resume_given(
    run_dir: Path, config_path: str | None = None, overrides: Sequence[str] = ()
) -> ExperimentConfig | None:
    """The saved config of `run_dir` with the file at `config_path` and the overrides on
    top (None when neither is given): what `load_run_config` compares with the saved one.
    Reads only; `fedlora run --resume` compares under the run's lock."""
    saved = load_run_config(run_dir)
    if not config_path and not overrides:
        return None
    raw: dict[str, Any] = saved.to_dict()
    source = str(config_path) if config_path else "overrides"
    given: dict[str, Any] = read_toml(config_path) if config_path else {}
    apply_overrides(given, overrides, source=source)
    # old flat keys at their new place first: they replace the saved table's values
    for section, values in upgrade_renamed_keys(given, source=source).items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            for key, value in values.items():  # a sub-table ([method.<name>]) key by key
                old = raw[section].get(key)
                both = isinstance(value, dict) and isinstance(old, dict)
                raw[section][key] = {**old, **value} if both else value
        else:
            raw[section] = values
    return config_from_dict(raw, source=source)
