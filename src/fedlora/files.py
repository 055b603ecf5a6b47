"""Readers of user files (issue 11: every reader of a user-given file lives here, with one
error style: a ConfigError naming the config key or the file, and what is wrong).

Today: the client profiles (`network.profiles_file`). The vector files of `method.q` /
`method.k` (fedlora.federation.methods.strategies) and the planner's problem files (fedlora.system.planner)
are still read where they are used; they move here next.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from fedlora.errors import ConfigError, bad_value
from fedlora.system.network import ClientProfiles, profiles_from_rows


def load_profiles(path: str | Path) -> ClientProfiles:
    """Read per-client profiles from a CSV (header row) or JSON (a list of objects)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: spreadsheets prepend a BOM
    except OSError as e:
        raise ConfigError(
            f"network.profiles_file = {str(p)!r}: cannot read: {e.strerror or e}"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"network.profiles_file = {str(p)!r}: not UTF-8 text") from None
    if p.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
            ) from None
        if isinstance(rows, dict) and "clients" in rows:
            rows = rows["clients"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{p}: expected a list of objects, one per client")
    elif p.suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        raise bad_value("network.profiles_file", str(p), "a .csv or .json file")
    return profiles_from_rows(rows, source=str(p))
