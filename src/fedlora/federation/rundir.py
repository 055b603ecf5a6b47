"""The run directory: creating, replacing and locking it, its config, checkpoints and metrics.

A run directory is what a user trusts with hours of compute, so every operation here either
completes or leaves the directory as it was:

- `prepare_run_dir` replaces an existing directory only with `overwrite`, only when it is
  recognisably a fedlora run (a full config.toml and nothing fedlora does not write), and
  only after the caller validated the new run's inputs (`fedlora.federation.preflight`).
- `run_dir_lock` holds an exclusive `flock` on ``<run>/.lock`` while a run writes; a second
  process gets `ConfigError` naming the PID that holds it.
- Checkpoints are ``checkpoints/round-NNNNNN.safetensors``: tensors in safetensors, every
  other field as JSON in the header, so loading one never runs code. Each also holds the
  metrics lines up to its round, so a resume rewrites a damaged metrics.jsonl exactly.
  Old ``round-*.pt`` pickles are read with ``torch.load(weights_only=True)`` and an allow-list
  of numpy types; anything else in them is refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config import (
    SECTIONS,
    ExperimentConfig,
    apply_overrides,
    config_from_dict,
    diff_configs,
    dump_toml,
    read_toml,
)
from fedlora.errors import ConfigError, DataError

LOCK_NAME = ".lock"
CHECKPOINT_FORMAT = "fedlora-checkpoint-1"
# What fedlora writes into a run directory (plus *.tmp); anything else makes it foreign.
RUN_DIR_FILES = frozenset(
    {
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "clients.csv",
        "error.txt",
        "plan.json",
        "report.md",
        "accuracy_vs_time.png",
        LOCK_NAME,
    }
)
RUN_DIR_DIRS = frozenset({"checkpoints", "adapter", "calibration"})
RUN_DIR_PREFIXES = ("predictions", "eval")  # per-question evaluation outputs
# Left by a run that failed before its first round: such a directory is reused silently.
NEVER_STARTED_FILES = frozenset({"config.toml", "clients.csv", "error.txt", LOCK_NAME})
# Keys --force may not change on resume: the checkpoints' shapes and the partition depend on them.
FIXED_ON_RESUME = ("model.name", "lora.", "data.", "method.name", "training.seed")
FIXED_EXCEPTIONS = ("data.data_dir",)  # the same data moved elsewhere


def run_dir_for(cfg: ExperimentConfig, out: str | None = None) -> Path:
    if out:
        return Path(out)
    name = cfg.output.name or f"{cfg.method.name}-seed{cfg.training.seed}"
    return Path(cfg.output.dir) / name


def _named(e: OSError, path: Path) -> OSError:
    """`e` with the file named (a failed write or fsync does not name it)."""
    return e if e.filename else OSError(e.errno, e.strerror, str(path))


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _named(e, path) from None
    os.replace(tmp, path)


def os_error_message(e: OSError) -> str:
    """One line for an OSError; a full disk is named as such."""
    where = f" {e.filename!r}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left on device while writing{where}: free some space, then run again "
            "(--resume DIR continues a run that had started)"
        )
    return f"{e.strerror or e}:{where}" if where else f"{e.strerror or e}"


# ----------------------------------------------------------------------------- lock

_HELD: dict[str, list[Any]] = {}  # resolved path -> [open lock file, depth]


def _lock_holder(path: Path) -> str:
    try:
        pid = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on `run_dir` (re-entrant within this process).

    A second process asking for it gets `ConfigError` naming the PID that holds it; the
    kernel drops the lock when its holder dies, so a killed run never leaves it stuck."""
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    make_run_dir(run_dir)
    path = run_dir / LOCK_NAME
    try:
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held across the yield
    except OSError as e:
        raise ConfigError(
            f"run directory {str(run_dir)!r}: cannot lock: {e.strerror or e}"
        ) from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise ConfigError(
            f"run directory {str(run_dir)!r} is in use by {_lock_holder(path)} (it holds "
            f"{str(path)!r}); wait for that run to finish or stop it, then try again"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _HELD[key] = [f, 1]
    try:
        yield
    finally:
        del _HELD[key]
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


def _foreign(entries: Sequence[Path]) -> list[str]:
    """Entries fedlora would not have written."""
    out = []
    for p in entries:
        name = p.name
        if name.endswith(".tmp") or name.startswith(RUN_DIR_PREFIXES):
            continue
        known = RUN_DIR_DIRS if p.is_dir() and not p.is_symlink() else RUN_DIR_FILES
        if name not in known:
            out.append(name + ("/" if p.is_dir() else ""))
    return out


def never_started(run_dir: Path) -> bool:
    """A fedlora run that failed before recording anything (only its config and the like)."""
    entries = _entries(run_dir)
    return (
        bool(entries)
        and all(p.name in NEVER_STARTED_FILES or p.name.endswith(".tmp") for p in entries)
        and _is_run_config(run_dir / "config.toml")
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
    if not entries or never_started(run_dir):
        return
    if not overwrite:
        raise ConfigError(
            f"output directory {str(run_dir)!r} exists: use --resume {run_dir} to continue it "
            "or --overwrite to replace it"
        )
    if not (run_dir / "config.toml").is_file() or not _is_run_config(run_dir / "config.toml"):
        raise ConfigError(
            f"refusing to overwrite {str(run_dir)!r}: it is not a fedlora run directory "
            "(no config.toml written by fedlora)"
        )
    foreign = _foreign(entries)
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


def prepare_run_dir(cfg: ExperimentConfig, run_dir: Path, *, overwrite: bool = False) -> None:
    """Create a fresh run directory; replace an existing fedlora run only with `overwrite`.

    The new run's inputs are validated (`fedlora.federation.preflight.check_inputs`) before anything is
    removed, and only entries fedlora writes are removed (never the lock file)."""
    run_dir = Path(run_dir)
    # the device and dtype this run uses (auto resolved; a device the machine lacks fails
    # here, before anything is created or removed), saved so that a resume keeps them
    from fedlora.llm.device import resolve_runtime

    text = dump_toml(resolve_runtime(cfg).cfg)
    check_run_dir(run_dir, overwrite=overwrite)
    if run_dir.is_dir() and _entries(run_dir):
        if not never_started(run_dir):
            from fedlora.federation.preflight import check_inputs

            check_inputs(cfg)
        for p in _entries(run_dir):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    make_run_dir(run_dir)
    atomic_write(run_dir / "config.toml", text.encode())


# ----------------------------------------------------------------------------- config


# Keys whose default changed after run directories were written without them: such a run
# resumes with the value it was started with (issue 13's CPU protocol changed these defaults).
LEGACY_DEFAULTS = {
    ("data", "response"): "label",
    ("evaluation", "scoring"): "label",
    ("training", "sketch_step"): "paper",
}


def load_saved_config(path: Path) -> ExperimentConfig:
    """A run directory's config.toml; keys it lacks take `LEGACY_DEFAULTS`, else the defaults."""
    raw = read_toml(path)
    for (section, key), value in LEGACY_DEFAULTS.items():
        table = raw.setdefault(section, {})
        if isinstance(table, dict):
            table.setdefault(key, value)
    return config_from_dict(raw, source=str(path))


def load_run_config(
    run_dir: Path, given: ExperimentConfig | None = None, *, force: bool = False
) -> ExperimentConfig:
    """The config a run was started with; with `given`, refuse differences unless `force`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--resume {str(run_dir)!r}: no such directory")
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ConfigError(f"--resume {str(run_dir)!r}: no config.toml there (not a fedlora run)")
    saved = load_saved_config(path)
    if given is None:
        return saved
    from fedlora.llm.device import inherit_auto

    given = inherit_auto(given, saved)  # auto device/dtype: what the run started with
    differing = diff_configs(saved, given)
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
    saved = load_run_config(run_dir)
    if not config_path and not overrides:
        return saved
    raw: dict[str, Any] = saved.to_dict()
    source = str(config_path) if config_path else "overrides"
    if config_path:
        for section, values in read_toml(config_path).items():
            if isinstance(values, dict) and isinstance(raw.get(section), dict):
                raw[section].update(values)
            else:
                raw[section] = values
    apply_overrides(raw, overrides, source=source)
    return load_run_config(run_dir, config_from_dict(raw, source=source), force=force)


# ----------------------------------------------------------------------------- metrics


def append_metrics(path: Path, line: dict[str, Any]) -> None:
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _named(e, path) from None


def read_metrics_lines(path: Path) -> list[str]:
    """The complete JSON lines of a metrics file, in order; a torn or foreign line ends them.

    Non-UTF-8 bytes raise `DataError` naming the file."""
    if not path.exists():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{str(path)!r} is not UTF-8 text (byte {e.start}): the metrics file is damaged"
        ) from None
    lines = []
    for raw in text.split("\n")[:-1]:  # the last piece has no newline: torn or empty
        try:
            if not isinstance(json.loads(raw), dict):
                break
        except json.JSONDecodeError:
            break
        lines.append(raw)
    return lines


def truncate_metrics(path: Path, lines: int) -> None:
    """Cut metrics.jsonl back to its first `lines` lines (those a checkpoint recorded).

    Refuses (`DataError`) when fewer complete lines are there: rounds would be missing."""
    if not path.exists() and lines == 0:
        return
    kept = read_metrics_lines(path)
    if len(kept) < lines:
        raise DataError(
            f"{str(path)!r} holds {len(kept)} complete lines but the checkpoint recorded "
            f"{lines} (rounds {len(kept)}..{lines - 1} are missing) and, written by an older "
            "fedlora, does not hold them: restore the file from a backup, or start the run "
            "again with --overwrite"
        )
    atomic_write(path, "".join(line + "\n" for line in kept[:lines]).encode())


def restore_metrics(path: Path, state: dict[str, Any] | None, warn=print) -> None:
    """Make metrics.jsonl agree with the checkpoint a run resumes from.

    A checkpoint holds its metrics lines: they are written back exactly (whatever happened
    to the file since). Without a checkpoint the run starts over (the file is emptied); an
    old checkpoint without lines falls back to `truncate_metrics`."""
    if state is None:
        path.unlink(missing_ok=True)
        return
    lines = state.get("metrics")
    if lines is None:
        truncate_metrics(path, int(state["progress"]["metrics_lines"]))
        return
    try:
        current = read_metrics_lines(path)
    except DataError:
        current = []
    if current[: len(lines)] != lines:
        warn(f"{path} did not match the checkpoint: rewrote its {len(lines)} lines from it")
    atomic_write(path, "".join(line + "\n" for line in lines).encode())


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """Every checkpoint file, newest round first (both formats)."""
    ckpt = run_dir / "checkpoints"
    paths = [*ckpt.glob("round-*.safetensors"), *ckpt.glob("round-*.pt")]

    def key(p: Path) -> tuple[int, int]:
        digits = p.stem.split("-", 1)[1]
        return (int(digits) if digits.isdigit() else -1, p.suffix == ".safetensors")

    return sorted(paths, key=key, reverse=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")


def save_checkpoint(run_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as ``checkpoints/round-NNNNNN.safetensors`` (atomically); keep `keep`.

    ``state["global"]`` (torch tensors) and ``state["base_delta"]`` (numpy arrays) become
    tensors; everything else is JSON in the header, with the first
    ``progress.metrics_lines`` lines of metrics.jsonl (for `restore_metrics`)."""
    import torch
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(exist_ok=True)
    tensors = {f"global/{k}": v.detach().cpu().contiguous() for k, v in state["global"].items()}
    for k, v in (state.get("base_delta") or {}).items():
        tensors[f"base_delta/{k}"] = torch.from_numpy(np.ascontiguousarray(v))
    rest = {k: v for k, v in state.items() if k not in ("global", "base_delta")}
    n_lines = int(state["progress"]["metrics_lines"])
    rest["metrics"] = read_metrics_lines(run_dir / "metrics.jsonl")[:n_lines]
    meta = {"format": CHECKPOINT_FORMAT, "state": json.dumps(rest, default=_json_default)}
    path = ckpt_dir / f"round-{state['round']:06d}.safetensors"
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in checkpoint_paths(run_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a {CHECKPOINT_FORMAT} file")
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API
    state = json.loads(meta["state"])
    state["global"] = {k[7:]: v for k, v in tensors.items() if k.startswith("global/")}
    state["base_delta"] = {
        k[11:]: v.numpy() for k, v in tensors.items() if k.startswith("base_delta/")
    }
    return state


def _numpy_allow_list() -> list[Any]:
    """The numpy objects a pre-safetensors checkpoint's base_delta arrays unpickle to."""
    import numpy.dtypes

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    dtypes = [getattr(numpy.dtypes, n) for n in dir(numpy.dtypes) if n.endswith("DType")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


def _load_pickle(path: Path) -> dict[str, Any]:
    """A checkpoint written before safetensors: tensors, numbers, strings and numpy arrays
    only (``weights_only=True`` with a numpy allow-list); any other object is refused."""
    import torch

    with torch.serialization.safe_globals(_numpy_allow_list()):
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("base_delta"), dict):
        state["base_delta"] = {k: np.asarray(v) for k, v in state["base_delta"].items()}
    return state


def load_checkpoint(run_dir: Path, warn=print) -> dict[str, Any] | None:
    """The newest readable checkpoint; a damaged one is named and skipped.

    None when the run has none. When every checkpoint is unusable, `DataError` names them
    (starting over silently would throw the run's progress away)."""
    import pickle

    paths = checkpoint_paths(Path(run_dir))
    for path in paths:
        try:
            if path.suffix == ".safetensors":
                state = _load_safetensors(path)
            else:
                state = _load_pickle(path)
            if not isinstance(state, dict) or "round" not in state or "global" not in state:
                raise ValueError("missing fields")
            return state
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            warn(
                f"checkpoint {path} was not loaded: it holds objects that a fedlora checkpoint "
                f"never holds and loading them could run code ({first[:200]}); "
                "trying the previous one"
            )
        except Exception as e:  # noqa: BLE001 - any unreadable file falls back to the previous
            warn(f"checkpoint {path} is damaged ({type(e).__name__}: {e}); trying the previous one")
    if paths:
        raise DataError(
            f"no usable checkpoint in {str(Path(run_dir) / 'checkpoints')!r} "
            f"({', '.join(p.name for p in paths)} could not be loaded safely): remove them to "
            "start this run over from round 0, or start a new run"
        )
    return None


# Names before issue 11 (code in flight may still use them; remove once none does).
_append_metrics = append_metrics
_atomic_write = atomic_write
_checkpoint_paths = checkpoint_paths
_truncate_metrics = truncate_metrics
