"""A method's own options: the ``[method.<name>]`` tables of a config, kept here as given.

The config layer sits below the methods and cannot see their registry, so ``method.options``
holds each table raw (frozen: `FrozenTable`); the method's class builds its options
dataclass from its table and validates it (`fedlora.federation.methods.base.Method.options`,
`read_options`), and the registry refuses a table that names no method.

`RENAMED_KEYS`: flat ``section.key`` names that moved into a table (a method's options into
``[method.<name>]``, ``data.mc_*`` into ``[data.mc]``). They are still read, with a
`FutureWarning`, so configs and run directories written before keep working; the same value
given both ways is accepted, two different values are a ConfigError. A closed history of
renames: a new method's options exist only in its own table, never here.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from fedlora.errors import ConfigError, bad_value

# the section field that holds a section's sub-tables ([method.<name>])
SUBTABLES = "options"

# old flat name -> its place now (section.table.key)
RENAMED_KEYS = {
    "method.heterolora_pruning": "method.heterolora.pruning",
    "method.fslora_k": "method.fslora.k",
    # your own multiple-choice data: the [data.mc] table (fedlora.config.data_mc)
    "data.mc_files": "data.mc.files",
    "data.mc_eval_files": "data.mc.eval_files",
    "data.mc_task": "data.mc.task",
    "data.mc_question": "data.mc.question",
    "data.mc_choices": "data.mc.choices",
    "data.mc_answer": "data.mc.answer",
    "data.mc_answer_type": "data.mc.answer_type",
    "data.mc_context": "data.mc.context",
}


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenTable(value)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


class FrozenTable(Mapping[str, Any]):
    """An immutable, hashable, picklable mapping (lists become tuples, tables FrozenTables),
    keys in sorted order; equal to any mapping of the same items."""

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        items = sorted(dict(values or {}).items())
        self._items = tuple((k, _freeze(v)) for k, v in items)
        self._index = dict(self._items)

    def __getitem__(self, key: str) -> Any:
        return self._index[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return repr(self._index)


def check_option_tables(tables: Any, reserved: tuple[str, ...]) -> FrozenTable:
    """``method.options`` frozen: a mapping of table names (identifiers that are none of the
    section's own keys, `reserved`) to tables of ``key = value`` (no deeper tables)."""
    if not isinstance(tables, Mapping):
        raise bad_value("method.options", tables, "a mapping of [method.<name>] tables")
    for name, table in tables.items():
        if not isinstance(name, str) or not name.isidentifier() or name in reserved:
            raise bad_value(
                f"method.{name}", table, "a key of [method], or a table [method.<method name>]"
            )
        if not isinstance(table, Mapping):
            raise bad_value(f"method.{name}", table, "a table of key = value")
        for key, value in table.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise bad_value(f"method.{name}.{key}", value, "a key that is an identifier")
            if isinstance(value, Mapping):
                raise bad_value(
                    f"method.{name}.{key}", value, "a value (a method's table holds no tables)"
                )
    return tables if isinstance(tables, FrozenTable) else FrozenTable(tables)


def _split(path: str) -> tuple[str, str, str]:
    section, table, key = path.split(".")
    return section, table, key


def drop_old_names(values: dict[str, Any], path: str) -> None:
    """Remove from the section `values` (in place) the flat keys renamed to `path`
    (``section.table.key``): a value set at `path` replaces theirs."""
    for old, new in RENAMED_KEYS.items():
        if new == path:
            values.pop(old.split(".")[1], None)


def set_renamed(
    raw: dict[str, Any], old: str, value: Any, *, source: str, warn: bool = True
) -> None:
    """Set the renamed key `old` (``section.key``) to `value` at its new place in `raw`
    (in place; the table is copied, never changed under another holder), with a
    FutureWarning unless `warn` is False. An override: it replaces what the table had."""
    section, table, key = _split(RENAMED_KEYS[old])
    values = raw.setdefault(section, {})
    if not isinstance(values, dict) or not isinstance(values.get(table, {}), dict):
        raise ConfigError(f"{source}: [{section}] and [{section}.{table}] must be tables")
    values.pop(old.split(".")[1], None)
    values[table] = {**values.get(table, {}), key: value}
    if warn:
        _warn(old, value, source)


def _warn(old: str, value: Any, source: str) -> None:
    section, table, key = _split(RENAMED_KEYS[old])
    try:  # TOML's spelling of a string, number, boolean or list
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    warnings.warn(
        f"{source}: {old} is deprecated: write it as [{section}.{table}] {key} = {shown} "
        f"(on the command line: {section}.{table}.{key}={shown})",
        FutureWarning,
        stacklevel=1,  # fedlora's own line: shown by the CLI's quiet terminal
    )


def upgrade_renamed_keys(raw: dict[str, Any], *, source: str, warn: bool = True) -> dict[str, Any]:
    """`raw` (``{section: {key: value}}``) with every key of `RENAMED_KEYS` moved to its table;
    a copy where anything moved (the caller's dicts are kept as they are). ConfigError when a
    table gives the same key another value."""
    for old, new in RENAMED_KEYS.items():
        section, flat = old.split(".")
        values = raw.get(section)
        if not isinstance(values, dict) or flat not in values:
            continue
        _, table, key = _split(new)
        given = values.get(table, {})
        if isinstance(given, dict) and key in given and given[key] != values[flat]:
            raise ConfigError(
                f"{source}: {old} = {values[flat]!r} and {new} = {given[key]!r} disagree: "
                f"{old} is the old name of {new}; give only [{section}.{table}] {key}"
            )
        raw = {**raw, section: {k: v for k, v in values.items() if k != flat}}
        set_renamed(raw, old, values[flat], source=source, warn=warn)
    return raw
