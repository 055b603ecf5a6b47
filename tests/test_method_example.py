"""docs/methods.md "Writing a method": the example file is what the docs quote, it registers,
builds, plans and aggregates as its docstring says, and a tiny run trains with it."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods import make_method
from fedlora.federation.methods.registry import check_method_config, method_names

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "my_method.py"
DATA = os.environ.get("FEDLORA_DATA", str(ROOT.parents[1] / "shared/data/commonsense"))


@pytest.fixture
def example(method_registry):
    """The example module, imported from its file; its registration is undone afterwards
    (conftest's `method_registry`)."""
    spec = importlib.util.spec_from_file_location("fedlora_docs_my_method", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_quote_the_example_file_verbatim():
    doc = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Writing a method") : doc.index("## Reference behaviour")]
    assert f"```python\n{EXAMPLE.read_text(encoding='utf-8')}```" in section
    body = EXAMPLE.read_text(encoding="utf-8")
    cls = body[body.index("@register_method") :]
    assert len(cls.splitlines()) <= 32  # the method itself stays about 30 lines


def test_the_example_registers_checks_builds_plans_and_aggregates(example):
    assert "largest_first" in method_names()
    with pytest.raises(ConfigError, match=r"method.clients_per_round = 0 is invalid: >= 1 here"):
        check_method_config(load_config(None, ["method.name=largest_first"]))
    check_method_config(load_config(None, []))  # its check concerns only its own name
    cfg = load_config(None, ["method.name=largest_first", "data.n_clients=4", "lora.rank=2",
                             "method.clients_per_round=2"])  # fmt: skip
    a = np.array([0.1, 0.4, 0.2, 0.3])
    method = make_method(cfg, a, np.random.default_rng(0))
    plan = method.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    # the two largest clients (1: 0.4, 3: 0.3), weights 0.4/0.7 and 0.3/0.7, full rank
    assert plan.participants == [1, 3]
    assert [t.weight for t in plan.tasks] == pytest.approx([4 / 7, 3 / 7])
    assert all(t.rank_used == 2 and t.scale.tolist() == [1.0, 1.0] for t in plan.tasks)
    x = {"m.lora_A": np.zeros((2, 3))}
    agg = method.aggregate(x, plan, [{"m.lora_A": np.full((2, 3), 7.0)},
                                     {"m.lora_A": np.full((2, 3), 14.0)}])  # fmt: skip
    # 0 + 4/7·7 + 3/7·14 = 4 + 6 = 10
    np.testing.assert_allclose(agg.global_state["m.lora_A"], 10.0)
    adam = load_config(None, [*cfg_overrides(), "method.server_optimizer=adam"])
    assert check_method_config(adam).delta_aggregate  # a server optimizer may step on it


def cfg_overrides() -> list[str]:
    return ["method.name=largest_first", "data.n_clients=4", "method.clients_per_round=2"]


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_a_tiny_run_trains_with_the_example(example, tmp_path):
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(
        None,
        ["model.name=tiny-llama", "model.dtype=fp32", "model.threads=1",
         f'data.data_dir="{DATA}"', 'data.tasks=["arc-e"]', "data.train_limit=24",
         "data.eval_limit=4", "data.max_seq_len=64", "data.n_clients=3",
         "data.min_client_examples=4", "lora.rank=2", "lora.layers=1", "training.rounds=2",
         "training.local_steps=1", "training.batch_size=2", "training.slots=2",
         "training.eval_every=2", "method.name=largest_first", "method.clients_per_round=2",
         "output.progress=false"],
    )  # fmt: skip
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2]
    assert lines[1]["participants"] == lines[2]["participants"]  # the same two, every round
    assert len(lines[1]["participants"]) == 2 and lines[2]["train_loss"] is not None
    assert summary["rounds"] == 2
