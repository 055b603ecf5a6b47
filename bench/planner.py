"""Time the full Algorithm 2 alternation (q-step + greedy k until a fixed point or cycle),
and compare the exact planner (`multi_start`, what `fedlora plan` and `proposed` use) with the
paper's own path (k⁰ = γ, grid of step range/200 over M) on P2.

    .venv/bin/python bench/planner.py            # exact N = 50..50,000, cvxpy N = 50, 500
    .venv/bin/python bench/planner.py --quick    # exact N = 50, 500; cvxpy N = 50

Instances: a ~ Dirichlet(1), τ_full ~ U[0.5, 3] s, t_full ~ U[10, 100] (f_tot = 100),
γ = 16, A = B = 1, C = 0.01, D = 0.001 scaled by 50/N (so that the per-client bounds stay
feasible as N grows), paper cost models (quadratic). Prints the best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from fedlora.system.planner import Constants, PlanOptions, PlanProblem, alternate, multi_start


def instance(n: int, seed: int = 0) -> PlanProblem:
    rng = np.random.default_rng(seed)
    scale = 50.0 / n
    return PlanProblem(
        gamma=16,
        f_tot=100.0,
        a=rng.dirichlet(np.ones(n)),
        tau_full_s=rng.uniform(0.5, 3.0, n),
        t_full=rng.uniform(10.0, 100.0, n),
        constants=Constants(1.0, 1.0, 0.01 * scale, 0.001 * scale),
    )


def timed(problem: PlanProblem, options: PlanOptions, repeat: int, run=alternate):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = run(problem, problem.constants, options)
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    exact = PlanOptions(comm_cost="quadratic", comp_cost="quadratic")
    cvx = dataclasses.replace(exact, solver="cvxpy")
    cvx_grid = dataclasses.replace(cvx, m_search="grid")
    sizes = [50, 500] if args.quick else [50, 500, 5_000, 50_000]
    rows = [("exact", n, exact, args.repeat) for n in sizes]
    rows += [("cvxpy (Brent on M)", n, cvx, 1) for n in ([50] if args.quick else [50, 500])]
    rows += [("cvxpy (paper grid, ε = range/200)", 50, cvx_grid, 1)]
    grid_path = dataclasses.replace(exact, m_search="grid", polish=False)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'solver':<36}{'N':>8}{'time':>12}{'P2':>16}{'iterations':>12}  stop")
    reference: dict[int, float] = {}
    for name, n, options, repeat in rows:
        seconds, res = timed(instance(n), options, repeat)
        if name == "exact":
            reference[n] = (seconds, res.objective)
        rel = ""
        if name != "exact" and n in reference:
            t_ex, p_ex = reference[n]
            rel = f"  {seconds / t_ex:,.0f}x exact's time, P2 rel. diff {res.objective / p_ex - 1:+.1e}"
        print(
            f"{name:<36}{n:>8}{seconds * 1e3:>10.1f}ms{res.objective:>16.8g}{res.iterations:>12}"
            f"  {res.stop_reason}{rel}"
        )
    print("\nexact planner (multi_start) vs the paper's grid path (k0 = γ, grid over M):")
    print(f"{'N':>8}{'grid path P2':>16}{'k0 = γ P2':>16}{'multi_start P2':>16}{'vs grid':>9}"
          f"{'time':>10}  start")  # fmt: skip
    for n in sizes[:3]:
        problem = instance(n)
        ref = alternate(problem, problem.constants, grid_path).objective
        one = alternate(problem, problem.constants, exact).objective
        seconds, res = timed(problem, exact, 1, run=multi_start)
        print(f"{n:>8}{ref:>16.8g}{one:>16.8g}{res.objective:>16.8g}{res.objective / ref - 1:>+9.1%}"
              f"{seconds * 1e3:>8.0f}ms  {res.start}")  # fmt: skip


if __name__ == "__main__":
    main()
