"""The post-FSLoRA methods end to end on a tiny random-init model and real data: what each
one trains and keeps (read back from its checkpoints), the exact bits its clock charges, a
resume that reproduces the uninterrupted run bit for bit, and `fedlora compare --suite
methods` over every method."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.federation.checkpoints import checkpoint_paths
from fedlora.federation.run import prepare_run_dir, run_experiment
from fedlora.studies.suites import METHOD_SUITE

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

GAMMA = 4
TINY = [
    "model.name=tiny-llama",
    "model.dtype=fp32",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e"]',
    "data.train_limit=16",
    "data.eval_limit=4",
    "data.max_seq_len=48",
    "evaluation.format=llm-adapters",  # short prompts cut from the left: 16 examples stay 16
    "data.n_clients=3",
    "data.min_client_examples=2",
    f"lora.rank={GAMMA}",
    'lora.layers="all"',
    "training.rounds=2",
    "training.local_steps=2",
    "training.batch_size=2",
    "training.slots=3",
    "training.eval_every=2",
    "training.checkpoint_every=1",
    "training.lr=0.05",
    "network.bits_per_param=16",
    "method.clients_per_round=2",
    "output.progress=false",
]


def _run(tmp_path: Path, name: str, *extra: str, resume: bool = False, tag: str = "") -> Path:
    cfg = load_config(None, [*TINY, f'method.name="{name}"', *extra])
    run_dir = tmp_path / (name + tag)
    if not resume:
        prepare_run_dir(cfg, run_dir)
    run_experiment(cfg, run_dir, resume=resume, quiet=True, log=lambda m: None)
    return run_dir


def _states(run_dir: Path) -> list[dict]:
    """The checkpoints of rounds 1 and 2 (oldest first): global adapter as numpy, and more."""
    out = []
    for path in reversed(checkpoint_paths(run_dir)):
        state = _load(path)
        state["global"] = {k: v.numpy() for k, v in state["global"].items()}
        out.append(state)
    return out


def _load(path: Path) -> dict:
    from fedlora.federation.checkpoints import _load_safetensors  # noqa: PLC2701

    return _load_safetensors(path)


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _sum_shapes(run_dir: Path) -> tuple[int, int, int]:
    """(Σ out, Σ in, modules) over the adapted layers, from the round-1 checkpoint."""
    g = _states(run_dir)[0]["global"]
    outs = [v.shape[0] for k, v in g.items() if k.endswith("lora_B")]
    ins = [v.shape[1] for k, v in g.items() if k.endswith("lora_A")]
    return sum(outs), sum(ins), len(outs)


def _same(x: dict, y: dict, suffix: str) -> bool:
    return all(np.array_equal(x[k], y[k]) for k in x if k.endswith(suffix))


@needs_data
@pytest.mark.parametrize(
    "name, per_client_bits",
    [
        ("ffalora", lambda o, i, m: (GAMMA * o * 16, GAMMA * o * 16)),
        ("fedsalora", lambda o, i, m: (GAMMA * i * 16, GAMMA * i * 16)),
        ("fedsb", lambda o, i, m: (GAMMA * GAMMA * m * 16, GAMMA * GAMMA * m * 16)),
        ("rolora", None),
    ],
)
def test_each_method_trains_what_it_says_and_pays_for_what_it_sends(
    tmp_path, name, per_client_bits, monkeypatch
):
    from fedlora.federation.methods.registry import method_class

    cls = method_class(name)
    uploaded: list[set[str]] = []  # the keys of every upload the server aggregates
    aggregate = cls.aggregate

    def spy(self, global_state, plan, client_states):
        uploaded.extend(set(s) for s in client_states)
        return aggregate(self, global_state, plan, client_states)

    monkeypatch.setattr(cls, "aggregate", spy)
    run_dir = _run(tmp_path, name)
    assert len(uploaded) == 4
    r1, r2 = _states(run_dir)
    g1, g2 = r1["global"], r2["global"]
    o, i, m = _sum_shapes(run_dir)
    lines = _lines(run_dir)[1:]
    assert [line["n_participants"] for line in lines] == [2, 2]
    if per_client_bits is not None:
        up, down = per_client_bits(o, i, m)
        assert [line["uplink_bits"] for line in lines] == [2 * up] * 2
        assert [line["downlink_bits"] for line in lines] == [2 * down] * 2
    if name == "ffalora":  # A never moves, B does
        assert _same(g1, g2, "lora_A") and not _same(g1, g2, "lora_B")
    if name == "fedsb":  # only R moves; A, B orthonormal
        assert _same(g1, g2, "lora_A") and _same(g1, g2, "lora_B")
        assert not _same(g1, g2, "lora_R")
        b = next(v for k, v in g2.items() if k.endswith("lora_B"))
        np.testing.assert_allclose(b.T @ b, np.eye(GAMMA), atol=1e-5)
    if name == "rolora":  # round 2 (0-based 1) moves A only; round 1 moved B
        assert _same(g1, g2, "lora_B") and not _same(g1, g2, "lora_A")
        assert [line["uplink_bits"] for line in lines] == [2 * GAMMA * o * 16, 2 * GAMMA * i * 16]
        assert [line["downlink_bits"] for line in lines] == [2 * GAMMA * (o + i) * 16] * 2
    if name == "fedsalora":  # B never leaves the client: kept in the memory, never uploaded
        assert all(keys and not any(k.endswith("lora_B") for k in keys) for keys in uploaded)
        memory = r2["memory"]
        clients = {int(k.split("/")[0]) for k in memory}
        assert clients and all(k.endswith("lora_B") for k in memory)
        assert clients <= set(lines[0]["participants"]) | set(lines[1]["participants"])
        # the evaluated global B is Σ_n a_n B_n over every client's kept B (init: 0)
        with open(run_dir / "clients.csv", encoding="utf-8") as f:
            a = [float(row["a"]) for row in csv.DictReader(f)]
        for key in (k for k in g2 if k.endswith("lora_B")):
            kept = [memory.get(f"{n}/{key}", np.zeros_like(g2[key])) for n in range(len(a))]
            want = sum(w * b.astype(np.float64) for w, b in zip(a, kept))
            np.testing.assert_allclose(g2[key], want, rtol=1e-6, atol=1e-7)


@needs_data
@pytest.mark.parametrize("name", ["fedexlora", "fedsalora", "fedsb"])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, name):
    full = _run(tmp_path, name, tag="-full")
    half = _run(tmp_path, name, "training.rounds=1", tag="-half")
    (half / "config.toml").write_text((full / "config.toml").read_text())  # 2 rounds now
    _run(tmp_path, name, resume=True, tag="-half")
    a, b = _states(full)[-1], _states(half)[-1]
    for k in a["global"]:
        assert np.array_equal(a["global"][k], b["global"][k]), k
    for group in ("base_delta", "memory"):
        assert a[group].keys() == b[group].keys()
        for k in a[group]:
            assert np.array_equal(a[group][k], b[group][k]), (group, k)
    strip = ("compute_s",)
    la = [{k: v for k, v in x.items() if k not in strip} for x in _lines(full)]
    lb = [{k: v for k, v in x.items() if k not in strip} for x in _lines(half)]
    assert la[2] == lb[2]  # round 2 (the 1-round run also evaluated its last round, 1)
    assert {k: v for k, v in lb[1].items() if k in la[1]} == la[1]
    if name == "fedexlora":
        assert a["base_delta"] and all(np.abs(v).max() > 0 for v in a["base_delta"].values())


@needs_data
def test_compare_suite_methods_runs_every_method(tmp_path):
    suite = tmp_path / "suite.toml"
    labels = ", ".join(f'"{m}"' for m in METHOD_SUITE)
    suite.write_text(f"[suite]\nmethods = [{labels}]\n")
    out = tmp_path / "methods"
    argv = ["compare", "--suite", "methods", "-c", str(suite), "--out", str(out), "-q",
            "--tasks", "arc-e", "--target", "arc-e=0.25", *TINY]  # fmt: skip
    assert main(argv) == 0
    text = (out / "report.md").read_text()
    assert "## Failed runs" not in text
    for label in METHOD_SUITE:
        summary = json.loads((out / f"{label}-seed0" / "summary.json").read_text())
        assert summary["method"] == label and summary["rounds"] == 2
        assert f"| {label} | " in text
        assert 'comm_cost = "exact"' in (out / f"{label}-seed0" / "config.toml").read_text()
