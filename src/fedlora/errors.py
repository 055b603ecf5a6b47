"""Errors for bad input. The CLI prints them without a traceback and exits 2.

A value shown in a message is cut to `SHOWN_CHARS` characters (`shown`), so a 10 MB value
gives a one-line error, not a 10 MB one; `FedloraError` applies the same cut to any word of
its message longer than that, for messages built without `shown`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

SHOWN_CHARS = 200  # at most this many characters of a value in an error message


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text`, or its first `limit` characters and how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` cut to `limit` characters: how a message shows a user's value."""
    return cut(repr(value), limit)


MAX_MESSAGE_CHARS = 20 * SHOWN_CHARS  # a message longer than this loses its middle


def _cut_words(message: str) -> str:
    """Every space-free run of `message` longer than 2 × SHOWN_CHARS cut to SHOWN_CHARS;
    then, past MAX_MESSAGE_CHARS, the middle (the field leads a message, what is allowed
    ends it)."""
    if len(message) <= 2 * SHOWN_CHARS:
        return message
    words = message.split(" ")
    if any(len(w) > 2 * SHOWN_CHARS for w in words):
        message = " ".join(w if len(w) <= 2 * SHOWN_CHARS else cut(w) for w in words)
    if len(message) > MAX_MESSAGE_CHARS:
        head, tail = MAX_MESSAGE_CHARS * 5 // 8, MAX_MESSAGE_CHARS // 4
        left = len(message) - head - tail
        message = f"{message[:head]} ... ({left:,} characters cut) ... {message[-tail:]}"
    return message


class FedloraError(Exception):
    """Base class for every user-facing error in fedlora."""

    def __str__(self) -> str:
        return _cut_words(super().__str__())


class ConfigError(FedloraError, ValueError):
    """A configuration value, option or input file is invalid.

    The message names the field, the bad value and what is allowed.
    """


class DataError(FedloraError, ValueError):
    """A data file, task or record cannot be used."""


def bad_value(field: str, value: object, allowed: str) -> ConfigError:
    """Build the standard message: ``field = value is invalid: allowed`` (the value cut to
    `SHOWN_CHARS` characters)."""
    return ConfigError(f"{field} = {shown(value)} is invalid: {allowed}")


def suggest_key(name: str, valid: Sequence[str]) -> str:
    """The hint after an unknown key: `` (did you mean 'x'?)`` for a close valid key, else
    `` (valid: a, b, ...)``."""
    close = difflib.get_close_matches(cut(name), list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(valid)})"
