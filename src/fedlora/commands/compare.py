"""`fedlora compare`: run a suite of methods on the same seeds and write report.md + plots."""

from __future__ import annotations

import argparse

from fedlora.commands.arguments import add_target_argument, parse_targets, shell_argv


def register(sub: argparse._SubParsersAction) -> None:
    from fedlora.studies.suites import SUITES

    p = sub.add_parser(
        "compare",
        help="run a suite of methods side by side (table1 | sampling | ranks | methods | "
        "references) and report",
        description=(
            "Run the methods of a suite on the same data partition, client profiles, eval "
            "subset and seeds, one run directory per (method, seed) under --out; finished runs "
            "are skipped and partial ones resumed. Writes report.md (time to target accuracy, "
            "final accuracy, speed-up over FSLoRA) and accuracy_vs_time.png."
        ),
    )
    p.add_argument("--suite", required=True, choices=tuple(SUITES))
    p.add_argument("--config", "-c", help="suite TOML: experiment sections + [suite] targets")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument("--seeds", type=int, help="number of seeds (default: suite.seeds or 1)")
    p.add_argument("--methods", nargs="+", metavar="LABEL", help="only these labels of the suite")
    p.add_argument("--tasks", nargs="+", metavar="TASK", help="eval tasks (data.eval_tasks)")
    add_target_argument(p)
    p.add_argument("--out", "-o", help="suite directory (default: runs/<suite>)")
    p.add_argument("--report-dir", help="where report.md and the plot go (default: --out)")
    p.add_argument("--data-dir", help="commonsense data directory (sets data.data_dir)")
    p.add_argument("--quiet", "-q", action="store_true", help="log lines instead of progress bars")
    p.add_argument(
        "--pilot",
        action="store_true",
        help="run the suite's pilot seed (suite.pilot_seed) in OUT/pilot and fix the targets "
        "by suite.target_rule into OUT/targets.toml; the main runs read them",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedlora.errors import bad_value
    from fedlora.federation.methods.registry import method_class
    from fedlora.studies.experiments import load_suite, pilot_targets, run_suite
    from fedlora.studies.suite_report import format_command

    if args.methods and len(set(args.methods)) != len(args.methods):
        twice = sorted({m for m in args.methods if args.methods.count(m) > 1})
        raise bad_value("--methods", args.methods, f"each label once ({', '.join(twice)} twice)")
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f'data.data_dir="{args.data_dir}"')
    spec = load_suite(
        args.suite,
        args.config,
        overrides,
        seeds=args.seeds,
        tasks=args.tasks,
        targets=parse_targets(args.target),
        methods=args.methods,
    )
    for label in spec.labels:  # every run's own method rule, before any run starts
        cfg = spec.config_for(label, spec.seeds[0])
        method_class(cfg.method.name).check_run(cfg)
    out = args.out or f"runs/{args.suite}"
    if args.pilot:
        print(f"targets: {pilot_targets(spec, Path(out), quiet=args.quiet)}")
        return 0
    argv = shell_argv()
    report = run_suite(
        spec,
        out,
        report_dir=args.report_dir,
        command=format_command(argv) if argv else "",
        quiet=args.quiet,
    )
    print(f"report: {report}")
    return 0
