"""machine.jsonl: which machine computed each stretch of a run.

A run that is stopped and resumed (a study parked between sessions, a killed job restarted)
may finish on another machine than it started on. fp32 kernels differ between CPU kinds
(AVX2, AVX-512, AMX) and GPUs, so the same seed gives the same printed accuracies on the
machines measured but not the same bits: a reader of the results needs to know which machine
computed which rounds. `run_rounds` appends one line each time a run starts or resumes::

    {"from_round": 400, "at": "2026-11-28T18:25:10Z", "cpu_model": "AMD EPYC",
     "simd": "avx512", "cpu_flags": ["avx", "avx2", "avx512f", ...], "logical_cpus": 2,
     "device": "cpu", "gpu": null, "torch": "2.13.0", "torch_threads": 1,
     "transformers": "...", "python": "3.11.7", "platform": "x86_64", "fedlora": "0.1.0",
     "trains": "here"}

A line covers the rounds after `from_round` until a later line's `from_round` (a resume
recomputes the rounds after its checkpoint, so a later line supersedes what an earlier one
covered from there on): `stretches` gives each line with the rounds it still covers. A fresh
start replaces the file. Runs written before this file existed have none; their stretches
are unrecorded. ``trains`` is ``remote`` on Flower: the server's machine is recorded, the
SuperNodes' are not. Reading tolerates a torn last line (a run killed mid-write).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedlora.files import append_file, remove_own_file

MACHINE_FILE = "machine.jsonl"
# the flags that decide which fp32 kernels run (x86 SIMD levels, Arm's asimd/sve)
KERNEL_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "sve",
)
# the widest SIMD level first: a stretch's `simd` is the first of these its CPU has
SIMD_LEVELS = (
    ("amx_bf16", "amx"),
    ("avx512f", "avx512"),
    ("avx2", "avx2"),
    ("avx", "avx"),
    ("sve", "sve"),
    ("asimd", "neon"),
)


def cpu_model(cpuinfo: str) -> str:
    """The CPU's name from /proc/cpuinfo text (x86 ``model name``, else ``Hardware`` or
    ``CPU part``); "" when it names none."""
    for key in ("model name", "Hardware", "CPU part"):
        for line in cpuinfo.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return value.strip()
    return ""


def kernel_flags(flags: Iterable[str]) -> list[str]:
    """The flags among `flags` that decide the kernels, in `KERNEL_FLAGS` order."""
    have = set(flags)
    return [f for f in KERNEL_FLAGS if f in have]


def simd_level(flags: Iterable[str]) -> str:
    """The widest SIMD level of a CPU with `flags` ("amx", "avx512", "avx2", "avx", "sve",
    "neon"), or "unknown"."""
    have = set(flags)
    return next((level for flag, level in SIMD_LEVELS if flag in have), "unknown")


def machine_facts(device: str, *, trains_here: bool = True, cpuinfo: str | None = None) -> dict:
    """What decides a stretch's numerics and speed on this machine, for `device` ("cpu",
    "cuda:0", "mps"); `cpuinfo`: /proc/cpuinfo's text (read when None)."""
    import torch
    import transformers

    from fedlora import __version__
    from fedlora.llm.device import cpu_flags, read_cpuinfo

    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    flags = cpu_flags(text)
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else None
    return {
        "cpu_model": cpu_model(text) or platform.processor(),
        "simd": simd_level(flags),
        "cpu_flags": kernel_flags(flags),
        "logical_cpus": os.cpu_count(),
        "device": device,
        "gpu": gpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.machine(),
        "fedlora": __version__,
        "trains": "here" if trains_here else "remote",
    }


def record_stretch(run_dir: Path, from_round: int, facts: dict[str, Any], *, fresh: bool) -> None:
    """Append the line of a stretch starting after `from_round` (a fresh start first removes
    the file an earlier run in `run_dir` left)."""
    path = run_dir / MACHINE_FILE
    if fresh:
        remove_own_file(path)
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line = {"from_round": int(from_round), "at": at, **facts}
    append_file(path, (json.dumps(line) + "\n").encode("utf-8"))


def read_machine_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of `run_dir`'s machine.jsonl ([] without one); a torn or foreign last line
    is dropped, a damaged earlier line too (this file informs, it never stops a run)."""
    try:
        raw = (run_dir / MACHINE_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    lines = []
    for text in raw.splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and isinstance(line.get("from_round"), int):
            lines.append(line)
    return lines


def stretches(lines: list[dict[str, Any]]) -> list[tuple[int, int | None, dict[str, Any]]]:
    """(first round, last round or None for "to the end", line) of each line that still
    covers rounds: a line covers the rounds after its `from_round` up to the lowest
    `from_round` of the lines after it (those recomputed what came later)."""
    kept: list[tuple[int, int | None, dict[str, Any]]] = []
    upto: int | None = None  # the lowest from_round of the later lines
    for line in reversed(lines):
        start = line["from_round"]
        if upto is None or start < upto:
            kept.append((start + 1, upto, line))
            upto = start
    return kept[::-1]


def machine_kind(line: dict[str, Any]) -> str:
    """A stretch's machine, as one comparable label: "AMD EPYC (avx2)", "NVIDIA H200 (cuda)"."""
    if line.get("gpu"):
        return f"{line['gpu']} (cuda)"
    if str(line.get("device", "cpu")) == "mps":
        return f"{line.get('cpu_model') or 'Apple'} (mps)"
    return f"{line.get('cpu_model') or 'unknown CPU'} ({line.get('simd', 'unknown')})"


def _merged(run_dir: Path) -> list[tuple[int, int | None, str]]:
    """(first round, last round or None, machine kind) of `run_dir`'s stretches, back-to-back
    stretches of one kind joined."""
    merged: list[tuple[int, int | None, str]] = []
    for first, last, line in stretches(read_machine_lines(run_dir)):
        kind = machine_kind(line)
        if merged and merged[-1][2] == kind:
            merged[-1] = (merged[-1][0], last, kind)
        else:
            merged.append((first, last, kind))
    return merged


def describe_machines(run_dir: Path) -> str:
    """One line: the machine kind of each stretch of `run_dir` with its rounds, back-to-back
    stretches of one kind joined ("rounds 1-400 unrecorded" for the rounds before the first
    line); "" without a machine.jsonl."""
    merged = _merged(run_dir)
    if not merged:
        return ""
    parts = [f"rounds 1-{merged[0][0] - 1} unrecorded"] if merged[0][0] > 1 else []
    for first, last, kind in merged:
        parts.append(f"rounds {first}-{'' if last is None else last} {kind}")
    return "; ".join(parts)


def machine_summary(run_dir: Path) -> str:
    """A report cell: the one machine kind of a run computed on one kind from round 1,
    `describe_machines` otherwise, "unrecorded" without a machine.jsonl."""
    merged = _merged(run_dir)
    if len(merged) == 1 and merged[0][0] == 1:
        return merged[0][2]
    return describe_machines(run_dir) or "unrecorded"
