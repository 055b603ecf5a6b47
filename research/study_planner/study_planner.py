"""The planner study's runner (rule: research/study_planner/study_planner.md; config: research/study_planner/study_planner.toml).
Not a timing benchmark: it runs every arm in-process (`research.study_planner.study_runner`), records
each finished run in ledger.jsonl (a restart skips it) and writes the report
(`research.study_planner.study_report`).

    .venv/bin/python research/study_planner/study_planner.py check
    .venv/bin/python research/study_planner/study_planner.py pilot  --out results/study_planner [--commit]
    .venv/bin/python research/study_planner/study_planner.py run    --out results/study_planner [--commit]
    .venv/bin/python research/study_planner/study_planner.py report --out results/study_planner
    .venv/bin/python research/study_planner/study_planner.py park   --out results/study_planner
    .venv/bin/python research/study_planner/study_planner.py status --out results/study_planner

`--config` takes another study config (the tests' tiny one); `--commit` git-commits each
finished run directory (and the ledger, and rule.json) as it lands. One runner per core:
`pilot --only LABEL...` and `run --seeds S... --arms LABEL...` take a share of the jobs (a
job's config does not depend on the runner that runs it; rule.json is written by the pilot
runner that finds every pilot run finished):

    taskset -c 0 .venv/bin/python research/study_planner/study_planner.py run --seeds 0 1 --commit &
    taskset -c 1 .venv/bin/python research/study_planner/study_planner.py run --seeds 2 --commit &

A run longer than a session (FSLoRA's arms, hours on a 2-core CPU) survives it by `park`:
stop the runners first (a killed run resumes from its last checkpoint), then `park` commits
each unfinished run's resumable state (its files so far, its run marker and its newest
checkpoint; the .gitignore keeps checkpoints out otherwise) and untracks the parked state of
runs that have finished since. The next session's runner resumes them from that checkpoint.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `research`
CONFIG = Path(__file__).with_name("study_planner.toml")


def main(argv: list[str] | None = None) -> int:
    from fedlora.errors import FedloraError
    from research.study_planner.study_report import write_study_report
    from research.study_planner.study_runner import pilot_stage, run_stage, stderr_log
    from research.study_planner.study_spec import load_spec
    from research.study_planner.study_status import render_status

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("check", "pilot", "run", "report", "park", "status"))
    ap.add_argument("--out", type=Path, default=Path("results/study_planner"))
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--commit", action="store_true", help="git-commit each finished run")
    ap.add_argument("--only", nargs="+", default=[], help="pilot: just these labels")
    ap.add_argument("--seeds", nargs="+", type=int, default=[], help="run: just these seeds")
    ap.add_argument("--arms", nargs="+", default=[], help="run: just these arms")
    ap.add_argument(
        "--figure", type=Path, help="status: also draw every pilot run's curve to this PNG"
    )
    args = ap.parse_args(argv)
    try:
        if args.stage == "report":
            print(f"report: {write_study_report(args.out)}")
            return 0
        if args.stage == "park":
            parked = park(args.out)
            print(f"parked {len(parked)} unfinished run(s): {', '.join(map(str, parked)) or '-'}")
            return 0
        spec = load_spec(args.config)
        if args.stage == "status":  # reads files only: safe beside running runners
            if args.figure is not None and (
                args.figure.is_dir() or args.figure.suffix.lower() != ".png"
            ):
                print(
                    f"error: --figure {str(args.figure)!r}: not a path to a .png file "
                    "(give one like results/study_planner_v2/pilot_curves.png)",
                    file=sys.stderr,
                )
                return 2
            print(render_status(spec, args.out), end="")
            if args.figure:
                from research.study_planner.study_figures import pilot_figure

                drawn = pilot_figure(spec, args.out, args.figure)
                print(f"figure: {drawn or 'none (no pilot run has an evaluation yet)'}")
            return 0
        print(f"config valid, with every arm's overrides: {args.config}")
        if not spec.protocol_fixed:
            msg = (
                "[study] protocol_fixed = false: set the CPU protocol of research/cpu_protocol/cpu_protocol.md "
                f"in {args.config} first (research/study_planner/study_planner.md)"
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


def _git(out: Path, *argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=out, capture_output=True, text=True, check=True)
    return done.stdout


def park(out: Path) -> list[Path]:
    """Commit the resumable state of every unfinished run under `out` (see the module's
    docstring) and untrack the parked state of finished runs; the unfinished runs' dirs."""
    from fedlora.errors import ConfigError
    from fedlora.federation.runmarker import MARKER_NAME
    from research.study_planner.study_runner import finished, result_files

    out = out.resolve()
    if subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=out).returncode:
        raise ConfigError(f"park: the index of {out}'s repository has staged changes: commit first")
    tracked = set(_git(out, "ls-files", "-z", "--full-name", ".").split("\0")) - {""}
    top = Path(_git(out, "rev-parse", "--show-toplevel").strip())
    add: list[Path] = []
    untrack: list[Path] = []
    parked: list[Path] = []
    for config in sorted(out.rglob("config.toml")):
        run_dir = config.parent
        state = sorted((run_dir / "checkpoints").glob("round-*"))
        if finished(run_dir):
            keep: list[Path] = []
        else:
            newest = state[-1].name.split(".")[0] if state else None
            keep = [p for p in state if p.name.split(".")[0] == newest]
            marker = [run_dir / MARKER_NAME] if (run_dir / MARKER_NAME).is_file() else []
            add += result_files(run_dir) + marker + keep
            parked.append(run_dir)
        for name in tracked:
            path = top / name
            in_state = path.parent == run_dir / "checkpoints" or path == run_dir / MARKER_NAME
            if in_state and path not in keep and not (path.name == MARKER_NAME and keep):
                untrack.append(path)
    if untrack:
        _git(out, "rm", "-q", "--cached", "--ignore-unmatch", "--", *map(str, untrack))
    if add:
        _git(out, "add", "-f", "--", *map(str, add))
    if add or untrack:  # a plain commit: only what park staged (checked above) goes in
        message = f"study_planner park: {len(parked)} unfinished run(s) resumable from here"
        _git(out, "commit", "-q", "-m", message)
    return [p.relative_to(out) for p in parked]


if __name__ == "__main__":
    sys.exit(main())
