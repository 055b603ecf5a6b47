"""Algorithm 2 of the paper (§V): estimate A–D from calibration runs, then choose each
client's sampling probability q_n and sketch size k_n to minimise the wall-clock bound P2.

Pure numpy/scipy (cvxpy only for the reference q-step solver); no torch, no I/O (a
PROBLEM.json file is read by `fedlora.files.load_problem`). The modules, in the order the
algorithm uses them:

- `problem`: the data — `Constants`, `Observation`, `PlanProblem`, `PlanOptions` — checked
  when built;
- `objective`: P2 = R(q, k) · Σ q_n w_n(k) and its pieces (sketched round weights, the
  penalty c_n, the bounds lo_n), and `plan_degeneracy`;
- `estimate`: A–D from calibration runs (Eq. 21) and `calibration_fit`;
- `fit`: the constrained fit (A, C, D >= 0, floors where not identified) and the per-round
  progress rates of one run's own rounds (in-run calibration, re-planning);
- `qcurve`, `qstep`: the q-step for fixed k (P3 along its exact KKT curve; cvxpy reference);
- `kstep`: the greedy k-step for fixed q;
- `alternation`: q-step → k-step to a fixed point or cycle, from several starts; `plan`;
- `budget`: a privacy budget (planner.max_epsilon) as upper bounds on q at the planned rounds,
  iterated to a fixed point with the round estimate (`plan_within_budget`);
- `schema`: the PROBLEM.json structure → (PlanProblem, PlanOptions).

Every public name is importable from `fedlora.system.planner` itself.
"""

from fedlora.system.planner.alternation import (
    PlanResult,
    alternate,
    capability_start,
    check_plan,
    grid_path_start,
    multi_start,
    plan,
    uniform_start,
)
from fedlora.system.planner.budget import plan_within_budget, rate_bounds
from fedlora.system.planner.estimate import calibration_fit, estimate_constants
from fedlora.system.planner.fit import (
    FLOOR_SHARE,
    FitResult,
    constrained_fit,
    progress_rates,
    progress_rates_by_client,
)
from fedlora.system.planner.kstep import greedy_k
from fedlora.system.planner.objective import (
    expected_rounds,
    p2_objective,
    plan_degeneracy,
    q_lower_bounds,
    sketch_penalty,
    sketched_round_weights,
)
from fedlora.system.planner.problem import (
    A_SUM_TOLERANCE,
    CALIBRATION_FITS,
    COMM_COSTS,
    COMP_COSTS,
    ESTIMATION_MATRICES,
    GAMMA_MAX,
    M_RANGES,
    M_SEARCHES,
    Q_LOWER_BOUNDS,
    SOLVERS,
    Constants,
    Observation,
    PlanOptions,
    PlanProblem,
    positive_number,
)
from fedlora.system.planner.qcurve import STRICT_MARGIN, QCurve, q_curve
from fedlora.system.planner.qstep import QStepResult, p2_q_step, q_step
from fedlora.system.planner.schema import problem_from_dict

__all__ = [
    "plan_within_budget",
    "rate_bounds",
    "CALIBRATION_FITS",
    "FLOOR_SHARE",
    "FitResult",
    "constrained_fit",
    "progress_rates",
    "progress_rates_by_client",
    "A_SUM_TOLERANCE",
    "COMM_COSTS",
    "COMP_COSTS",
    "ESTIMATION_MATRICES",
    "GAMMA_MAX",
    "M_RANGES",
    "M_SEARCHES",
    "Q_LOWER_BOUNDS",
    "SOLVERS",
    "STRICT_MARGIN",
    "Constants",
    "Observation",
    "PlanOptions",
    "PlanProblem",
    "PlanResult",
    "QCurve",
    "QStepResult",
    "alternate",
    "calibration_fit",
    "capability_start",
    "check_plan",
    "estimate_constants",
    "expected_rounds",
    "greedy_k",
    "multi_start",
    "p2_q_step",
    "uniform_start",
    "grid_path_start",
    "p2_objective",
    "plan",
    "plan_degeneracy",
    "positive_number",
    "problem_from_dict",
    "q_curve",
    "q_lower_bounds",
    "q_step",
    "sketch_penalty",
    "sketched_round_weights",
]
