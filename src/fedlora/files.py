"""Readers of user files (every reader of a user-given file lives here, with one error
style: a ConfigError naming the config key or the file, and what is wrong; each file is read
through `fedlora.config.toml_io.read_user_file`: a regular file of at most 64 MiB).

The client profiles (`network.profiles_file`), the q / k vector files (`method.q`,
`method.k`) and the planner's problem files (`fedlora plan PROBLEM.json`); and where fedlora
keeps its own files (`default_cache_dir`). Each reader reads and parses; what the content
means is checked by the system layer (`profiles_from_rows`, `problem_from_dict`). And the
one way fedlora writes a whole file (`atomic_write`), shared by the run directory and the
adapter export.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from fedlora.config.toml_io import read_user_file
from fedlora.errors import ConfigError, bad_value, cut, shown
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


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a fsynced temporary file renamed over it: a reader sees
    the old content or the new, never half of it; on failure the temporary file is removed
    (a full disk gets its space back) and the error names `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise with_filename(e, path) from None
    os.replace(tmp, path)


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
        rows = list(csv.DictReader(text.splitlines()))
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
    rows = list(csv.DictReader(text.splitlines()))
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
