"""A privacy run never misreports its budget (issue 39, items 1-5): ε composes the rounds as
they ran across `--resume --force` with another σ, rounds released without noise make ε
infinite and say so, planner.max_epsilon stops any central run before a round would spend
past it (also when the planner's fit fails), and the settings that made the accountant or the
noise meaningless are refused at the config, naming the field. Every ε is checked against the
RDP computed from the paper (tests/rdp_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rdp_reference as ref
from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.federation.progress import Progress
from fedlora.system.privacy_ledger import PrivacyLedger, RoundSetting
from tiny_runs import DATA, TINY_FOUR_CLIENTS

pytest.importorskip("dp_accounting")
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

Q = [0.5, 0.5, 0.3, 0.9]
TINY = [
    *TINY_FOUR_CLIENTS,
    "training.eval_every=100",
    "training.lr=0.05",
    f"method.q={Q}",
    "method.k=[2, 4, 1, 3]",
    "privacy.clip_norm=0.01",
]
CENTRAL = ['privacy.mode="central"']


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _composed(q: float, parts: list[tuple[float, int]]) -> tuple[float, float]:
    """The reference ε(δ = 1e-5) of rounds at rate q, `parts` (σ, rounds) composed in RDP."""
    rdp = {
        a: sum(n * ref.poisson_rdp_orders(q, s)[i] for s, n in parts)
        for i, a in enumerate(ref.ORDERS)
    }
    integer = {a: r for a, r in rdp.items() if float(a).is_integer()}
    return ref.epsilon_from_rdp(rdp, 1e-5), ref.epsilon_from_rdp(integer, 1e-5)


def _run(*args: str) -> None:
    assert main(["run", "-q", *args]) == 0


@needs_data
@pytest.mark.parametrize(("first", "then"), [(0.3, 3.0), (1.0, 0.3)])
def test_a_resume_with_another_sigma_composes_each_round_at_its_own(tmp_path, first, then):
    out = tmp_path / "run"
    sigma = f"privacy.noise_multiplier={first}"
    _run("--out", str(out), *TINY, *CENTRAL, sigma, "training.rounds=2")
    _run("--resume", str(out), "--force", f"privacy.noise_multiplier={then}", "training.rounds=3")
    final = _lines(out)[-1]["epsilon"]
    for eps, q in zip(final, Q):  # 2 rounds at the first σ, 1 at the second
        lo, hi = _composed(q, [(first, 2), (then, 1)])
        assert lo * (1 - 1e-9) <= eps <= hi * (1 + 1e-9)
        assert eps == pytest.approx(lo, rel=3e-3)
    privacy = _summary(out)["privacy"]
    assert privacy["epsilon"] == final and privacy["largest_epsilon"] == max(final)
    assert [(s["rounds"], s["noise_multiplier"]) for s in privacy["history"]] == [
        ([1, 2], first),
        ([3, 3], then),
    ]


@needs_data
def test_rounds_released_without_noise_make_epsilon_infinite_and_say_so(tmp_path, capsys):
    out = tmp_path / "run"
    _run("--out", str(out), *TINY, "training.rounds=2")  # privacy.mode = "none"
    capsys.readouterr()
    _run("--resume", str(out), "--force", *CENTRAL, "training.rounds=3")
    terminal = capsys.readouterr().out
    assert _lines(out)[-1]["epsilon"] == [None] * 4
    privacy = _summary(out)["privacy"]
    assert privacy["largest_epsilon"] is None and privacy["unprotected_rounds"] == 2
    assert privacy["history"][0]["rounds"] == [1, 2] and privacy["history"][0]["mode"] == "none"
    assert "ε = inf (rounds 1-2 released the adapter without noise" in terminal


def test_an_older_ledger_without_sigma_reads_back_and_gaps_are_unprotected():
    from fedlora.federation.privacy import restore_ledger

    old = [[["poisson", 0.5, 3]], [["poisson", 0.3, 3]]]  # the list fedlora wrote before
    progress = Progress(round=3, privacy_ledger=old)
    ledger = restore_ledger(2, 1.0, progress)
    assert ledger.rounds == 3 and ledger.unprotected_rounds == 0
    lo, hi = ref.poisson_bounds(0.5, 1.0, 3, 1e-5)
    assert lo * (1 - 1e-9) <= ledger.epsilons(1e-5)[0] <= hi * (1 + 1e-9)
    # a ledger that saw rounds 1-2 of 4: rounds 3-4 ran without privacy
    two = PrivacyLedger(2)
    for _ in range(2):
        two.record(RoundSetting("central", 1.0, 0.1, "poisson"), "poisson", [0.5, 0.3])
    gap = restore_ledger(2, 1.0, Progress(round=4, privacy_ledger=two.to_dict()))
    assert gap.unprotected_rounds == 2 and gap.epsilons(1e-5) == [float("inf")] * 2
    assert [s["mode"] for s in gap.segments] == ["central", "none"]


@needs_data
@pytest.mark.parametrize(
    ("method", "budget"), [("sketched", 7.0), ("fedavg", 12.0)], ids=["independent", "m-of-n"]
)
def test_a_budget_stops_any_central_run_before_a_round_would_spend_past_it(
    tmp_path, capsys, method, budget
):
    out = tmp_path / method
    extra = [f'method.name="{method}"', "method.clients_per_round=2"] if method == "fedavg" else []
    extra += ["training.rounds=6", f"planner.max_epsilon={budget}"]
    _run("--out", str(out), *TINY, *CENTRAL, *extra)
    summary = _summary(out)
    privacy = summary["privacy"]
    rounds = summary["rounds"]
    assert summary["stop_reason"] == "privacy_budget" and 1 <= rounds < 6
    assert privacy["epsilon_budget"] == budget and privacy["largest_epsilon"] <= budget
    if method == "sketched":  # client 3 (q = 0.9) reaches the budget first
        assert ref.poisson_bounds(0.9, 1.0, rounds, 1e-5)[0] <= budget
        assert ref.poisson_bounds(0.9, 1.0, rounds + 1, 1e-5)[0] > budget
    else:  # 2 of 4 without replacement at σ/2
        assert ref.wor_upper_epsilon(0.5, 0.5, rounds, 1e-5) <= budget
        assert ref.wor_upper_epsilon(0.5, 0.5, rounds + 1, 1e-5) > budget
    assert "planner.max_epsilon" in capsys.readouterr().err


@needs_data
def test_the_planners_fallback_after_a_failed_fit_keeps_the_budget(tmp_path, monkeypatch):
    import fedlora.system.planner.fit as fit

    def fails(*args, **kwargs):
        raise ConfigError("no fit (forced by the test)")

    monkeypatch.setattr(fit, "constrained_fit", fails)
    out = tmp_path / "proposed"
    proposed = ['method.name="proposed"', 'method.q="fixed"', 'method.k="uniform"']
    budget = ["privacy.noise_multiplier=2.0", "planner.max_epsilon=2.5"]
    _run(
        "--out",
        str(out),
        *TINY,
        *CENTRAL,
        *proposed,
        "planner.probe_rounds=1",
        "training.rounds=12",
        *budget,
    )
    summary = _summary(out)
    lines = _lines(out)
    assert any("fallback" in x.get("planner", {}) for x in lines)  # the fit failed after round 4
    assert summary["stop_reason"] == "privacy_budget" and 4 < summary["rounds"] < 12
    assert summary["privacy"]["largest_epsilon"] <= 2.5


def _config_error(capsys, *overrides: str) -> str:
    assert main(["config", "show", *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (["privacy.delta=0.999"], ["privacy.delta", "data.n_clients"]),
        (["privacy.delta=0.2", "data.n_clients=10"], ["privacy.delta", "1/data.n_clients"]),
        (["privacy.noise_multiplier=1e-200"], ["privacy.noise_multiplier"]),
        (["privacy.noise_multiplier=1e308"], ["privacy.noise_multiplier"]),
        (["privacy.clip_norm=1e308"], ["privacy.clip_norm"]),
        (["privacy.clip_norm=5000"], ["privacy.clip_norm", "privacy.noise_multiplier"]),
        (["privacy.secagg_clipping_range=1e30"], ["privacy.secagg_clipping_range"]),
        (["privacy.noise_multiplier=0", "planner.max_epsilon=5"], ["planner.max_epsilon"]),
    ],
)
def test_meaningless_privacy_bounds_exit_2_naming_the_field(capsys, overrides, fields):
    mode = [] if any("secagg" in o for o in overrides) else CENTRAL
    err = _config_error(capsys, *mode, *overrides)
    assert all(f in err for f in fields), err


# a two-client planning problem for `fedlora plan`'s privacy flags (tests/test_privacy_trace.py)
TWO_CLIENT_PROBLEM = {
    "gamma": 4,
    "f_tot": 100.0,
    "clients": [
        {"a": 0.5, "tau_full_s": 1.0, "t_full": 4.0},
        {"a": 0.5, "tau_full_s": 2.0, "t_full": 4.0},
    ],
    "constants": {"A": 1.0, "B": 1.0, "C": 0.01, "D": 0.001},
    "options": {"q_lower_bound": "none"},
}


def test_plan_refuses_a_non_finite_noise_multiplier_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(TWO_CLIENT_PROBLEM))
    out = tmp_path / "plan.json"
    for flag, value in (("--noise-multiplier", "inf"), ("--max-epsilon", "nan")):
        args = ["plan", str(path), "--max-epsilon", "8", flag, value, "-o", str(out)]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err
    assert main(["plan", str(path), "--max-epsilon", "8", "--noise-multiplier", "1e-9"]) == 2
    assert "options.noise_multiplier" in capsys.readouterr().err
    assert main(["plan", str(path), "--max-epsilon", "8", "--delta", "0.6"]) == 2
    assert "options.delta" in capsys.readouterr().err
    assert not out.exists()


def test_the_config_and_the_accountant_share_the_range_of_sigma():
    from fedlora.config.privacy_section import SIGMA_RANGE as CONFIG_RANGE
    from fedlora.system.privacy import SIGMA_RANGE

    assert CONFIG_RANGE == SIGMA_RANGE


def test_a_divergence_under_privacy_names_the_noises_fields():
    from types import SimpleNamespace

    from fedlora.config import load_config
    from fedlora.federation.engine import _noise_hint
    from fedlora.federation.methods.registry import method_class
    from fedlora.federation.privacy import make_privacy

    cfg = load_config(None, [*CENTRAL, "privacy.noise_multiplier=2", "privacy.clip_norm=300"])
    run = SimpleNamespace(
        method=SimpleNamespace(privacy=make_privacy(cfg, method_class(cfg.method.name)))
    )
    hint = _noise_hint(run)
    assert "600" in hint and "privacy.noise_multiplier" in hint and "privacy.clip_norm" in hint
    assert _noise_hint(SimpleNamespace(method=SimpleNamespace(privacy=None))) == ""
