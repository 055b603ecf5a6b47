"""Issue 38, item 1: a method owns its config. Its options are its own frozen dataclass
(`Method.options`), read from the table ``[method.<name>]`` and validated in that dataclass;
the config layer keeps the tables as given. The old flat keys (``method.heterolora_pruning``,
``method.fslora_k``) are still read, with a FutureWarning, and a run directory written with
them resumes. Adding a method with options, DP support and Flower support is one file: the
method below lives in this test file and runs with central differential privacy."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.config import config_from_dict, dump_toml, load_config
from fedlora.errors import ConfigError, bad_value
from fedlora.federation.methods import make_method
from fedlora.federation.methods.base import (
    Aggregation,
    ClientTask,
    Method,
    MethodContext,
    RoundPlan,
)
from fedlora.federation.methods.registry import check_method_config, resolve_method_options
from fedlora.federation.rundir import config_changes, load_run_config, load_saved_config
from fedlora.system.sketch import unbiased_aggregate
from tiny_runs import DATA, TINY_FOUR_CLIENTS

HETERO = ["method.name=heterolora", "data.n_clients=2", "method.ranks=[2, 4]"]


def _cfg(tmp_path: Path, text: str, overrides: list[str] = ()):
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(str(path), list(overrides))


def test_a_method_reads_its_options_from_its_table(tmp_path):
    text = '[method]\nname = "heterolora"\nranks = [2, 4]\n[method.heterolora]\npruning = 0.5\n'
    cfg = _cfg(tmp_path, text + "[data]\nn_clients = 2\n")
    assert cfg.method.options == {"heterolora": {"pruning": 0.5}}
    assert make_method(cfg, np.full(2, 0.5), np.random.default_rng(0)).pruning == 0.5
    assert load_config(None, [*HETERO, "method.heterolora.pruning=0.5"]) == cfg  # the CLI form
    # written and read back: the same config, the table as a TOML table
    dumped = dump_toml(cfg)
    assert "\n[method.heterolora]\npruning = 0.5\n" in dumped
    assert _cfg(tmp_path, dumped) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.heterolora.prunning=0.5", "unknown key method.heterolora.prunning (did you mean "
         "'pruning'?): the options of method 'heterolora' are pruning"),
        ("method.heterolora.pruning=1.5",
         "method.heterolora.pruning = 1.5 is invalid: 0 (off) or in (0, 1)"),
        ("method.heterolora.pruning=true", "method.heterolora.pruning = True is invalid: a number"),
        ('method.fslora.k="paper"', "method.fslora.k = 'paper' is invalid: allowed: reference, ranks"),
        ("method.heterlora.pruning=0.5", "[method.heterlora] is invalid: no method is named "
         "'heterlora' (did you mean 'heterolora'?)"),
        ("method.fedavg.pruning=0.5", "[method.fedavg] = {'pruning': 0.5} is invalid: method "
         "'fedavg' has no options of its own; remove the table"),
    ],
)  # fmt: skip
def test_a_bad_option_is_refused_naming_its_key(override, message, capsys):
    with pytest.raises(ConfigError) as info:
        check_method_config(load_config(None, [*HETERO, override]))
    assert str(info.value).startswith(message)
    assert main(["config", "show", *HETERO, override]) == 2  # the CLI: exit 2, one line
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_table_is_only_key_value_pairs_and_no_shared_key_is_a_table():
    with pytest.raises(ConfigError, match=r"method.heterolora.deep = \{'x': 1\} is invalid"):
        config_from_dict({"method": {"heterolora": {"deep": {"x": 1}}}})
    with pytest.raises(ConfigError, match=r"method.q = \{'x': 1\} is invalid"):
        config_from_dict({"method": {"q": {"x": 1}}})
    with pytest.raises(ConfigError, match=r"unknown key data.heterolora"):
        config_from_dict({"data": {"heterolora": {"pruning": 0.5}}})
    with pytest.raises(ConfigError, match=r"unknown key method.pruning .*its table: "
                       r"method.<method name>.pruning"):  # fmt: skip
        load_config(None, ["method.pruning=0.5"])


def test_another_methods_table_is_checked_then_left_out_of_the_run():
    cfg = load_config(None, ["method.name=fedavg", "method.heterolora.pruning=0.5"])
    assert check_method_config(cfg).name == "fedavg"  # a base config may carry it
    assert resolve_method_options(cfg).method.options == {}  # a run records only its own
    with pytest.raises(ConfigError, match="method.heterolora.pruning = 1.5"):
        check_method_config(
            load_config(None, ["method.name=fedavg", "method.heterolora.pruning=1.5"])
        )
    # the chosen method's table is recorded in full: its defaults written out
    fslora = resolve_method_options(load_config(None, ["method.name=fslora"]))
    assert fslora.method.options == {"fslora": {"k": "reference"}}
    assert '\n[method.fslora]\nk = "reference"\n' in dump_toml(fslora)


def test_config_show_prints_the_table_of_the_method_it_runs(capsys):
    assert main(["config", "show", *HETERO, "method.heterolora.pruning=0.9"]) == 0
    out = capsys.readouterr().out
    assert "\n[method.heterolora]\npruning = 0.9\n" in out
    assert "heterolora_pruning" not in out and "fslora_k" not in out
    assert main(["config", "show"]) == 0  # sketched has no options: no table
    assert "[method." not in capsys.readouterr().out


def test_fedlora_run_reads_a_table_override_and_refuses_a_bad_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *HETERO, "method.heterolora.pruning=1.5"]) == 2
    assert "method.heterolora.pruning = 1.5 is invalid" in capsys.readouterr().err
    assert not out.exists()  # refused before anything is written


# ----------------------------------------------------------------------------- the old keys


def test_the_old_flat_keys_are_read_with_a_deprecation_message(tmp_path):
    new = load_config(None, [*HETERO, "method.heterolora.pruning=0.5"])
    with pytest.warns(FutureWarning, match=r"method.heterolora_pruning is deprecated: write it as "
                      r"\[method.heterolora\] pruning = 0.5 \(on the command line: "
                      r"method.heterolora.pruning=0.5\)"):  # fmt: skip
        old = load_config(None, [*HETERO, "method.heterolora_pruning=0.5"])
    assert old == new
    with pytest.warns(FutureWarning, match=r"method.fslora_k is deprecated: .*k = \"ranks\""):
        fs = _cfg(tmp_path, '[method]\nname = "fslora"\nfslora_k = "ranks"\n')
    assert fs.method.options == {"fslora": {"k": "ranks"}}
    # both spellings in one file: the same value is accepted, two values are an error
    both = '[method]\nname = "fslora"\nfslora_k = "ranks"\n[method.fslora]\nk = "{}"\n'
    with pytest.warns(FutureWarning):
        assert _cfg(tmp_path, both.format("ranks")) == fs
    with pytest.raises(
        ConfigError,
        match=r"method.fslora_k = 'ranks' and method.fslora.k = "
        r"'reference' disagree: method.fslora_k is the old name of method.fslora.k",
    ):
        _cfg(tmp_path, both.format("reference"))


def test_an_override_replaces_the_files_value_in_either_spelling(tmp_path):
    table = '[method]\nname = "fslora"\n[method.fslora]\nk = "reference"\n'
    flat = '[method]\nname = "fslora"\nfslora_k = "reference"\n'
    with pytest.warns(FutureWarning):
        for text, override in [(table, "method.fslora_k=ranks"), (flat, "method.fslora.k=ranks")]:
            cfg = _cfg(tmp_path, text, [override])
            assert cfg.method.options == {"fslora": {"k": "ranks"}}, (text, override)


def test_the_studies_configs_keep_working_through_the_old_keys():
    from fedlora.studies.experiments import load_suite
    from research.study_planner.study_spec import load_spec

    root = Path(__file__).resolve().parents[1]
    # the references study now writes its option tables ([method.heterolora], [method.fslora],
    # [data.mc]): no deprecated key is read (the old keys' warnings: above and
    # tests/test_data_mc.py), and its committed runs' config.toml, written with the flat keys,
    # resolve to the same values
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        suite = load_suite("references", str(root / "research/references/references.toml"))
    fed = suite.config_for("federated", 0)  # its tables: defaults, of methods it does not run
    run = load_saved_config(root / "results/references/federated-seed0/config.toml")
    assert (run.data.mc, resolve_method_options(run).method.options) == (
        fed.data.mc,
        resolve_method_options(fed).method.options,
    )
    assert fed.method.name == "sketched" and check_method_config(fed).name == "sketched"
    assert resolve_method_options(fed) == resolve_method_options(
        fed.replace(method=dataclasses.replace(fed.method, options={}))
    )
    # the first planner study (stopped) keeps the old key; study v2 moved to the new one
    # (its operations note): both resolve to the same options, only the old one warns
    with pytest.warns(FutureWarning, match="method.fslora_k is deprecated"):
        spec = load_spec(root / "research/study_planner/study_planner.toml")
        fslora = resolve_method_options(spec.config(spec.arms["fslora"]))
    assert fslora.method.options == {"fslora": {"k": "ranks"}}
    hetero = resolve_method_options(spec.config(spec.arms["heterolora"]))
    assert hetero.method.options == {"heterolora": {"pruning": 0.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        v2 = load_spec(root / "research/study_planner/study_planner_v2.toml")
        fslora_v2 = resolve_method_options(v2.config(v2.arms["fslora"]))
    assert fslora_v2.method.options == fslora.method.options


# ----------------------------------------------------------------------------- resuming


def _tiny(*extra: str) -> list[str]:
    return [*TINY_FOUR_CLIENTS, "training.eval_every=2", "lora.layers=1", "training.lr=0.05",
            *extra]  # fmt: skip


def _old_spelling(path: Path) -> None:
    """config.toml as fedlora wrote it before the tables: every method's flat key, no table."""
    text = path.read_text(encoding="utf-8")
    table = "[method.heterolora]\npruning = 0.0\n\n"
    assert table in text
    old = text.replace(table, "").replace(
        'budget_of = "sketched"\n',
        'budget_of = "sketched"\nheterolora_pruning = 0.0\nfslora_k = "reference"\n',
    )
    path.write_text(old, encoding="utf-8")


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_a_run_dir_written_with_the_old_flat_keys_resumes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    given = _tiny("method.name=heterolora", "training.rounds=2")
    assert main(["run", "--quiet", "--out", str(run_dir), *given]) == 0
    _old_spelling(run_dir / "config.toml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a run directory's old keys: read without a warning
        saved = load_run_config(run_dir)
    assert saved.method.options == {"heterolora": {"pruning": 0.0}}
    # the same run given in either spelling, or with another method's old key: no difference
    for extra in ([], ["method.heterolora.pruning=0"], ["method.fslora.k=ranks"]):
        assert config_changes(saved, load_config(None, [*given, *extra]))[1] == [], extra
    with pytest.warns(FutureWarning):
        old = load_config(None, [*given, "method.heterolora_pruning=0.0", "method.fslora_k=ranks"])
    assert config_changes(saved, old)[1] == []
    assert config_changes(saved, load_config(None, [*given, "method.heterolora.pruning=0.5"]))[
        1
    ] == ["method.heterolora.pruning"]
    # resumed (two more rounds): it goes on from its checkpoint, its config now in the new form
    assert main(["run", "--quiet", "--resume", str(run_dir), "--force", "training.rounds=4"]) == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2, 3, 4]
    text = (run_dir / "config.toml").read_text(encoding="utf-8")
    assert "\n[method.heterolora]\npruning = 0.0\n" in text and "heterolora_pruning" not in text
    assert "FutureWarning" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- a method of one's own


@dataclass(frozen=True)
class DampedOptions:
    """The options of `DampedMean`, its table [method.damped_mean]."""

    step: float = 1.0  # the share of the participants' mean update the server applies

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not 0 < self.step <= 1:
            raise bad_value("method.damped_mean.step", self.step, "in (0, 1]")


BUILT: list[DampedOptions] = []


class DampedMean(Method):
    """A method from outside the package, one class: every client every round, the server
    applies `step` times the data-weighted mean update, X + step · Σ (a_n / Σ a) (X_n − X)
    (a weighted sum of updates with weights step · a_n / Σ a: differential privacy applies)."""

    delta_aggregate = True
    dp_sampling = "uniform"  # m = N of N: every client, every round
    options = DampedOptions

    @classmethod
    def from_config(cls, ctx: MethodContext) -> DampedMean:
        BUILT.append(ctx.options)
        return cls(ctx.a, ctx.gamma, ctx.options.step)

    def __init__(self, a: np.ndarray, gamma: int, step: float) -> None:
        self.a, self.gamma = np.asarray(a, dtype=float) / np.sum(a), gamma
        self.step = step

    def plan_round(self, round_index, rng_sampling, rng_sketch) -> RoundPlan:
        full = np.ones(self.gamma)
        tasks = (ClientTask(n, full, self.gamma, self.step * w) for n, w in enumerate(self.a))
        return RoundPlan(round_index, tuple(tasks))

    def aggregate(self, global_state, plan, client_states) -> Aggregation:
        weights = [t.weight for t in plan.tasks]
        return Aggregation(unbiased_aggregate(global_state, client_states, weights))


def test_a_method_of_ones_own_reads_its_options_in_the_registry(method_registry):
    method_registry(damped_mean=DampedMean)
    cfg = load_config(None, ["method.name=damped_mean", "data.n_clients=2", "lora.rank=2",
                             "method.damped_mean.step=1"])  # fmt: skip
    BUILT.clear()
    method = make_method(cfg, np.array([1.0, 3.0]), np.random.default_rng(0))
    assert BUILT == [DampedOptions(step=1.0)] and isinstance(BUILT[0].step, float)  # coerced
    plan = method.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    assert [t.weight for t in plan.tasks] == [0.25, 0.75]
    for bad, message in [("step=0", "method.damped_mean.step = 0.0 is invalid: in (0, 1]"),
                         ("stepp=0.5", "unknown key method.damped_mean.stepp (did you mean "
                          "'step'?): the options of method 'damped_mean' are step")]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            check_method_config(load_config(None, ["method.name=damped_mean",
                                                   f"method.damped_mean.{bad}"]))  # fmt: skip
        assert str(info.value) == message
    # the Flower runtime asks the class too: nothing refuses it there
    from fedlora.federation.flower.common import check_flower_method

    assert check_flower_method(cfg) is None


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_a_method_with_options_from_outside_the_package_runs_with_central_privacy(
    method_registry, tmp_path
):
    pytest.importorskip("dp_accounting")
    method_registry(damped_mean=DampedMean)
    path = tmp_path / "damped.toml"
    path.write_text(
        '[method]\nname = "damped_mean"\n\n[method.damped_mean]\nstep = 0.5\n\n'
        '[privacy]\nmode = "central"\nnoise_multiplier = 1.0\nclip_norm = 0.05\n',
        encoding="utf-8",
    )
    BUILT.clear()
    run_dir = tmp_path / "run"
    argv = ["run", "--quiet", "--config", str(path), "--out", str(run_dir)]
    assert main([*argv, *_tiny("training.rounds=2")]) == 0
    assert BUILT == [DampedOptions(step=0.5)]  # built once, from the table, validated
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["participants"] for m in lines[1:]] == [[0, 1, 2, 3]] * 2
    eps = [m["epsilon"] for m in lines[1:]]
    assert all(len(set(e)) == 1 and math.isfinite(e[0]) and e[0] > 0 for e in eps)
    assert eps[1][0] > eps[0][0]
    assert "\n[method.damped_mean]\nstep = 0.5\n" in (run_dir / "config.toml").read_text()
