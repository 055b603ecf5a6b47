"""What the research recipes share (research/README.md): one measured `fedlora run` (wall and
CPU seconds, load, CPU flags, the code commit, for run_info.json) and a run's predictions by
round and task. Not part of the product: `fedlora` never imports the research tree."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import shutil
import subprocess
import time
from pathlib import Path

RUN_FILES = ("config.toml", "metrics.jsonl", "predictions.jsonl", "summary.json", "clients.csv")


def cpu_flags() -> str:
    try:
        flags = next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.processor()
    keep = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in keep if f in flags)


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True)
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def measured(label: str, run, run_dir: Path, dest: Path) -> dict:
    """Call `run()` (one `fedlora run` into `run_dir`), copy its files to `dest` and return
    what run_info.json records of it: wall and CPU seconds of the child processes, the
    1-minute load before and after, CPU flags and model, the code commit."""
    load0 = os.getloadavg()
    print(f"[{time.strftime('%H:%M:%S')}] {label} (load {load0[0]:.2f})", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    run()
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    dest.mkdir(parents=True, exist_ok=True)
    for f in RUN_FILES:
        shutil.copy2(run_dir / f, dest / f)
    return {
        "wall_s": round(wall, 1),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
        "load_1min_start": round(load0[0], 2),
        "load_1min_end": round(os.getloadavg()[0], 2),
        "cpu_flags": cpu_flags(),
        "cpu_model": platform.processor() or platform.machine(),
        "commit": git_commit(),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def read_predictions(run_dir: Path) -> dict[int, dict[str, dict]]:
    """round -> task -> its predictions line."""
    out: dict[int, dict[str, dict]] = {}
    for raw in (run_dir / "predictions.jsonl").read_text().splitlines():
        line = json.loads(raw)
        out.setdefault(line["round"], {})[line["task"]] = line
    return out


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal: 0.508 -> "50.8"."""
    return f"{100 * x:.1f}"


def gain_interval(pair: dict) -> str:
    """A paired change (`paired_change`'s gain and gain_ci95) in points with its interval:
    "+2.4 [-1.8, +6.6]" ("[-]" when the interval is undefined)."""
    lo, hi = pair["gain_ci95"]
    if math.isnan(lo):
        return f"{100 * pair['gain']:+.1f} [-]"
    return f"{100 * pair['gain']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
