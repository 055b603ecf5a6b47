"""`fedlora plan PROBLEM.json [--solver exact|cvxpy] [--max-weight W] [--max-epsilon E]
[--adapter-entries D] [-o PLAN.json]`: Algorithm 2 on a problem file (schema: docs/planner.md);
prints the plan as JSON, or writes it and prints a summary."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fedlora.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="choose q and k (Algorithm 2) for a PROBLEM.json",
        description=(
            "Estimate A-D from calibration runs if given, then choose each client's sampling "
            "probability q_n and sketch size k_n minimising the wall-clock bound P2. "
            "Schema of PROBLEM.json and of the output: docs/planner.md."
        ),
    )
    p.add_argument("problem", metavar="PROBLEM.json", help="the planning problem")
    p.add_argument(
        "--solver", choices=("exact", "cvxpy"), help="q-step solver (overrides options.solver)"
    )
    p.add_argument("--output", "-o", metavar="PLAN.json", help="write the plan here")
    p.add_argument(
        "--max-weight",
        type=float,
        metavar="W",
        help="bound every unbiased weight a_n/q_n by W (q_n >= a_n/W; overrides "
        "options.max_weight; 0 = no bound)",
    )
    p.add_argument(
        "--calibration-fit",
        choices=("constrained", "refuse"),
        help="when the calibration's SVD fit contradicts the model: the constrained fit with "
        "stated floors, or refuse (overrides options.calibration_fit)",
    )
    p.add_argument(
        "--max-epsilon",
        type=float,
        metavar="E",
        help="a privacy budget: every client's epsilon(delta) after the planned rounds <= E "
        "(overrides options.max_epsilon; with --noise-multiplier, --delta; docs/privacy.md)",
    )
    p.add_argument("--noise-multiplier", type=float, metavar="S", help="sigma of the budget")
    p.add_argument("--delta", type=float, metavar="D", help="delta of the budget's epsilon")
    p.add_argument(
        "--adapter-entries",
        type=int,
        metavar="D",
        help="with a privacy budget: the adapter entries central DP's noise goes to (d); the "
        "summary then prints z·sqrt(d)/m, the noise on a round's sum against the most its "
        "clipped updates can add up to (docs/privacy.md, 'Which cohort')",
    )
    p.add_argument(
        "--normalize-a",
        action="store_true",
        help="rescale the clients' a to sum to 1 instead of refusing them",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from fedlora.files import load_problem
    from fedlora.system.planner.alternation import check_plan, plan

    overrides: dict[str, object] = {}
    if args.solver:
        overrides["solver"] = args.solver
    if args.normalize_a:
        overrides["normalize_a"] = True
    if args.max_weight is not None:
        overrides["max_weight"] = args.max_weight
    if args.calibration_fit:
        overrides["calibration_fit"] = args.calibration_fit
    for key in ("max_epsilon", "noise_multiplier", "delta"):
        if getattr(args, key) is not None:
            overrides[key] = _finite_flag(key, getattr(args, key))
    problem, options = load_problem(args.problem, overrides)
    entries = args.adapter_entries
    if entries is not None and entries < 1:
        raise ConfigError(f"--adapter-entries = {entries} is invalid: must be an integer >= 1")
    if entries is not None and not options.max_epsilon:
        raise ConfigError(
            "--adapter-entries needs a privacy budget (--max-epsilon E --noise-multiplier S, or "
            "options.max_epsilon in the problem file): z·sqrt(d)/m is the budget's noise"
        )
    try:
        with np.errstate(all="ignore"):  # a degenerate result is refused below, not warned of
            result = plan(problem, options)
    except (OverflowError, ZeroDivisionError) as e:
        raise ConfigError(
            f"no usable plan: {'an overflow' if isinstance(e, OverflowError) else 'a division by zero'}"
            " in floating point (the inputs span too many orders of magnitude); check the "
            "clients' tau_full_s, t_full, a and the constants or calibration runs"
        ) from None
    check_plan(result)
    text = json.dumps(result.to_dict(), indent=2) + "\n"
    if not args.output:
        sys.stdout.write(text)  # the JSON alone on stdout; the noise line beside it on stderr
        if entries is not None and result.privacy:
            line = cohort_signal_line(result.privacy["noise_multiplier"], entries, result.q)
            print(line, file=sys.stderr)
        return 0
    out = Path(args.output)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--output = {str(out)!r}: cannot write: {e.strerror or e}") from None
    print(
        f"plan: N = {problem.n}, P2 = {result.objective:.6g} s "
        f"(E[T] = {result.expected_round_time_s:.6g} s x R = {result.expected_rounds:.6g}), "
        f"{result.iterations} iterations ({result.stop_reason}), solver {result.solver} -> {out}"
    )
    if result.floors:
        print("floored: " + "; ".join(f"{k} ({v})" for k, v in result.floors.items()))
    for line in budget_lines(result.privacy, result.q, entries):
        print(line)
    return 0


def _finite_flag(key: str, value: float) -> float:
    """A privacy flag's value, refused when not finite (argparse's float takes inf and nan,
    which JSON cannot hold)."""
    if not math.isfinite(value):
        flag = "--" + key.replace("_", "-")
        raise ConfigError(f"{flag} = {value!r} is invalid: must be a finite number")
    return value


def budget_lines(privacy: dict, q, adapter_entries: int | None = None) -> list[str]:
    """With a privacy budget: the cohort's z/m (and z·√d/m when the adapter's entries d are
    given), then one line per client, its q, bound, ε and budget."""
    if not privacy:
        return []
    lines = [
        f"privacy budget: σ = {privacy['noise_multiplier']:g}, δ = {privacy['delta']:g}, "
        f"ε after R = {privacy['rounds']} rounds (bounds set for {privacy['bound_rounds']})",
        cohort_noise_line(privacy["noise_multiplier"], q),
    ]
    if adapter_entries is not None:
        lines.append(cohort_signal_line(privacy["noise_multiplier"], adapter_entries, q))
    for n, (qn, u, e, b) in enumerate(
        zip(q, privacy["q_max"], privacy["epsilon"], privacy["max_epsilon"])
    ):
        lines.append(f"  client {n}: q = {qn:.4g} <= {u:.4g}, ε = {e:.3g} <= {b:g}")
    return lines


def _expected_participants(q) -> float:
    """m = Σ q_n: the participants a round, expected."""
    return float(sum(float(x) for x in q))


def cohort_noise_line(noise_multiplier: float, q) -> str:
    """z/m: the noise on the averaged update relative to the clip, with z the noise
    multiplier and m = Σ q_n the expected participants a round (docs/privacy.md, "Which
    cohort": the smaller z/m, the less the noise costs the model)."""
    m = _expected_participants(q)
    ratio = f"{noise_multiplier / m:.3g}" if m > 0 else "inf"
    return (
        f"cohort: m = Σ q_n = {m:.4g} expected participants a round; "
        f"z/m = {noise_multiplier:g} / {m:.4g} = {ratio} of the clip on the averaged update"
    )


def cohort_signal_line(noise_multiplier: float, adapter_entries: int, q) -> str:
    """z·√d/m (`fedlora.system.privacy.noise_over_signal`): the noise's norm on a round's sum
    against the most its m expected clipped updates can add up to, and the m that would bring
    it to 1 (m >= z·√d; docs/privacy.md, "Which cohort": necessary, not sufficient)."""
    from fedlora.system.privacy import noise_over_signal

    m = _expected_participants(q)
    ratio = noise_over_signal(noise_multiplier, adapter_entries, m)
    need = noise_multiplier * math.sqrt(adapter_entries)
    text = (
        f"noise against signal: z·√d/m = {noise_multiplier:g}·√{adapter_entries:,}/{m:.4g} = "
        f"{ratio:.3g}"
    )
    if ratio > 1:
        return text + (
            " (above 1: the noise on a round's sum outweighs the most its clipped updates can "
            f"add up to; at or below 1 needs m >= z·√d = {need:.4g} expected participants a "
            "round)"
        )
    return text + " (at or below 1: necessary for the signal to show, not sufficient)"
