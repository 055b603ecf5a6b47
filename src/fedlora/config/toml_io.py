"""TOML in and out: read a config file, apply ``section.key=value`` overrides, and write a
resolved config back as TOML that reads to an equal config. And `read_user_file`, the one
bounded read of a user's file (a config, a q / k / ranks file, a profiles file,
PROBLEM.json, node_times.csv): a regular file of at most `MAX_FILE_BYTES`."""

from __future__ import annotations

import os
import stat
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedlora.config.experiment import ExperimentConfig, config_from_dict
from fedlora.config.method_options import RENAMED_KEYS, drop_old_names, set_renamed
from fedlora.errors import ConfigError, cut

MAX_FILE_BYTES = 64 * 2**20  # the largest user file fedlora reads (64 MiB)


def read_user_file(
    path: str | os.PathLike[str], what: str, max_bytes: int = MAX_FILE_BYTES
) -> bytes:
    """The bytes of the user's file `path`. `ConfigError` naming `what` (``config file``,
    ``method.q = '...'``) when it is not a regular file (a device such as /dev/zero, a FIFO,
    a directory; a link counts as what it points to) or is larger than `max_bytes`
    (checked on the bytes read too: a file may grow, or lie about its size). An `OSError`
    (missing, unreadable) is the caller's to word."""
    p = Path(path)
    cap = f"at most {max_bytes // 2**20:,} MiB is read"
    # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on a regular file)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, pipe or socket"
            raise ConfigError(
                f"{what}: {cut(str(p))!r} is not a regular file ({kind}): give a file"
            )
        if st.st_size > max_bytes:
            raise ConfigError(f"{what}: {cut(str(p))!r} is {st.st_size:,} bytes: {cap}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(f"{what}: {cut(str(p))!r} is over {max_bytes:,} bytes: {cap}")
    return data


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value`` or ``section.table.key=value`` (a key of a sub-table,
    ``method.<name>.<key>=value``: then the key returned is ``table.key``); the value is
    read as TOML, else taken as a bare string. Set it with `set_override`."""
    form = "expected section.key=value or section.table.key=value"
    if "=" not in text:
        raise ConfigError(f"override {cut(repr(text))} is invalid: {form}")
    path, raw_value = text.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"override {cut(repr(text))} is invalid: {form}")
    try:
        value = tomllib.loads(f"v = {raw_value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw_value.strip()
    return parts[0], ".".join(parts[1:]), value


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML file; unreadable or malformed files raise `ConfigError` with the position."""
    p = Path(path)
    try:
        data = read_user_file(p, "config file")
    except OSError as e:
        raise ConfigError(f"cannot read config file {cut(str(p))!r}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {cut(str(p))!r} is not UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {cut(str(p))!r} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"config file {cut(str(p))!r}: TOML nested too deeply") from None


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: typing.Sequence[str] = ()
) -> ExperimentConfig:
    """Defaults, then the TOML file at `path` (if any), then ``section.key=value`` overrides."""
    raw: dict[str, Any] = read_toml(path) if path else {}
    source = str(path) if path else "config"
    apply_overrides(raw, overrides, source=source)
    return config_from_dict(raw, source=source)


def apply_overrides(raw: dict[str, Any], overrides: typing.Sequence[str], *, source: str) -> None:
    """Set each ``section.key=value`` of `overrides` in the raw (TOML-shaped) dict, in place."""
    for text in overrides:
        section, key, value = parse_override(text)
        set_override(raw, section, key, value, source=source)


def set_override(raw: dict[str, Any], section: str, key: str, value: Any, *, source: str) -> None:
    """Set `section`.`key` (a `parse_override` key: ``key`` or ``table.key``) to `value` in
    the raw dict, in place; a sub-table is copied first (never changed under another
    holder of it). A renamed flat key (`RENAMED_KEYS`) is set at its new place, with a
    FutureWarning: an override replaces what the file's table had."""
    if f"{section}.{key}" in RENAMED_KEYS:
        set_renamed(raw, f"{section}.{key}", value, source=source)
        return
    values = raw.setdefault(section, {})
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: [{section}] must be a table")
    table, _, leaf = key.rpartition(".")
    if not table:
        values[key] = value
        return
    if not isinstance(values.get(table, {}), dict):
        raise ConfigError(f"{source}: {section}.{table} must be a table [{section}.{table}]")
    drop_old_names(values, f"{section}.{key}")  # the override replaces an old flat key's
    values[table] = {**values.get(table, {}), leaf: value}


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def toml_string(value: str) -> str:
    """`value` as a TOML basic string: quotes, backslashes and control characters escaped
    (an unescaped control character makes the file unreadable)."""
    out = []
    for ch in value:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """`value` (bool, int, float, str, a list of them, or a mapping of identifiers to them:
    an inline table) as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping) and all(isinstance(k, str) and k.isidentifier() for k in value):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(config: ExperimentConfig) -> str:
    """The fully resolved config as TOML; `load_config` reads it back to an equal config."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        tables = {k: v for k, v in values.items() if isinstance(v, dict)}  # [method.<name>]
        for name, keys in [(section, values), *((f"{section}.{k}", v) for k, v in tables.items())]:
            lines.append(f"[{name}]")
            lines.extend(
                f"{key} = {toml_value(value)}"
                for key, value in keys.items()
                if not isinstance(value, dict)
            )
            lines.append("")
    return "\n".join(lines)
