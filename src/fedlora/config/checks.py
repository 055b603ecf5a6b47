"""The checks behind every config field: a bad value raises `ConfigError` naming
``section.field``, the value and what is allowed (`fedlora.errors.bad_value`).

`check_device_spec` is the syntax of ``model.device`` (no torch here); whether the device is
present on this machine is `fedlora.llm.device.resolve_device`'s question.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from fedlora.errors import ConfigError, bad_value

DEVICE_FORMS = "auto, cpu, cuda, cuda:N, mps"
DEVICE_SPEC_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """`value` is one of `choices`."""
    if value not in choices:
        raise bad_value(name, value, f"allowed: {', '.join(choices)}")


def check_number(
    name: str,
    value: float,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """`value` is a finite number (not a bool) in the interval [lo, hi]; `lo_open` /
    `hi_open` exclude an end."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise bad_value(name, value, "must be a number")
    if math.isinf(value):
        raise bad_value(name, value, "must be finite")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        sym = ">" if lo_open else ">="
        raise bad_value(name, value, f"must be {sym} {lo}")
    if hi is not None and (value > hi or (hi_open and value == hi)):
        sym = "<" if hi_open else "<="
        raise bad_value(name, value, f"must be {sym} {hi}")


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> None:
    """`value` is an int (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_value(name, value, "must be an integer")
    check_number(name, value, lo=lo, hi=hi)


def check_vector_or_strategy(
    name: str, value: Any, strategies: tuple[str, ...], *, integer: bool
) -> None:
    """A per-client field: a strategy name, a file path (.json/.csv), or an explicit list."""
    if isinstance(value, str):
        if value in strategies or value.endswith((".json", ".csv")):
            return
        raise bad_value(
            name, value, f"a strategy ({', '.join(strategies)}), a .json/.csv file, or a list"
        )
    if not isinstance(value, tuple) or not value:
        raise bad_value(name, value, "a strategy name, a file, or a non-empty list")
    for i, v in enumerate(value):
        if integer:
            check_int(f"{name}[{i}]", v, lo=1)
        else:
            check_number(f"{name}[{i}]", v, lo=0, hi=1, lo_open=True)


SNR_DB_RANGE = (-150.0, 200.0)  # the generated channel's mean SNR over the band, dB


def check_snr_range(
    tx_power_dbm: float,
    noise_dbm: float,
    path_loss_ref_db: float,
    path_loss_exponent: float,
    distances_m: tuple[float, float],
) -> None:
    """The generated clients' SNR (``tx_power_dbm − path loss − noise over f_tot_hz``, in dB,
    from the nearest to the farthest distance) within `SNR_DB_RANGE`: far below it the
    Shannon rate log2(1 + SNR) rounds to 0 (near -156 dB) and an upload never ends; above it
    an upload takes no time. Computed in dB (no overflow); the error names the network fields behind it."""
    near, far = (
        tx_power_dbm - path_loss_ref_db - 10.0 * path_loss_exponent * math.log10(d) - noise_dbm
        for d in distances_m
    )
    lo, hi = SNR_DB_RANGE
    if far < lo or near > hi:
        raise ConfigError(
            f"network.tx_power_dbm = {tx_power_dbm:g} with noise_psd_dbm_hz, f_tot_hz, "
            f"path_loss_ref_db, path_loss_exponent, distance_min_m/distance_max_m gives the "
            f"generated clients an SNR of {far:.4g} to {near:.4g} dB: allowed: within "
            f"[{lo:g}, {hi:g}] dB (below, an upload takes practically forever: the Shannon rate "
            "rounds to 0 near -156 dB; above, it takes no time)"
        )


def check_device_spec(field: str, value: Any) -> None:
    """Syntax only (no torch import): one of auto, cpu, cuda, cuda:N, mps."""
    if not isinstance(value, str) or not DEVICE_SPEC_RE.match(value):
        raise bad_value(field, value, f"allowed: {DEVICE_FORMS}")


def available_memory_bytes() -> int:
    """Memory this machine can still give (``MemAvailable`` of /proc/meminfo; elsewhere the
    physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits_in_memory(
    what: str, fields: str, need_bytes: int, available_bytes: int | None = None
) -> None:
    """Refuse, before allocating, `need_bytes` (exact Python int: no overflow) that exceed
    the available memory; `fields` names the config values behind the size."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if need_bytes > available:
        raise ConfigError(
            f"{fields}: {what} needs {need_bytes / 2**30:.3g} GiB, more than the "
            f"{available / 2**30:.3g} GiB of memory available; choose smaller values"
        )
