"""Readers of user files (every reader of a user-given file lives here, with one error
style: a ConfigError naming the config key or the file, and what is wrong; each file is read
through `fedlora.config.toml_io.read_user_file`: a regular file of at most 64 MiB).

The client profiles (`network.profiles_file`), the q / k vector files (`method.q`,
`method.k`) and the planner's problem files (`fedlora plan PROBLEM.json`); and where fedlora
keeps its own files (`default_cache_dir`). Each reader reads and parses; what the content
means is checked by the system layer (`profiles_from_rows`, `problem_from_dict`). And the
one way fedlora writes a whole file (`atomic_write`), shared by the run directory and the
adapter export.

The user's data files (`read_data_records`: .json lists, .jsonl and .csv records with the
line each starts on; `read_data_text` for a task or template file) are read the same way,
bounded by `MAX_DATA_BYTES`, and every way a parse can fail (a CSV field over csv's limit,
a number of thousands of digits, nesting past the parser's depth) is a `DataError` naming
the file and the line.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedlora.config.toml_io import read_user_file
from fedlora.errors import ConfigError, DataError, bad_value, cut, shown
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


# ----------------------------------------------------------------------------- data files

MAX_DATA_BYTES = 2**30  # the largest data or task file fedlora reads (1 GiB)
DATA_SUFFIXES = (".json", ".jsonl", ".csv")


def read_data_text(path: str | Path, what: str, max_bytes: int = MAX_DATA_BYTES) -> str:
    """The UTF-8 text (a BOM dropped) of the data, task or template file `path`: a regular
    file of at most `max_bytes` (`read_user_file`: a link to /dev/zero or a FIFO is refused
    unread). `DataError` naming `what` and the file when it is missing, unreadable or not
    UTF-8 (the line of the first bad byte)."""
    p = Path(path)
    try:
        data = read_user_file(p, what, max_bytes)
    except FileNotFoundError:
        raise DataError(f"{what}: {shown(str(p))} does not exist") from None
    except OSError as e:
        raise DataError(f"{what}: cannot read {shown(str(p))}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")  # -sig: spreadsheets prepend a BOM
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{cut(str(p))}: line {line}: not UTF-8 text (byte {e.start})") from None


def json_failure(e: Exception) -> str:
    """Why a JSON value could not be read, without its text: the parser's message, or the
    limits of Python's parser (nesting, digits) that raise something else."""
    if isinstance(e, json.JSONDecodeError):
        return e.msg
    if isinstance(e, RecursionError):
        return "nested too deeply (JSON lists and objects inside each other, hundreds deep)"
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
    return f"a number of more than {limit:,} digits"


def json_list_records(text: str, source: str) -> Iterator[tuple[int, Any]]:
    """The values of a JSON list with the line each starts on (one parse per record, so an
    error names its record's line; lines counted as the parse goes, never from the start)."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    line, counted = 1 + text.count("\n", 0, pos), pos
    if not text.startswith("[", pos):
        raise DataError(f"{source}: line {line}: expected a JSON list of records (or use .jsonl)")
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            raise DataError(f"{source}: the JSON list is not closed with ']'")
        line, counted = line + text.count("\n", counted, pos), pos
        if text[pos] == "]":
            return
        try:
            rec, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(f"{source}: line {e.lineno}: {e.msg}") from None
        except (RecursionError, ValueError) as e:
            raise DataError(f"{source}: line {line}: {json_failure(e)}") from None
        yield line, rec
        pos = end


def jsonl_records(text: str, source: str) -> Iterator[tuple[int, Any]]:
    """The values of a JSON Lines text with their line numbers (blank lines skipped; lines
    end at \\n only: a JSON string may hold U+2028)."""
    for n, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except (RecursionError, ValueError) as e:  # JSONDecodeError is a ValueError
                raise DataError(
                    f"{source}: line {n}: not a JSON value: {json_failure(e)}"
                ) from None


def csv_records(text: str, source: str) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a CSV text with a header row, each with the line it starts on (a quoted
    field may span lines). A field longer than csv's limit, a NUL byte or a broken quote is a
    `DataError` naming the line."""
    reader = csv.DictReader(io.StringIO(text, newline=""))
    out, start = [], 2
    try:
        for row in reader:
            out.append((start, row))
            start = reader.line_num + 1
    except csv.Error as e:
        why = str(e)
        if "field limit" in why:
            why = f"a field is longer than {csv.field_size_limit():,} characters (csv's limit)"
        line = reader.reader.line_num  # DictReader's own count stops at the last good row
        raise DataError(f"{source}: line {line}: not CSV: {why}") from None
    return out


def read_data_records(path: str, what: str = "data file") -> list[tuple[str, Any]]:
    """(where, record) for every record of a .json (a list), .jsonl or .csv file, `where`
    naming the file and the line the record starts on; `DataError` for a file that is none
    of these, holds no record, or does not parse (`read_data_text` bounds the read)."""
    suffix = Path(path).suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise DataError(
            f"{shown(path)}: unknown file type {suffix!r}: allowed: {', '.join(DATA_SUFFIXES)}"
        )
    text = read_data_text(path, what)
    source = cut(path)
    if suffix == ".json":
        lines = json_list_records(text, source)
    elif suffix == ".jsonl":
        lines = jsonl_records(text, source)
    else:
        lines = iter(csv_records(text, source))
    out = [(f"{source}: line {n}", rec) for n, rec in lines]
    if not out:
        raise DataError(f"{shown(path)} holds no records")
    return out
