"""`fedlora report`: rebuild report.md and the plots from run or suite directories."""

from __future__ import annotations

import argparse

from fedlora.commands.arguments import add_target_argument, parse_targets, shell_argv


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="rebuild report.md and plots from finished runs (metrics files only)",
        description=(
            "Read config.toml, metrics.jsonl and summary.json of each RUN_DIR (a suite "
            "directory stands for all its runs and gives its targets from suite.toml) and "
            "write report.md, report.html (self-contained) and the plots. Nothing is re-run. "
            "Without --target (and no suite targets) the report has the curves and the final "
            "accuracies; the time-to-target tables come with a target. A run's label is its "
            "directory name without -seed<N>; a directory without that suffix is labelled by "
            "its method, or by its name where two runs of one method and seed would share a "
            "label. The runs of one label must differ only in training.seed."
        ),
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    add_target_argument(p)
    p.add_argument("--out", "-o", help="output directory (default: the first RUN_DIR)")
    p.add_argument("--title", help="report title")
    p.add_argument(
        "--comm-cost",
        choices=("exact", "linear", "quadratic"),
        help="re-clock the runs under this communication cost model (with --comp-cost)",
    )
    p.add_argument("--comp-cost", choices=("affine", "linear", "quadratic"))
    p.add_argument(
        "--target-loss",
        type=float,
        metavar="LOSS",
        help="add the time to a mean eval_loss <= LOSS (and draw it in eval_loss_vs_time.png)",
    )
    p.add_argument(
        "--mcnemar",
        action="store_true",
        help="add McNemar's paired test between every two runs of the same seed "
        "(from their predictions.jsonl)",
    )
    p.add_argument(
        "--reference",
        metavar="LABEL",
        help="the method the paired-difference plots subtract, per seed (default: FSLoRA's "
        "label, else the first method not named proposed*)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fedlora.errors import ConfigError
    from fedlora.studies.suite_report import format_command, report_suite

    if (args.comm_cost is None) != (args.comp_cost is None):
        raise ConfigError("--comm-cost and --comp-cost go together (re-clocking needs both)")
    cost = (args.comm_cost, args.comp_cost) if args.comm_cost else None
    _refuse_duplicate_targets(args.target)
    argv = shell_argv()
    report = report_suite(
        args.run_dirs,
        args.out or args.run_dirs[0],
        targets=parse_targets(args.target),
        title=args.title,
        cost_model=cost,
        command=format_command(argv) if (argv and cost) else None,
        target_loss=args.target_loss,
        mcnemar=args.mcnemar,
        reference=args.reference,
    )
    print(f"report: {report}")
    return 0


def _refuse_duplicate_targets(values: list[str] | None) -> None:
    """Each task's --target once: the last of two would silently win."""
    from fedlora.errors import bad_value

    seen: dict[str, str] = {}
    for text in values or []:
        task = text.partition("=")[0].strip()
        if task in seen:
            raise bad_value(
                "--target", f"{seen[task]} and {text}", f"one --target per task ({task!r} twice)"
            )
        seen[task] = text
