"""Errors for bad input. The CLI prints them without a traceback and exits 2."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class FedloraError(Exception):
    """Base class for every user-facing error in fedlora."""


class ConfigError(FedloraError, ValueError):
    """A configuration value, option or input file is invalid.

    The message names the field, the bad value and what is allowed.
    """


class DataError(FedloraError, ValueError):
    """A data file, task or record cannot be used."""


def bad_value(field: str, value: object, allowed: str) -> ConfigError:
    """Build the standard message: ``field = value is invalid: allowed``."""
    return ConfigError(f"{field} = {value!r} is invalid: {allowed}")


def suggest_key(name: str, valid: Sequence[str]) -> str:
    """The hint after an unknown key: `` (did you mean 'x'?)`` for a close valid key, else
    `` (valid: a, b, ...)``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(valid)})"
