"""`fedlora run`: one federated experiment (`make demo` is `--config configs/demo.toml`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from fedlora.commands.arguments import add_experiment_arguments
from fedlora.config.experiment import config_from_dict
from fedlora.config.toml_io import apply_overrides, load_config, read_toml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a federated experiment (the demo: --config configs/demo.toml)",
        description=(
            "Run a federated LoRA experiment with a simulated wireless clock. With no arguments "
            "it runs the demo: SmolLM2-135M, the commonsense mix, 20 clients with Dirichlet(0.1) "
            "over tasks, rank 16, heterogeneous clients, the paper's Algorithm 1 with fixed q and k."
        ),
    )
    add_experiment_arguments(p, out_help="run directory (default: <output.dir>/<output.name>)")
    p.add_argument(
        "--force", action="store_true", help="with --resume: accept a config that differs"
    )
    p.add_argument("--data-dir", help="commonsense data directory (sets data.data_dir)")
    p.add_argument("--quiet", "-q", action="store_true", help="log lines instead of a progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fedlora.config.toml_io import toml_string
    from fedlora.errors import ConfigError
    from fedlora.federation.progress import describe
    from fedlora.federation.run import run as run_entry
    from fedlora.federation.rundir import resume_given, run_dir_for

    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"data.data_dir={toml_string(args.data_dir)}")
    if args.out is not None and not args.out.strip():
        raise ConfigError(f"--out = {args.out!r} is invalid: a directory path")
    if args.resume:
        run_dir = Path(args.resume)
        if args.out and Path(args.out).resolve() != run_dir.resolve():
            raise ConfigError(
                f"--out {args.out!r} with --resume {args.resume!r}: a resumed run stays in "
                "its directory; drop --out (or copy the directory first)"
            )
        if args.overwrite:
            raise ConfigError("--overwrite with --resume: choose one (continue or replace)")
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {str(run_dir)!r}: no such directory")
        given = resume_given(run_dir, args.config, overrides)  # compared under the lock
        log = _announcing(run_dir)
        summary = run_entry(
            given, run_dir, resume=True, force=args.force, quiet=args.quiet, log=log
        )
    else:
        if args.force:
            raise ConfigError("--force goes with --resume (it accepts a changed config)")
        cfg = load_run_file(args.config, overrides)
        run_dir = run_dir_for(cfg, args.out)
        log = _announcing(run_dir)
        summary = run_entry(cfg, run_dir, overwrite=args.overwrite, quiet=args.quiet, log=log)
    print(describe(summary))
    print(f"results: {run_dir}/metrics.jsonl, summary.json, adapter/")
    if args.config is None and not args.resume:  # after the run: a refusal stays one line
        print(no_config_note(cfg.training.rounds), file=sys.stderr)
    return 0


def no_config_note(rounds: int) -> str:
    """What a run without --config is: the built-in defaults are a short smoke run, not the
    setting that learns (the demo's, research/cpu_protocol/protocol_v2.md)."""
    return (
        f"note: no --config: the built-in defaults ({rounds} rounds) are a smoke run, not a "
        "setting that learns; the demo's setting, which learns on ARC-e, is "
        "`fedlora run --config configs/demo.toml` (`make demo`)"
    )


def _announcing(run_dir: Path) -> Callable[[str], None]:
    """A stderr log that first names the run directory: the entry's first message comes
    once the inputs passed and the directory is locked, so a refusal stays one line."""
    announced = False

    def log(msg: str) -> None:
        nonlocal announced
        if not announced:
            print(f"run directory: {run_dir}", file=sys.stderr)
            announced = True
        print(msg, file=sys.stderr)

    return log


def load_run_file(path: str | None, overrides: list[str]):
    """`load_config`, except that a suite file's ``[suite]`` table (targets, seeds: what
    `fedlora compare` reads) is set aside with a note, so ``fedlora run --config
    configs/paper_table1.toml`` runs that file's experiment once (its [method], seed 0)."""
    if not path:
        return load_config(None, overrides)
    raw = read_toml(path)
    if "suite" not in raw:
        return load_config(path, overrides)
    raw.pop("suite")
    print(
        f"{path} is a suite file: running its experiment once; its [suite] table (targets, "
        f"seeds) is read by `fedlora compare --config {path}`",
        file=sys.stderr,
    )
    apply_overrides(raw, overrides, source=str(path))
    return config_from_dict(raw, source=str(path))
