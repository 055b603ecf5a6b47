"""The planner study's runner (rule: docs/study_planner.md; config: configs/study_planner.toml).
Not a timing benchmark: it runs every arm in-process (`fedlora.studies.study_runner`), records
each finished run in ledger.jsonl (a restart skips it) and writes the report
(`fedlora.studies.study_report`).

    .venv/bin/python bench/study_planner.py check
    .venv/bin/python bench/study_planner.py pilot  --out results/study_planner [--commit]
    .venv/bin/python bench/study_planner.py run    --out results/study_planner [--commit]
    .venv/bin/python bench/study_planner.py report --out results/study_planner

`--config` takes another study config (the tests' tiny one); `--commit` git-commits each
finished run directory (and the ledger, and rule.json) as it lands. One runner per core:
`pilot --only LABEL...` and `run --seeds S... --arms LABEL...` take a share of the jobs (a
job's config does not depend on the runner that runs it; rule.json is written by the pilot
runner that finds every pilot run finished):

    taskset -c 0 .venv/bin/python bench/study_planner.py run --seeds 0 1 --commit &
    taskset -c 1 .venv/bin/python bench/study_planner.py run --seeds 2 --commit &
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CONFIG = Path(__file__).parents[1] / "configs" / "study_planner.toml"


def main(argv: list[str] | None = None) -> int:
    from fedlora.errors import FedloraError
    from fedlora.studies.study_report import write_study_report
    from fedlora.studies.study_runner import pilot_stage, run_stage, stderr_log
    from fedlora.studies.study_spec import load_spec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("check", "pilot", "run", "report"))
    ap.add_argument("--out", type=Path, default=Path("results/study_planner"))
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--commit", action="store_true", help="git-commit each finished run")
    ap.add_argument("--only", nargs="+", default=[], help="pilot: just these labels")
    ap.add_argument("--seeds", nargs="+", type=int, default=[], help="run: just these seeds")
    ap.add_argument("--arms", nargs="+", default=[], help="run: just these arms")
    args = ap.parse_args(argv)
    try:
        if args.stage == "report":
            print(f"report: {write_study_report(args.out)}")
            return 0
        spec = load_spec(args.config)
        print(f"config valid, with every arm's overrides: {args.config}")
        if not spec.protocol_fixed:
            msg = (
                "[study] protocol_fixed = false: set the CPU protocol of docs/cpu_protocol.md "
                f"in {args.config} first (docs/study_planner.md)"
            )
            if args.stage == "check":
                print(msg)
                return 0
            print(f"error: {msg}", file=sys.stderr)
            return 2
        if args.stage == "pilot":
            pilot_stage(spec, args.out, commit=args.commit, log=stderr_log, only=args.only)
        elif args.stage == "run":
            run_stage(
                spec,
                args.out,
                commit=args.commit,
                log=stderr_log,
                seeds=args.seeds,
                arms_only=args.arms,
            )
    except FedloraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
