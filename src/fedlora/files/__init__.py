"""Readers of user files (every reader of a user-given file lives here, with one error
style: a ConfigError naming the config key or the file, and what is wrong; each file is read
through `fedlora.config.toml_io.read_user_file`: a regular file of at most 64 MiB).

The client profiles (`network.profiles_file`), the q / k vector files (`method.q`,
`method.k`) and the planner's problem files (`fedlora plan PROBLEM.json`); and where fedlora
keeps its own files (`default_cache_dir`). Each reader reads and parses; what the content
means is checked by the system layer (`profiles_from_rows`, `problem_from_dict`). And the
writers: the one way fedlora writes a whole file (`atomic_write`), appends to one
(`append_file`), opens one (`open_for_write`) or deletes one (`remove_own_file`), never through
a link, shared by the run directory, the reports, the adapter export and the caches.

The user's data files are read by `fedlora.files.data`, the same way.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from fedlora.config.toml_io import read_user_file
from fedlora.errors import ConfigError, bad_value, cut, shown
from fedlora.files.data import csv_records
from fedlora.system.client_profiles import ClientProfiles, profiles_from_rows
from fedlora.system.planner.problem import PlanOptions, PlanProblem
from fedlora.system.planner.schema import problem_from_dict


def default_cache_dir() -> Path:
    """``$FEDLORA_CACHE`` if set, else ``~/.cache/fedlora`` (converted models, the bf16 probe)."""
    env = os.environ.get("FEDLORA_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedlora"


def with_filename(e: OSError, path: Path) -> OSError:
    """`e` with the file named (a failed write or fsync does not name it)."""
    return e if e.filename else OSError(e.errno, e.strerror, str(path))


# ----------------------------------------------------------------------------- writing
# fedlora never writes or deletes through a link: a file it writes is opened without following
# a symbolic link at its name (O_NOFOLLOW) and must be a regular file; a link there is refused
# (`refuse_link`: one line, the link and what it points to left as they are). A file with a
# second hard link (a backup made with `cp -al`) is never changed in place: an append rewrites
# it whole under its name (the other name keeps the old content); anything else refuses it.
# A file is deleted only when it is a regular file itself (`remove_own_file`): a link in its
# place is never followed nor removed.


class _HardLinked(Exception):
    """The file has another name: writing it in place would change that one too."""


def refuse_link(path: Path, what: str = "a symbolic link") -> ConfigError:
    """The one-line refusal of a link (or other non-file) where fedlora writes."""
    return ConfigError(
        f"{str(path)!r} is {what}: fedlora never writes or deletes through a link; nothing "
        "was written there: remove it (its target is untouched) or choose another directory"
    )


def _open_fd(path: Path, flags: int) -> int:
    """The descriptor of `path` opened for writing with `flags`, never through a link: a
    symbolic link at `path` (ELOOP under O_NOFOLLOW), a FIFO or device (O_NONBLOCK: no
    hang) is refused naming it, a file with a second hard link raises `_HardLinked`; O_TRUNC
    truncates only once those checks passed."""
    extra = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | extra, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refuse_link(path) from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, a socket
            raise refuse_link(path, "not a regular file") from None
        raise with_filename(e, path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        if stat.S_ISREG(st.st_mode):
            raise _HardLinked(str(path))
        raise refuse_link(path, "not a regular file")
    if flags & os.O_TRUNC:
        os.ftruncate(fd, 0)
    return fd


def open_for_write(path: Path, *, append: bool = False) -> BinaryIO:
    """`path` opened for binary writing (created, truncated; or appended to with `append`)
    without following a link (`_open_fd`): a link there is a `ConfigError` naming it."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    try:
        return os.fdopen(_open_fd(Path(path), flags), "ab" if append else "wb")
    except _HardLinked:
        raise refuse_link(path, "a hard link (a file with another name)") from None


def open_lock_file(path: Path) -> TextIO:
    """`path` opened for reading and writing (created, not truncated), never through a link:
    a run's lock file."""
    try:
        fd = _open_fd(Path(path), os.O_RDWR | os.O_CREAT)
    except _HardLinked:
        raise refuse_link(path, "a hard link (a file with another name)") from None
    return os.fdopen(fd, "r+", encoding="utf-8")


def append_file(path: Path, data: bytes) -> None:
    """Append `data` to `path` (created if missing) and fsync it, never through a link (a
    file with another hard link is rewritten whole by `atomic_write`, breaking the link)."""
    try:
        fd = _open_fd(Path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except _HardLinked:
        with open(path, "rb") as f:
            atomic_write(path, f.read() + data)
        return
    try:
        with os.fdopen(fd, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise with_filename(e, path) from None


def remove_own_file(path: Path) -> bool:
    """Delete `path` when it is a regular file (what fedlora writes there); a link, a folder
    or anything else in its place is left as it is. Whether a file was deleted."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a fsynced temporary file renamed over it: a reader sees
    the old content or the new, never half of it; on failure the temporary file is removed
    (a full disk gets its space back) and the error names `path`. Neither name is written
    through a link: a link at the temporary name is refused, and the rename replaces a link
    at `path` itself, never its target."""
    tmp = path.with_name(path.name + ".tmp")
    if path.is_dir() and not path.is_symlink():  # the rename would fail after the write
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    try:  # a link at `tmp` is refused (ConfigError) before anything is written or removed
        f = open_for_write(tmp)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # the temporary file never stays behind
        remove_own_file(tmp)
        raise OSError(e.errno, e.strerror, str(path)) from None


STAGING = ".fedlora-staging-"  # `.<name>.fedlora-staging-<pid>-<hex>`: a directory being written


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _finish_staging(staging: Path) -> None:
    """Every file and folder under `staging` with the mode a new file or folder gets
    (0o666 / 0o777 less the umask: a library that wrote one 0600 does not decide), fsynced."""
    mask = _umask()
    for folder, _, names in os.walk(staging):
        os.chmod(folder, 0o777 & ~mask)
        for name in names:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, 0o666 & ~mask)
                with open(path, "rb") as f:
                    os.fsync(f.fileno())


def _remove_orphans(out: Path) -> None:
    """Remove the staging folders of `out` that a process which died (a SIGKILL mid-write)
    left: real folders named `.<out's name>.fedlora-staging-<pid>-...` whose pid is gone."""
    prefix = f".{out.name}{STAGING}"
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for p in entries:
        pid = p.name[len(prefix) :].split("-", 1)[0]
        if not (p.name.startswith(prefix) and pid.isdigit()) or _alive(int(pid)):
            continue
        if stat.S_ISDIR(os.lstat(p).st_mode):  # never a link
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def write_directory(out: Path, fill: Callable[[Path], None]) -> None:
    """Write the whole directory `out` at once: `fill(staging)` writes into a new sibling
    folder, whose files then get ordinary modes and are fsynced, and which is renamed to
    `out`. A reader of `out` sees the old directory or the new one, never half of one; a
    failure (a full disk, Ctrl-C) removes the staging folder, and a SIGKILL's leftover is
    removed by the next call. An existing `out` (the caller decided it may be replaced) is
    renamed aside, then deleted; a link at `out` is refused."""
    out = Path(out)
    if out.is_symlink():
        raise refuse_link(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(out)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}{STAGING}{os.getpid()}-"))
    old = None
    try:
        fill(staging)
        _finish_staging(staging)
        if out.exists():
            old = staging.with_name(staging.name + "-old")
            os.rename(out, old)
        os.rename(staging, out)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and not out.exists():
            os.rename(old, out)  # put the previous directory back
        if isinstance(e, OSError) and str(e.filename or "").startswith(str(staging)):
            named = str(out) + str(e.filename)[len(str(staging)) :]  # the file the user asked
            raise OSError(e.errno, e.strerror, named) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _read_text(path: Path, key: str | None = None) -> str:
    """The file's text; a ConfigError naming the config key (or else the file) when it cannot
    be read."""
    where = f"{key} = {shown(str(path))}" if key else cut(str(path))
    try:
        data = read_user_file(path, where)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")  # -sig: spreadsheets prepend a BOM
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start})") from None


def _parse_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply: at most a few levels") from None
    except ValueError as e:  # an integer of thousands of digits (Python's conversion limit)
        raise ConfigError(f"{path}: invalid JSON number: {e}") from None


def load_profiles(path: str | Path) -> ClientProfiles:
    """Read per-client profiles from a CSV (header row) or JSON (a list of objects)."""
    p = Path(path)
    text = _read_text(p, "network.profiles_file")
    if p.suffix.lower() == ".json":
        rows = _parse_json(p, text)
        if isinstance(rows, dict) and "clients" in rows:
            rows = rows["clients"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{p}: expected a list of objects, one per client")
    elif p.suffix.lower() == ".csv":
        rows = [row for _, row in csv_records(text, str(p))]
    else:
        raise bad_value("network.profiles_file", str(p), "a .csv or .json file")
    return profiles_from_rows(rows, source=str(p))


def read_vector(path: str | Path, column: str) -> list[Any]:
    """The per-client values of `method.<column>` from a JSON file (a list, or an object
    with key `column`) or a CSV file (a column named `column`). JSON values are returned
    as given once they are numbers (the caller checks their range); CSV values are floats."""
    p = Path(path)
    text = _read_text(p, f"method.{column}")
    if p.suffix.lower() == ".json":
        data = _parse_json(p, text)
        if isinstance(data, dict):
            if column not in data:
                raise ConfigError(f"{p}: no key {column!r} (keys: {cut(', '.join(data))})")
            data = data[column]
        if not isinstance(data, list):
            raise ConfigError(f"{p}: expected a list of numbers for {column}")
        for i, v in enumerate(data):  # true is no number here (JSON's bool is Python's int)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(
                    f"{p}: method.{column}[{i}] = {cut(json.dumps(v))} is invalid: a number"
                )
        return data
    rows = [row for _, row in csv_records(text, str(p))]
    if not rows or column not in rows[0]:
        raise ConfigError(f"{p}: expected a CSV with a column named {column!r}")
    try:
        return [float(r[column]) for r in rows]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{p}: column {column!r} has a non-number: {cut(str(e))}") from None


def load_problem(
    path: str | Path, overrides: dict[str, Any] | None = None
) -> tuple[PlanProblem, PlanOptions]:
    """Read a PROBLEM.json (schema in docs/planner.md); `overrides` replace option fields
    (the CLI's --solver)."""
    p = Path(path)
    raw = _parse_json(p, _read_text(p))
    return problem_from_dict(raw, source=str(p), overrides=overrides)
