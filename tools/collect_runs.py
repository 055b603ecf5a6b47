"""Copy a suite's run files into a results folder, without models or checkpoints.

    .venv/bin/python tools/collect_runs.py runs/powered_table1 results/powered_table1

Per run directory (the main seeds, `pilot/` and `proposed`'s `calibration/` runs): config.toml,
metrics.jsonl, summary.json, clients.csv, plan.json, and predictions.jsonl gzipped
(predictions.jsonl.gz; `gzip -dk` restores it). The suite's own files (suite.toml,
targets.toml, report.md, the PNGs, and sub-reports such as `exact/`) are copied as they are.
Adapters and checkpoints are left out (they are models, not results). Files already in DEST
are replaced, so the command can be run again after more runs finish.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "clients.csv", "plan.json")
SUITE_FILES = ("suite.toml", "targets.toml", "report.md")
SKIP_DIRS = {"adapter", "checkpoints"}


def copy_run(src: Path, dest: Path) -> int:
    """One run directory (and its calibration runs); returns the files written."""
    dest.mkdir(parents=True, exist_ok=True)
    written = 0
    for name in RUN_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
            written += 1
    if (src / "predictions.jsonl").is_file():
        data = (src / "predictions.jsonl").read_bytes()
        (dest / "predictions.jsonl.gz").write_bytes(gzip.compress(data, mtime=0))  # reproducible
        written += 1
    for sub in sorted((src / "calibration").glob("*")) if (src / "calibration").is_dir() else []:
        written += copy_run(sub, dest / "calibration" / sub.name)
    return written


def collect(src: Path, dest: Path) -> int:
    """A suite directory: its files, its report folders and every run under it."""
    dest.mkdir(parents=True, exist_ok=True)
    written = 0
    for path in sorted(src.iterdir()):
        if path.is_file() and (path.name in SUITE_FILES or path.suffix == ".png"):
            shutil.copy2(path, dest / path.name)
            written += 1
        elif path.is_dir() and path.name not in SKIP_DIRS:
            if (path / "config.toml").is_file():
                written += copy_run(path, dest / path.name)
            else:  # pilot/ (runs) or a report folder such as exact/
                written += collect(path, dest / path.name)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="a suite directory (fedlora compare --out)")
    ap.add_argument("dest", type=Path, help="the results folder to write")
    args = ap.parse_args()
    if not args.src.is_dir():
        ap.error(f"src {str(args.src)!r}: no such directory")
    print(f"{collect(args.src, args.dest)} files -> {args.dest}")


if __name__ == "__main__":
    main()
