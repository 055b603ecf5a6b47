"""Experiment configuration: defaults, TOML round trip, overrides, and every bad value."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from fedlora.config import (
    SECTIONS,
    DataConfig,
    ExperimentConfig,
    LoraConfig,
    MethodConfig,
    ModelConfig,
    NetworkConfig,
    TrainingConfig,
    config_from_dict,
    diff_configs,
    dump_toml,
    load_config,
    parse_override,
    toml_value,
)
from fedlora.errors import ConfigError


def write(tmp_path, text: str, name: str = "c.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- defaults


def test_defaults_are_valid_and_loading_nothing_gives_them():
    cfg = load_config()
    assert cfg == ExperimentConfig()
    assert list(SECTIONS) == [
        "model",
        "lora",
        "data",
        "network",
        "training",
        "method",
        "planner",
        "output",
        "evaluation",
        "privacy",
    ]
    # a few defaults the rest of fedlora relies on
    assert cfg.lora.rank == 16
    assert cfg.network.f_tot_hz == 20e6
    # the demo: 20 clients, rank 16, H = 5 (the paper uses 10; halved for a 2-core CPU), b = 4
    assert cfg.data.n_clients == 20 and cfg.data.dirichlet_alpha == 0.1
    assert cfg.training.local_steps == 5 and cfg.training.batch_size == 4


def test_config_is_frozen():
    cfg = ExperimentConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.rounds = 3  # type: ignore[misc]


# ----------------------------------------------------------------------------- round trip


def test_toml_round_trip_of_the_defaults(tmp_path):
    cfg = ExperimentConfig()
    assert load_config(write(tmp_path, dump_toml(cfg))) == cfg


def test_toml_round_trip_with_lists_union_fields_and_awkward_values(tmp_path):
    # Prepare: every kind of field away from its default.
    cfg = ExperimentConfig(
        model=ModelConfig(name='C:\\models\\"tiny"\nllama ü', dtype="fp32", threads=2),
        lora=LoraConfig(rank=8, alpha=1e-3, target_modules=("q_proj", "k_proj"), layers=4),
        data=DataConfig(n_clients=3, tasks=("boolq",), task_files=("/x/a.json",), eval_tasks=()),
        network=NetworkConfig(f_tot_hz=1e20, noise_psd_dbm_hz=-174.5, fading="rayleigh"),
        training=TrainingConfig(lr=1e-05, seed=7, target_accuracy=0.55),
        method=MethodConfig(name="proposed", q=(1.0, 0.25, 1e-05), k=(1, 8, 3), ranks=(8, 2, 1)),
    )
    # Execute
    text = dump_toml(cfg)
    back = load_config(write(tmp_path, text))
    # Assert: equal, the same types (tuples stay tuples, ints stay ints), and stable text
    assert back == cfg
    assert diff_configs(cfg, back) == []
    assert isinstance(back.method.q, tuple) and isinstance(back.lora.layers, int)
    assert dump_toml(back) == text


def test_round_trip_keeps_string_forms_of_union_fields(tmp_path):
    cfg = load_config(None, ["method.q=weighted", "method.k=clients_k.csv", 'lora.layers="all"'])
    assert (cfg.method.q, cfg.method.k, cfg.lora.layers) == ("weighted", "clients_k.csv", "all")
    assert load_config(write(tmp_path, dump_toml(cfg))) == cfg


def test_dump_toml_lists_every_field_of_every_section():
    text = dump_toml(ExperimentConfig())
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text
        for f in dataclasses.fields(cls):
            table = getattr(getattr(ExperimentConfig(), section), f.name)
            if dataclasses.is_dataclass(table):  # a table of the section: [data.mc], its keys
                _, _, body = text.partition(f"\n[{section}.{f.name}]\n")
                keys = [line.split(" = ")[0] for line in body.split("\n\n")[0].splitlines()]
                assert keys == [g.name for g in dataclasses.fields(table)], (section, f.name)
            elif f.name != "options":  # method.options: the [method.<name>] tables (none here)
                assert f"\n{f.name} = " in text


# ----------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("training.rounds=5", ("training", "rounds", 5)),
        (" training.lr = 1e-3 ", ("training", "lr", 0.001)),
        ("method.q=[0.5, 1]", ("method", "q", [0.5, 1])),
        ("output.progress=false", ("output", "progress", False)),
        ("model.name=HuggingFaceTB/SmolLM2-135M", ("model", "name", "HuggingFaceTB/SmolLM2-135M")),
        ('model.name="a=b"', ("model", "name", "a=b")),
        ("data.tasks=arc-e,boolq", ("data", "tasks", "arc-e,boolq")),
        ("network.f_tot_hz=nan", ("network", "f_tot_hz", math.nan)),
        ("method.heterolora.pruning=0.9", ("method", "heterolora.pruning", 0.9)),
    ],
)
def test_parse_override(text, expected):
    section, key, value = parse_override(text)
    assert (section, key) == expected[:2]
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(expected[2])
    else:
        assert value == expected[2] and type(value) is type(expected[2])


@pytest.mark.parametrize(
    "text", ["training.rounds", "rounds=5", "a.b.c.d=1", ".rounds=5", "x.=1", "a..b=1"]
)
def test_parse_override_rejects_malformed(text):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override(text)


def test_overrides_apply_on_top_of_the_file(tmp_path):
    path = write(tmp_path, "[training]\nrounds = 7\nlr = 0.1\n[data]\nn_clients = 2\n")
    cfg = load_config(
        path, ["training.rounds=9", "data.tasks=arc-e, boolq", "method.k=[2, 16]", "training.lr=1"]
    )
    assert cfg.training.rounds == 9  # override wins
    assert cfg.data.n_clients == 2  # file kept
    assert cfg.data.tasks == ("arc-e", "boolq")  # comma list for a list of strings
    assert cfg.method.k == (2, 16)
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)  # int widened to float
    assert diff_configs(ExperimentConfig(), cfg) == [
        "data.tasks",
        "data.n_clients",
        "training.rounds",
        "training.lr",
        "method.k",
    ]


def test_config_from_dict_needs_tables():
    with pytest.raises(ConfigError, match="expected a table of sections"):
        config_from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"\[training\] must be a table, got 5"):
        config_from_dict({"training": 5})


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("trainng.rounds=3", r"unknown section \[trainng\] \(did you mean 'training'\?\)"),
        ("training.round=3", r"unknown key training\.round \(did you mean 'rounds'\?\)"),
        ("network.ftot_hz=1", r"unknown key network\.ftot_hz \(did you mean 'f_tot_hz'\?\)"),
        (
            "lora.r=8",
            r"unknown key lora\.r \(valid: rank, alpha, dropout, target_modules, layers, rslora\)",
        ),
        ("zzz.q=1", r"unknown section \[zzz\] \(valid: model, lora, data, network"),
    ],
)
def test_unknown_section_or_key_suggests_the_closest(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path, "[method]\nname = 'fslora'\nqq = [0.5]\n")
    with pytest.raises(
        ConfigError, match=r"c\.toml: unknown key method\.qq \(did you mean 'q'\?\)"
    ):
        load_config(path)


# ----------------------------------------------------------------------------- bad values

# (overrides, the message must contain this: the field, then the value)
BAD_VALUES = [
    # q outside (0, 1]
    (["data.n_clients=2", "method.q=[0, 0.5]"], "method.q[0] = 0.0 is invalid"),
    (["data.n_clients=2", "method.q=[0.5, 1.2]"], "method.q[1] = 1.2 is invalid"),
    (["data.n_clients=2", "method.q=[-0.1, 0.5]"], "method.q[0] = -0.1 is invalid"),
    (["data.n_clients=1", "method.q=[nan]"], "method.q[0] = nan is invalid"),
    (["method.q_fixed=0"], "method.q_fixed = 0.0 is invalid"),
    (["method.q_fixed=1.01"], "method.q_fixed = 1.01 is invalid"),
    (["method.q=0.5"], "method.q = 0.5 is invalid"),
    (["method.q=sometimes"], "method.q = 'sometimes' is invalid"),
    (["method.q=[]"], "method.q = () is invalid"),
    # k outside 1..γ
    (["data.n_clients=2", "method.k=[0, 4]"], "method.k[0] = 0 is invalid"),
    (["data.n_clients=2", "method.k=[4, 17]"], "method.k = (4, 17) is invalid"),
    (["data.n_clients=2", "lora.rank=4", "method.k=[4, 5]"], "1..lora.rank = 4"),
    (["data.n_clients=2", "method.k=[1, 2.5]"], "method.k[1] = 2.5 is invalid"),
    # γ < 1
    (["lora.rank=0"], "lora.rank = 0 is invalid"),
    (["lora.rank=-4"], "lora.rank = -4 is invalid"),
    (["lora.rank=8.0"], "lora.rank = 8.0 is invalid"),
    # f_tot <= 0
    (["network.f_tot_hz=0"], "network.f_tot_hz = 0.0 is invalid"),
    (["network.f_tot_hz=-20e6"], "network.f_tot_hz = -20000000.0 is invalid"),
    (["network.f_tot_hz=inf"], "network.f_tot_hz = inf is invalid"),
    # negative or NaN times
    (["network.step_time_median_s=-0.2"], "network.step_time_median_s = -0.2 is invalid"),
    (["network.step_time_median_s=nan"], "network.step_time_median_s = nan is invalid"),
    (["network.step_time_median_s=0"], "network.step_time_median_s = 0.0 is invalid"),
    (["training.time_budget_s=-1"], "training.time_budget_s = -1.0 is invalid"),
    (["training.time_budget_s=nan"], "training.time_budget_s = nan is invalid"),
    (["network.downlink_rate_bps=-1"], "network.downlink_rate_bps = -1.0 is invalid"),
    # length mismatches between per-client vectors and n_clients
    (["data.n_clients=3", "method.q=[0.5, 0.5]"], "data.n_clients = 3, got 2"),
    (["method.q=[0.5, 0.5]"], "method.q = (0.5, 0.5) is invalid: one entry per client"),
    (["data.n_clients=3", "method.k=[1, 2, 3, 4]"], "method.k = (1, 2, 3, 4) is invalid"),
    (["data.n_clients=4", "method.clients_per_round=5"], "method.clients_per_round = 5"),
    (["data.n_clients=2", "method.ranks=[4, 4, 4]"], "method.ranks = (4, 4, 4) is invalid"),
    (["data.n_clients=2", "method.ranks=[4, 17]"], "method.ranks = (4, 17) is invalid"),
    (["method.ranks=biggest"], "method.ranks = 'biggest' is invalid"),
    # other ranges and choices
    (["model.dtype=fp16"], "model.dtype = 'fp16' is invalid: allowed: auto, fp32, bf16"),
    (
        ["model.device=gpu"],
        "model.device = 'gpu' is invalid: allowed: auto, cpu, cuda, cuda:N, mps",
    ),
    (['model.device="cuda:x"'], "model.device = 'cuda:x' is invalid: allowed: auto, cpu, cuda"),
    (["model.device=3"], "model.device = 3 is invalid: a string"),
    (["model.name=''"], "model.name = '' is invalid"),
    (["model.threads=-1"], "model.threads = -1 is invalid"),
    (["lora.alpha=0"], "lora.alpha = 0.0 is invalid"),
    (["lora.dropout=1"], "lora.dropout = 1.0 is invalid"),
    (["lora.layers=0"], "lora.layers = 0 is invalid"),
    (["lora.layers=top"], "lora.layers = 'top' is invalid"),
    (["lora.target_modules=[]"], "lora.target_modules = () is invalid"),
    (["data.tasks=[]"], "data.tasks = () is invalid"),
    (["data.n_clients=0"], "data.n_clients = 0 is invalid"),
    (["data.max_seq_len=8"], "data.max_seq_len = 8 is invalid"),
    (['data.partition_key=""'], "data.partition_key = '' is invalid"),
    (["data.partition_mode=user"], "data.partition_mode = 'user' is invalid"),
    (["data.dirichlet_alpha=0"], "data.dirichlet_alpha = 0.0 is invalid"),
    (["network.distance_max_m=10"], "network.distance_max_m = 10.0 is invalid"),
    (["network.fading=rician"], "network.fading = 'rician' is invalid"),
    (["network.bits_per_param=65"], "network.bits_per_param = 65 is invalid"),
    (["network.comm_cost=cubic"], "network.comm_cost = 'cubic' is invalid"),
    (["network.comp_cost=exact"], "network.comp_cost = 'exact' is invalid"),
    (["network.rho=1.5"], "network.rho = 1.5 is invalid"),
    (["training.rounds=0"], "training.rounds = 0 is invalid"),
    (["training.rounds=5.0"], "without a decimal point"),
    (["training.rounds=true"], "training.rounds = True is invalid"),
    (["training.lr=0"], "training.lr = 0.0 is invalid"),
    (["training.lr=fast"], "training.lr = 'fast' is invalid: a number"),
    (["training.seed=-1"], "training.seed = -1 is invalid"),
    (["training.target_accuracy=55"], "training.target_accuracy = 55.0 is invalid"),
    (["method.name='fed prox'"], "method.name = 'fed prox' is invalid"),
    (["planner.solver=gurobi"], "planner.solver = 'gurobi' is invalid"),
    (["planner.max_iterations=0"], "planner.max_iterations = 0 is invalid"),
    (["output.dir=''"], "output.dir = '' is invalid"),
    (["output.progress=1"], "output.progress = 1 is invalid: true or false"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_VALUES, ids=lambda v: str(v))
def test_each_bad_value_raises_config_error_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_bad_values_are_never_clamped():
    # the dataclasses themselves validate too, not only the loader
    with pytest.raises(ConfigError, match=r"method\.q\[0\] = 1\.5 is invalid: must be <= 1"):
        MethodConfig(q=(1.5,))
    with pytest.raises(ConfigError, match=r"lora\.rank = 0 is invalid: must be >= 1"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="network.f_tot_hz"):
        NetworkConfig(f_tot_hz=-1.0)
    with pytest.raises(ConfigError, match=r"method\.k = \(4, 17\)"):
        ExperimentConfig(data=DataConfig(n_clients=2), method=MethodConfig(k=(4, 17)))
    with pytest.raises(ConfigError, match=r"network\.distance_max_m"):
        NetworkConfig(distance_min_m=50.0, distance_max_m=20.0)


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("[training]\nrounds = \n", r"not valid TOML: .*line 2, column 10"),
        ("[training]\nrounds = 1\n[training]\nrounds = 2\n", "not valid TOML"),
        ("[training\n", "not valid TOML"),
        ("training = 5\n", r"\[training\] must be a table"),
        ("rounds = 5\n", r"unknown section \[rounds\]"),
        ("[training]\nrounds = 'ten'\n", "training.rounds = 'ten' is invalid: an integer"),
    ],
)
def test_malformed_toml_files(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, text))


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.toml"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[model]\nname = "\xe9"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(latin1)


def test_errors_are_value_errors_for_library_callers():
    with pytest.raises(ValueError):
        load_config(None, ["lora.rank=0"])


# ----------------------------------------------------------------------------- docs


def test_docs_config_md_documents_every_section_and_key():
    # docs/config.md is written by hand; this keeps it in step with the dataclasses.
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text(encoding="utf-8")
    parts = re.split(r"^### `\[(\w+)\]`", doc, flags=re.M)  # [intro, name, body, name, body...]
    bodies = dict(zip(parts[1::2], parts[2::2]))
    assert list(bodies) == list(SECTIONS), "docs/config.md: one '### `[section]`' per section"
    for section in SECTIONS:
        for name, default in _documented_keys(section, getattr(ExperimentConfig(), section)):
            key = name.rpartition(".")[2]
            assert f"| `{key}` |" in bodies[section], (
                f"docs/config.md: add a row for {name} under [{section}]"
            )
            if dataclasses.is_dataclass(default):  # a table of the section ([data.mc])
                assert f"| `{key}` | table `[{name}]` |" in bodies[section], name
                continue
            row = f"| `{key}` | `{toml_value(default)}` |"
            assert row in bodies[section], f"docs/config.md: {name} default is {row}"


def _documented_keys(prefix: str, section: object) -> list[tuple[str, object]]:
    """(``section.key``, default) of every field, a table's (``[data.mc]``) after its own row."""
    out: list[tuple[str, object]] = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out.append((f"{prefix}.{f.name}", value))
        if dataclasses.is_dataclass(value):
            out.extend(_documented_keys(f"{prefix}.{f.name}", value))
    return out
