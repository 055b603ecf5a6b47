"""The suites of `fedlora compare` as data files (issue 38): every shipped file parses into
the labels and overrides the former Python dicts held (copied below from
fedlora/studies/suites.py before the change), in the same order; the wheel ships them; a
malformed suite file is refused with its path."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedlora.config.toml_io import parse_override, read_toml
from fedlora.errors import ConfigError
from fedlora.studies.suites import METHOD_SUITE, SUITE_FOLDER, SUITES, TITLES, read_suite

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "src" / "fedlora" / "studies" / SUITE_FOLDER
Q = ("method.q=fixed", "method.q_fixed=0.2")
X = "network.comm_cost=exact"
AFTER = "fedavg fslora heterolora flexlora fedstacklora ffalora fedsalora fedexlora rolora fedsb"
# the dicts of fedlora/studies/suites.py before issue 38 (labels in run order)
OLD_SUITES = {
    "table1": {
        "proposed": ("method.name=proposed", "planner.optimize=qk", "planner.calibration=separate"),
        "fslora": ("method.name=fslora",),
        "heterolora": ("method.name=heterolora",),
        "fedstacklora": ("method.name=fedstacklora",),
        "fedstacklora-free-downlink": ("method.name=fedstacklora", "network.downlink_rate_bps=0"),
        "flexlora": ("method.name=flexlora",),
    },
    "sampling": {
        "proposed-q": (
            "method.name=proposed",
            "planner.optimize=q",
            "method.k=full",
            "planner.calibration=separate",
        ),
        "full": ("method.name=sketched", "method.q=full", "method.k=full"),
        "fixed-0.2": ("method.name=sketched", *Q, "method.k=full"),
        "uniform": ("method.name=sketched", "method.q=uniform", "method.k=full"),
        "weighted": ("method.name=sketched", "method.q=weighted", "method.k=full"),
    },
    "ranks": {
        "proposed-k": (
            "method.name=proposed",
            "planner.optimize=k",
            *Q,
            "planner.calibration=separate",
        ),
        "full": ("method.name=sketched", "method.k=full", *Q),
        "normal": ("method.name=sketched", "method.k=normal", *Q),
        "uniform": ("method.name=sketched", "method.k=uniform", *Q),
    },
    "methods": {
        "proposed": ("method.name=proposed", "planner.optimize=qk", X),
        **{name: (f"method.name={name}", X) for name in AFTER.split()},
    },
    "references": {
        "federated": (),
        "centralized": ("method.name=centralized", "method.budget_of=$method.name"),
        "local": ("method.name=local", "method.budget_of=$method.name"),
    },
}
OLD_TITLES = {
    "table1": "Table I: time to target accuracy",
    "sampling": "Figure 2: sampling probabilities q (k = γ)",
    "ranks": "Figure 3: sketch sizes k (q = 0.2)",
    "methods": "Every method: time to target accuracy",
    "references": "The federated method beside centralized and local training at its budget",
}


def test_the_suite_files_hold_what_the_dicts_held_in_their_order() -> None:
    assert SUITES == OLD_SUITES and TITLES == OLD_TITLES
    assert list(SUITES) == list(OLD_SUITES)  # `--suite`'s choices, in order
    assert all(list(SUITES[s]) == list(OLD_SUITES[s]) for s in SUITES)  # each suite's run order
    assert METHOD_SUITE == tuple(AFTER.split())


def test_every_suite_file_is_shipped_and_every_override_parses() -> None:
    assert sorted(p.stem for p in FOLDER.glob("*.toml")) == sorted(SUITES)
    package_data = read_toml(ROOT / "pyproject.toml")["tool"]["setuptools"]
    assert f"{SUITE_FOLDER}/*.toml" in package_data["package-data"]["fedlora.studies"]
    for labels in SUITES.values():
        for overrides in labels.values():
            assert all(parse_override(o)[0] in {"method", "planner", "network"} for o in overrides)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('title = "t"\n[labels]\na = "method.name=fedavg"\n', "labels.a = 'method.name=fedavg'"),
        ("[labels]\na = []\n", "needs exactly a non-empty `title`"),
        ('title = "t"\nextra = 1\n[labels]\na = []\n', "needs exactly a non-empty `title`"),
        ('title = "t"\n[labels]\n', "[labels] must map each label"),
        ('title = "t"\n[labels\n', "not valid TOML"),
    ],
)
def test_a_malformed_suite_file_is_refused_naming_it(tmp_path, text, complaint) -> None:
    (tmp_path / "mine.toml").write_text(text)
    with pytest.raises(ConfigError) as e:
        read_suite("mine", tmp_path)
    assert f"{tmp_path}/mine.toml" in str(e.value) and complaint in str(e.value)


def test_a_suite_file_from_a_folder_reads_in_its_order(tmp_path) -> None:
    (tmp_path / "two.toml").write_text('title = "Two"\n[labels]\nb = ["x.y=1"]\na = []\n')
    assert read_suite("two", tmp_path) == ("Two", {"b": ("x.y=1",), "a": ()})
    assert list(read_suite("two", tmp_path)[1]) == ["b", "a"]
