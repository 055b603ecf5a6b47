"""`fedlora flower run-local | worker`.

`run-local`: a loopback Flower deployment of one experiment. Starts one persistent fedlora
worker per client, `flower-superlink` and one `flower-supernode` per client on 127.0.0.1
(insecure, free ports), submits fedlora's Flower app with `flwr run`, waits for the run's
summary.json, and stops every process it started by PID. Telemetry and update checks are off.

`simulate`: the same apps on Flower's Ray simulation runtime, kept on 127.0.0.1.

`worker`: the node-local persistent worker a SuperNode's ClientApp forwards its requests to
(node_config ``worker-address="127.0.0.1:<port>"``); it listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from fedlora.commands.arguments import add_experiment_arguments
from fedlora.config.toml_io import load_config
from fedlora.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flower", help="run an experiment on Flower (loopback deployment)")
    fsub = p.add_subparsers(dest="flower_command", metavar="ACTION", required=True)
    run = fsub.add_parser(
        "run-local",
        help="start a SuperLink + one SuperNode per client on 127.0.0.1 and run the experiment",
    )
    add_experiment_arguments(run, out_help="run directory", out_required=True, resume=False)
    run.add_argument("--round-timeout-s", type=float, default=600.0)
    run.add_argument("--availability", choices=("none", "observed"), default="none")
    run.add_argument(
        "--app-dir", default=str(REPO), help="directory with the Flower app's pyproject"
    )
    run.add_argument("--timeout-s", type=float, default=24 * 3600.0, help="give up after this long")
    run.add_argument(
        "--no-workers",
        action="store_true",
        help="train inside Flower's per-message ClientApp processes (slow: no persistent worker)",
    )
    run.set_defaults(func=run_local)
    sim = fsub.add_parser(
        "simulate",
        help="run the experiment on Flower's Ray simulation runtime (127.0.0.1 only)",
        description=(
            "Run fedlora's ServerApp and ClientApp with flwr.simulation.run_simulation on "
            "data.n_clients virtual SuperNodes. Ray is kept on 127.0.0.1 (cluster mode off), "
            "without dashboard or usage stats. Needs flwr[simulation] (ray)."
        ),
    )
    add_experiment_arguments(sim, out_help="run directory (required unless --resume)")
    sim.add_argument(
        "--force", action="store_true", help="with --resume: accept a config that differs"
    )
    sim.add_argument("--availability", choices=("none", "observed"), default="none")
    sim.add_argument("--num-cpus", type=int, help="CPUs Ray may use (default: all)")
    sim.add_argument(
        "--client-cpus", type=float, default=1.0, help="CPUs per virtual node's ClientApp"
    )
    sim.set_defaults(func=run_simulate)
    worker = fsub.add_parser(
        "worker",
        help="node-local persistent worker for a SuperNode (listens on 127.0.0.1 only)",
        description=(
            "Keep the model, the LoRA slot and the tokenized partition loaded across rounds. "
            "Start one next to each SuperNode and give the SuperNode "
            "--node-config '... worker-address=\"127.0.0.1:PORT\"'. Runs until killed."
        ),
    )
    worker.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1 (0 = any)")
    worker.add_argument("--data-dir", help="this node's copy of the data (sets data.data_dir)")
    worker.add_argument(
        "--port-file", help="write the bound port here once listening (for --port 0)"
    )
    worker.set_defaults(func=run_worker)


def run_local(args: argparse.Namespace) -> int:
    from fedlora.federation.flower.common import check_flower_method
    from fedlora.federation.flower.deploy import check_log_dir
    from fedlora.federation.run import prepare_run_dir

    if not args.out.strip():
        raise ConfigError(f"--out = {args.out!r} is invalid: a directory path")
    check_timeout("--round-timeout-s", args.round_timeout_s)
    check_timeout("--timeout-s", args.timeout_s)
    if not (Path(args.app_dir) / "pyproject.toml").is_file():
        raise ConfigError(
            f"--app-dir = {args.app_dir!r} is invalid: a directory holding the Flower app's "
            "pyproject.toml (default: fedlora's source checkout)"
        )
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out).resolve()
    log_dir = out.parent / f"{out.name}-logs"

    def flower_checks(c) -> None:  # what only this command needs, checked with the rest
        check_flower_method(c)
        check_log_dir(log_dir)

    # the run's entry (check, resolve, lock, delete with --overwrite, write) before anything
    # starts; the ServerApp's own entry then takes the prepared directory over
    prepare_run_dir(cfg, out, overwrite=args.overwrite, also_check=flower_checks)
    run_config = {
        "fedlora-config": str(Path(args.config).resolve()) if args.config else "",
        "fedlora-overrides": " ".join(shlex.quote(o) for o in args.overrides),
        "out-dir": str(out),
        "overwrite": False,  # prepared here: nothing is left to replace
        "round-timeout-s": float(args.round_timeout_s),
        "availability": args.availability,
    }
    # SIGTERM (kill, `timeout`) unwinds like Ctrl-C: the deployment below stops what it started
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        _deploy(args, cfg, out, run_config, log_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print((out / "summary.json").read_text().strip())
    print(f"results: {out}/metrics.jsonl, summary.json, adapter/")
    return 0


def _deploy(args: argparse.Namespace, cfg, out: Path, run_config: dict, log_dir: Path) -> None:
    from fedlora.federation.flower.deploy import LocalDeployment, wait_for_file

    with tempfile.TemporaryDirectory(prefix="fedlora-flower-") as home:
        with LocalDeployment(
            cfg.data.n_clients,
            home,
            log_dir=log_dir,
            workers=not args.no_workers,
        ) as dep:
            print(f"SuperLink on {dep.address}; {cfg.data.n_clients} SuperNodes", file=sys.stderr)
            print(dep.submit(args.app_dir, run_config).strip(), file=sys.stderr)
            wait_for_file(
                out / "summary.json", args.timeout_s, alive=[dep.superlink], error=out / "error.txt"
            )


def check_timeout(name: str, value: float) -> None:
    """A timeout in seconds: finite and > 0."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} = {value!r} is invalid: a finite number of seconds > 0")


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_worker(args: argparse.Namespace) -> int:
    from fedlora.federation.flower.worker_main import run

    run(args.port, data_dir=args.data_dir, port_file=args.port_file)
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    import importlib.util

    from fedlora.federation.flower.common import (
        FlowerOptions,
        check_flower_method,
        check_flower_resume,
        safe_env,
    )
    from fedlora.federation.flower.processes import watching_tree
    from fedlora.federation.flower.simulation import ray_backend_config, run_simulation
    from fedlora.federation.run import entered
    from fedlora.federation.rundir import resume_given

    if bool(args.out) == bool(args.resume):
        raise ConfigError(
            f"--out = {args.out!r} and --resume = {args.resume!r}: give exactly one of them"
        )
    if args.force and not args.resume:
        raise ConfigError("--force goes with --resume (it accepts a changed config)")
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite with --resume: choose one (continue or replace)")
    ray_backend_config(args.num_cpus, args.client_cpus)  # validate before starting anything
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "fedlora flower simulate needs ray: pip install 'flwr[simulation]==1.41.*'"
        )
    if args.resume:
        out = Path(args.resume).resolve()
        check_flower_resume(out)
        # overrides apply on top of the saved config; a difference is refused, naming it
        cfg = resume_given(out, args.config, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
        out = Path(args.out).resolve()
    # the run's entry, in this process: check, resolve, lock, delete, write; the ServerApp
    # runs on its resolution under its lock; a watchdog stops Ray's processes if this dies
    resume = bool(args.resume)
    entry = entered(
        cfg,
        out,
        resume=resume,
        overwrite=args.overwrite,
        force=args.force,
        also_check=check_flower_method,
    )
    with entry as runtime, watching_tree(safe_env()):
        opts = FlowerOptions(out_dir=str(out), availability=args.availability, entered=runtime)
        cpus = {"num_cpus": args.num_cpus, "client_num_cpus": args.client_cpus}
        summary = run_simulation(runtime.cfg, opts, resume=resume, **cpus)
    print(json.dumps(summary, indent=2))
    print(f"results: {out}/metrics.jsonl, summary.json, adapter/")
    return 0
