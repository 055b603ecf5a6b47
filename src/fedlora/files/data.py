"""Readers of the user's data files: `read_data_records` (.json lists, .jsonl and .csv
records with the line each starts on) and `read_data_text` (a task or template file), each
a regular file of at most `MAX_DATA_BYTES` (`fedlora.config.toml_io.read_user_file`); every
way a parse can fail (a CSV field over csv's limit, a number of thousands of digits, nesting
past the parser's depth) is a `DataError` naming the file and the line.

Within `reading_once()` (a run, from its checks to its build: `fedlora.federation.run.entered`)
`read_data_records` reads and parses each file once: the checks' read is the one the build
uses, so the run trains on the records that were checked.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from fedlora.config.toml_io import read_user_file
from fedlora.errors import DataError, cut, shown

MAX_DATA_BYTES = 2**30  # the largest data or task file fedlora reads (1 GiB)
DATA_SUFFIXES = (".json", ".jsonl", ".csv")

Records = list[tuple[str, Any]]  # (where: "file: line N", record) per record
# the records read within `reading_once`, by (the path as given, its absolute form)
_READ_ONCE: ContextVar[dict[tuple[str, str], tuple[tuple[str, Any], ...]] | None] = ContextVar(
    "fedlora_read_once", default=None
)


@contextmanager
def reading_once() -> Iterator[None]:
    """Within: `read_data_records` (and `read_once`) reads and parses each file once (in
    this thread; a scope inside another is the outer one) and hands every later caller those
    records (shared: read them, never change them). Outside, every call reads the file."""
    if _READ_ONCE.get() is not None:
        yield
        return
    token = _READ_ONCE.set({})
    try:
        yield
    finally:
        _READ_ONCE.reset(token)


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


def read_data_records(path: str, what: str = "data file") -> Records:
    """(where, record) for every record of a .json (a list), .jsonl or .csv file, `where`
    naming the file and the line the record starts on; `DataError` for a file that is none
    of these, holds no record, or does not parse (`read_data_text` bounds the read). Within
    `reading_once`, the records of the first read of `path`."""
    return read_once(path, lambda: _read_records(path, what))


def read_once(source: str, read: Callable[[], Records]) -> Records:
    """`read()`, the records of `source` (a file, a hub dataset); within `reading_once`,
    those of the first call for `source` (a path: with the directory it is relative to)."""
    done = _READ_ONCE.get()
    if done is None:
        return read()
    key = (str(source), os.path.abspath(source))
    if key not in done:
        done[key] = tuple(read())
    return list(done[key])


def _read_records(path: str, what: str) -> Records:
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
