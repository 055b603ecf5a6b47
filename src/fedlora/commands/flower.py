"""`fedlora flower run-local`: a loopback Flower deployment of one experiment.

Starts `flower-superlink` and one `flower-supernode` per client on 127.0.0.1 (insecure, free
ports), submits fedlora's Flower app with `flwr run`, waits for the run's summary.json, and
stops every process it started by PID. Telemetry and update checks are off.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from fedlora.config import load_config

REPO = Path(__file__).resolve().parents[3]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flower", help="run an experiment on Flower (loopback deployment)")
    fsub = p.add_subparsers(dest="flower_command", metavar="ACTION", required=True)
    run = fsub.add_parser(
        "run-local",
        help="start a SuperLink + one SuperNode per client on 127.0.0.1 and run the experiment",
    )
    run.add_argument("--config", "-c", help="experiment TOML (defaults otherwise)")
    run.add_argument("overrides", nargs="*", metavar="section.key=value")
    run.add_argument("--out", "-o", required=True, help="run directory")
    run.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    run.add_argument("--round-timeout-s", type=float, default=600.0)
    run.add_argument("--availability", choices=("none", "observed"), default="none")
    run.add_argument(
        "--app-dir", default=str(REPO), help="directory with the Flower app's pyproject"
    )
    run.add_argument("--timeout-s", type=float, default=24 * 3600.0, help="give up after this long")
    run.set_defaults(func=run_local)


def run_local(args: argparse.Namespace) -> int:
    from fedlora.engine import prepare_run_dir
    from fedlora.flower.common import LocalDeployment, wait_for_file

    cfg = load_config(args.config, args.overrides)  # validate before starting anything
    out = Path(args.out).resolve()
    prepare_run_dir(cfg, out, overwrite=args.overwrite)  # refuses an existing run early
    run_config = {
        "fedlora-config": str(Path(args.config).resolve()) if args.config else "",
        "fedlora-overrides": " ".join(shlex.quote(o) for o in args.overrides),
        "out-dir": str(out),
        "overwrite": True,  # the directory was just prepared here
        "round-timeout-s": float(args.round_timeout_s),
        "availability": args.availability,
    }
    with tempfile.TemporaryDirectory(prefix="fedlora-flower-") as home:
        with LocalDeployment(
            cfg.data.n_clients, home, log_dir=out.parent / f"{out.name}-logs"
        ) as dep:
            print(f"SuperLink on {dep.address}; {cfg.data.n_clients} SuperNodes", file=sys.stderr)
            print(dep.submit(args.app_dir, run_config).strip(), file=sys.stderr)
            wait_for_file(
                out / "summary.json", args.timeout_s, alive=[dep.superlink], error=out / "error.txt"
            )
    print((out / "summary.json").read_text().strip())
    print(f"results: {out}/metrics.jsonl, summary.json, adapter/")
    return 0
