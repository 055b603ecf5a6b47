"""research/privacy_tradeoff/privacy_tradeoff.py end to end on a tiny random-init model: the clip stage writes
clip.json from the runs' update norms (and refuses to overwrite it with other values), the run
stage runs the named labels with their σ and C, the summary writes the rule's tables and a
verdict line; σ that differs from the rule's numbers is refused before any run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedlora.cli import main as fedlora_main
from fedlora.system.privacy import noise_multiplier_for_epsilon
from tiny_runs import DATA, load_script

pytest.importorskip("dp_accounting")
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
ROOT = Path(__file__).resolve().parents[1]

TINY_BASE = f"""
[model]
name = "tiny-llama"
dtype = "fp32"
threads = 1
[lora]
rank = 4
layers = 1
[data]
data_dir = "{DATA}"
tasks = ["arc-e"]
eval_tasks = ["arc-e"]
train_limit = 24
eval_limit = 6
max_seq_len = 64
n_clients = 4
min_client_examples = 4
[training]
rounds = 2
local_steps = 1
batch_size = 2
lr = 0.05
checkpoint_every = 100
[method]
name = "sketched"
q = "fixed"
q_fixed = 0.5
k = "uniform"
[evaluation]
predictions = true
"""


@pytest.fixture(scope="module")
def bench():
    return load_script("research/privacy_tradeoff/privacy_tradeoff.py")


def _in_process(args: list[str]) -> None:
    assert fedlora_main(["run", "-q", *args]) == 0


@needs_data
def test_clip_then_two_runs_then_the_summary_with_its_verdict(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "execute", _in_process)
    base = tmp_path / "tiny.toml"
    base.write_text(TINY_BASE)
    out, runs = tmp_path / "results", tmp_path / "runs"
    where = ["--out", str(out), "--runs", str(runs), "--base", str(base)]

    assert bench.main(["run", *where, "--only", "lora-inf"]) == 2  # no clip.json yet
    assert bench.main(["clip", *where]) == 0
    clip = json.loads((out / "clip.json").read_text())
    for arm in ("lora", "ffa"):
        lines = [
            json.loads(x) for x in (out / f"clip-{arm}/metrics.jsonl").read_text().splitlines()
        ]
        assert len(lines) == 11 and (out / f"clip-{arm}/run_info.json").is_file()
        norms = [n for x in lines[1:] for n in x["dp_update_norms"]]
        assert clip["median_norm"][arm] == pytest.approx(float(np.median(norms)))
        assert clip["clip_norm"][arm] == float(f"{np.median(norms):.2g}")
        assert clip["n_norms"][arm] == len(norms)
    # the same runs again: nothing reruns and clip.json stays; other values are refused
    assert bench.main(["clip", *where]) == 0
    changed = {**clip, "clip_norm": {"lora": 1.0, "ffa": 1.0}}
    (out / "clip.json").write_text(json.dumps(changed))
    assert bench.main(["clip", *where]) == 2
    assert json.loads((out / "clip.json").read_text())["clip_norm"] == {"lora": 1.0, "ffa": 1.0}
    (out / "clip.json").write_text(json.dumps(clip))

    assert bench.main(["run", *where, "--only", "ffa-eps8", "lora-eps8"]) == 0
    info = json.loads((out / "ffa-eps8/run_info.json").read_text())
    sigma = noise_multiplier_for_epsilon(8.0, "uniform", 0.5, 2, 1e-5, n_clients=4)
    assert info["sigma"] == sigma and info["clip_norm"] == clip["clip_norm"]["ffa"]
    assert info["epsilon_bound"] <= 8.0
    summary = json.loads((out / "lora-eps8/summary.json").read_text())
    assert summary["privacy"]["noise_multiplier"] == noise_multiplier_for_epsilon(
        8.0, "poisson", 0.5, 2, 1e-5
    )
    assert summary["privacy"]["largest_epsilon"] <= 8.0
    assert summary["privacy"]["clip_norm"] == clip["clip_norm"]["lora"]

    capsys.readouterr()
    assert bench.main(["summary", "--out", str(out)]) == 0
    md = (out / "summary.md").read_text()
    doc = json.loads((out / "summary.json").read_text())
    assert doc["runs"]["lora-inf"] == {"status": "not run"}
    assert doc["runs"]["lora-eps8"]["epsilon"] == summary["privacy"]["epsilon"]  # every client
    assert "| lora-inf | not run |" in md and "one core's time" in md
    assert doc["ffa_vs_lora"]["8"]["verdict"] == _rule_verdict(out / "lora-eps8", out / "ffa-eps8")
    assert doc["ffa_vs_lora"]["2"] is None and "| 2 | not run |" in md
    assert doc["verdict"] == "not decided (a run is missing)"
    assert "**The FFA-LoRA claim (better than LoRA under DP): not decided" in md
    assert doc["questions"] == 6 and doc["chance"] == 0.25


def _rule_verdict(lora_dir: Path, ffa_dir: Path) -> str:
    """The rule's verdict by hand from the two runs' last predictions: FFA-LoRA's gain over
    LoRA on the same questions, decided by the exact two-sided McNemar test at p < 0.05."""

    def last(run_dir: Path) -> dict:
        lines = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
        final = max(lines, key=lambda x: x["round"])  # one task: arc-e
        return dict(zip(final["ids"], final["correct"]))

    lora, ffa = last(lora_dir), last(ffa_dir)
    assert lora.keys() == ffa.keys()
    b = sum(lora[i] and not ffa[i] for i in lora)  # LoRA only
    c = sum(ffa[i] and not lora[i] for i in lora)  # FFA-LoRA only
    n = b + c
    p = min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n) if n else 1.0
    if p < 0.05:
        return "held" if c > b else "not held"
    return "inconclusive"


# the rule's cohort (research/privacy_tradeoff/privacy_tradeoff.md): 10 clients, 100 rounds, LoRA at q = 0.2,
# FFA-LoRA 2 of 10 a round, δ = 1e-5
RULE_BASE = (
    TINY_BASE.replace("n_clients = 4", "n_clients = 10")
    .replace("rounds = 2", "rounds = 100")
    .replace("q_fixed = 0.5", "q_fixed = 0.2")
)


def test_a_sigma_other_than_the_rules_is_refused_before_any_run(bench, tmp_path, monkeypatch):
    base = tmp_path / "rule.toml"
    base.write_text(RULE_BASE)
    assert bench.check_rule_sigma(list(bench.RULE_SIGMA), str(base), True) == []
    monkeypatch.setitem(bench.RULE_SIGMA, "lora-eps8", 1.0)
    bad = bench.check_rule_sigma(["lora-inf", "lora-eps8"], str(base), True)
    assert len(bad) == 1 and "lora-eps8" in bad[0] and "1.0" in bad[0]
    out = tmp_path / "results"
    out.mkdir()
    (out / "clip.json").write_text(json.dumps({"clip_norm": {"lora": 0.1, "ffa": 0.1}}))

    def never(args):
        raise AssertionError("no run may start")

    monkeypatch.setattr(bench, "execute", never)
    assert bench.main(["run", "--out", str(out), "--only", "lora-inf", "lora-eps8"]) == 2


def test_the_rule_relation_of_the_verdicts(bench):
    from research.privacy_tradeoff import privacy_tradeoff_summary as s

    assert s.overall(["held", "held"]) == "held"
    assert s.overall(["held", "not held"]) == "inconclusive"
    assert s.overall(["inconclusive", "not held"]) == "inconclusive"
    assert s.overall(["not held", "not held"]) == "not held"
    assert s.overall(["held", "inconclusive"]) == "inconclusive"
    assert s.overall(["inconclusive", "inconclusive"]) == "inconclusive"
    assert s.overall(["held", None]).startswith("not decided")
    one = {"ids": ["a"] * 40, "change": {"gain_ci95": [-0.1, 0.1]}}
    lora = {**one, "correct": [0] * 40}
    assert s.compare(lora, {**one, "correct": [1] * 10 + [0] * 30})["verdict"] == "held"
    assert s.compare(lora, {**one, "correct": [1] * 3 + [0] * 37})["verdict"] == "inconclusive"
    assert s.compare({**one, "correct": [1] * 10 + [0] * 30}, lora)["verdict"] == "not held"
