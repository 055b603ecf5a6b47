"""Errors for bad input. The CLI prints them without a traceback and exits 2."""

from __future__ import annotations


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
