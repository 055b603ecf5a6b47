"""The harness format end to end: scores equal a one-request-at-a-time reference, acc/acc_norm
/mc_loss from them, training examples keep their whole question, the engine logs mc_loss and
stops at training.target_mc_loss, evaluation.format = auto."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.llm.evaluation import evaluate
from fedlora.llm.harness import (
    HARNESS_MAX_PARAMS,
    acc_norm_pred,
    encode_pair,
    harness_request,
    harness_training_text,
    mc_loss,
    resolve_eval_format,
    tokenize_harness,
)
from fedlora.llm.models import load_model
from fedlora.llm.prompts import IGNORE_INDEX
from fedlora.llm.tasks import Example, convert_hub_record, load_task
from tiny_runs import DATA, TINY_EVAL_RUN

needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")


def _arc(q: str, options: list[str], answer: int, task: str = "arc-e") -> Example:
    labels = tuple(f"answer{i + 1}" for i in range(len(options)))
    opts = " ".join(f"Answer{i + 1}: {o}" for i, o in enumerate(options))
    instruction = (
        f"Please choose the correct answer to the question: {q}\n\n{opts}\n\n"
        f"Answer format: {'/'.join(labels)}"
    )
    return Example(
        task, instruction, "the correct answer is " + labels[answer], labels[answer], labels
    )


EXAMPLES = [
    _arc("Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], 1),
    _arc("What is frozen water called?", ["ice", "steam", "fog"], 0, task="obqa"),
    convert_hub_record(
        "winogrande",
        {
            "sentence": "Sam beat Max because _ was fast.",
            "option1": "Sam",
            "option2": "Max",
            "answer": "1",
        },
    ),
    convert_hub_record(
        "piqa", {"goal": "Open a jar", "sol1": "Twist it", "sol2": "Eat it", "label": 0}
    ),
    Example(
        "boolq",
        "Please answer the following question with true or false, question: is ice cold?"
        "\n\nAnswer format: true/false",
        "the correct answer is true",
        "true",
        ("true", "false"),
    ),
]


@pytest.fixture(scope="module")
def llama() -> tuple:
    return load_model("tiny-llama", dtype="fp32", progress=False)


def reference_loglik(model, tok, context: str, continuation: str) -> float:
    """lm-eval's loglikelihood of one request: one unpadded forward of context + continuation
    tokens, the continuation's tokens summed."""
    ctx, cont = encode_pair(tok, context, continuation)
    ids = ctx + cont
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(float(logp[p - 1, ids[p]]) for p in range(len(ctx), len(ids)))


def test_harness_scores_equal_one_request_at_a_time(llama) -> None:
    model, tok = llama
    res = evaluate(model, tok, EXAMPLES, batch_size=2, fmt="harness", task="mix")
    assert res.fmt == "harness" and res.scoring == "acc"
    acc, norm, mcs = [], [], []
    for ex in EXAMPLES:
        req = harness_request(ex)
        lls = [reference_loglik(model, tok, c, t) for c, t in req.pairs]
        acc.append(int(np.argmax(lls)) == req.gold)
        norm.append(acc_norm_pred(lls, req.choices) == req.gold)
        mcs.append(mc_loss(lls, req.gold))
    assert res.correct == acc
    assert res.accuracy == pytest.approx(np.mean(acc))
    assert res.acc_norm == pytest.approx(np.mean(norm))
    assert res.mc == pytest.approx(mcs, abs=1e-4)
    assert res.mc_loss == pytest.approx(np.mean(mcs), abs=1e-4)
    lo, hi = res.mc_loss_ci95
    assert lo <= res.mc_loss <= hi
    assert res.mc_chance == pytest.approx(np.mean([math.log(n) for n in (4, 3, 2, 2, 2)]))


def test_harness_ties_give_chance_mc_loss_and_the_first_option(llama) -> None:
    model, tok = llama
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # uniform next-token distribution: every token ln(1/V)
    try:
        one = [_arc("Q?", ["a", "b", "c"], 2)]  # one token each: equal scores
        res = evaluate(model, tok, one, fmt="harness")
        assert res.predictions == [0] and res.correct == [False]
        assert res.mc_loss == pytest.approx(math.log(3), abs=1e-6)
    finally:
        llama_fresh = load_model("tiny-llama", dtype="fp32", progress=False)[0]
        model.load_state_dict(llama_fresh.state_dict())


def test_harness_cached_evaluation_equals_uncached() -> None:
    from fedlora.config import LoraConfig
    from fedlora.llm.evaluation import eval_cache_for
    from fedlora.llm.lora import inject_lora

    model, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    lora = inject_lora(model, LoraConfig(rank=2, layers=1), slots=1, seed=0)
    lora.set_clients(torch.ones(1, 2))
    plain = evaluate(model, tok, EXAMPLES, fmt="harness")
    cache = eval_cache_for(model, lora, 64)
    assert cache is not None
    for _ in range(2):  # the first fills the cache, the second reads it
        got = evaluate(model, tok, EXAMPLES, fmt="harness", cache=cache)
        assert got.correct == plain.correct
        assert got.mc == pytest.approx(plain.mc, abs=1e-4)


def test_evaluate_rejects_an_unknown_format(llama) -> None:
    with pytest.raises(ConfigError, match="evaluation.format = 'cloze' is invalid"):
        evaluate(*llama, EXAMPLES, fmt="cloze")


# ----------------------------------------------------------------------------- training


class CharTok:
    """One token per character (id = ord + 3); BOS = 1 by default, EOS = 2."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) + 3 for c in text]}


@needs_data
def test_no_training_example_loses_question_tokens() -> None:
    exs = load_task("arc-c", DATA, "train")[:300]
    tok = CharTok()
    ts, kept, report = tokenize_harness(exs, tok, max_len=200)
    assert report.n == 300 and report.dropped == 300 - len(kept) > 0  # long ones dropped
    assert report.p99 <= report.longest and report.longest > 200
    for i, ids, labels in zip(kept, ts.input_ids, ts.labels):
        context, continuation = harness_training_text(exs[i])
        whole = [1] + [ord(c) + 3 for c in context + continuation] + [2]
        assert ids.tolist() == whole  # the whole question, the answer, EOS: nothing cut
        n_ctx = 1 + len(context)
        assert (labels[:n_ctx] == IGNORE_INDEX).all()
        assert labels[n_ctx:].tolist() == whole[n_ctx:]  # loss on the continuation and EOS
    for i in set(range(300)) - set(kept):
        assert 1 + len("".join(harness_training_text(exs[i]))) + 1 > 200
    assert "dropped" in report.describe() and "p99" in report.describe()


@needs_data
def test_federated_data_in_harness_format_keeps_examples_aligned() -> None:
    from fedlora.llm.data import build_federated_data

    cfg = load_config(
        None,
        [
            f'data.data_dir="{DATA}"',
            'data.tasks=["arc-c"]',
            "data.train_limit=60",
            "data.max_seq_len=180",
            "data.n_clients=2",
            "data.min_client_examples=4",
        ],
    ).data
    fed = build_federated_data(cfg, CharTok(), seed=0, fmt="harness")
    assert fed.lengths.n == 60
    assert len(fed.examples) == len(fed.train) == 60 - fed.lengths.dropped
    assert sum(len(c) for c in fed.client_indices) == len(fed.examples)
    for ex, ids in zip(fed.examples, fed.train.input_ids):
        ctx, cont = harness_training_text(ex)
        assert len(ids) == 1 + len(ctx) + len(cont) + 1


# ----------------------------------------------------------------------------- config, engine


def test_format_config_and_auto() -> None:
    assert load_config(None, []).evaluation.format == "auto"
    with pytest.raises(
        ConfigError, match=r"evaluation\.format.*'cloze'.*auto, harness, llm-adapters"
    ):
        load_config(None, ["evaluation.format=cloze"])
    with pytest.raises(ConfigError, match=r"training\.target_mc_loss"):
        load_config(None, ["training.target_mc_loss=-1"])
    assert resolve_eval_format("auto", 135_000_000, ["arc-e", "boolq"]) == "harness"
    assert resolve_eval_format("auto", HARNESS_MAX_PARAMS, ["arc-e"]) == "llm-adapters"
    assert resolve_eval_format("auto", 10, ["arc-e", "my-own-task"]) == "llm-adapters"
    assert resolve_eval_format("auto", 10, ["ARC-Challenge"]) == "harness"  # a task file's folder
    assert resolve_eval_format("llm-adapters", 10) == "llm-adapters"


@needs_data
def test_engine_in_harness_format_logs_mc_loss(tmp_path: Path) -> None:
    from fedlora.federation.progress import describe
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(None, TINY_EVAL_RUN)  # evaluation.format = auto: harness for a tiny model
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    logs: list[str] = []
    summary = run_experiment(cfg, run_dir, quiet=True, log=logs.append)
    assert any("evaluation.format: harness" in m for m in logs)
    assert any("p99" in m and "dropped" in m for m in logs)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        assert line["eval_format"] == "harness" and line["eval_scoring"] == "acc"
        assert line["eval_mc_loss"] == pytest.approx(np.mean(list(line["eval_mc_losses"].values())))
        assert line["eval_mc_chance"]["boolq"] == pytest.approx(math.log(2))
        for task, (lo, hi) in line["eval_mc_loss_ci95"].items():
            assert lo <= line["eval_mc_losses"][task] <= hi
        assert 0 <= line["eval_acc_norm"]["arc-e"] <= 1
    preds = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
    for p in preds:
        line = lines[p["round"]]
        assert p["format"] == "harness" and len(p["mc_loss"]) == 10
        assert np.mean(p["mc_loss"]) == pytest.approx(line["eval_mc_losses"][p["task"]], abs=1e-5)
        # per question under acc_norm too: its mean is the logged acc_norm
        assert len(p["correct_norm"]) == 10 and set(p["correct_norm"]) <= {0, 1}
        assert np.mean(p["correct_norm"]) == pytest.approx(line["eval_acc_norm"][p["task"]])
    assert summary["initial_mc_loss"] == pytest.approx(lines[0]["eval_mc_loss"])
    assert summary["final_mc_loss"] == pytest.approx(lines[-1]["eval_mc_loss"])
    assert summary["train_lengths"]["n"] == 40
    # the final evaluation paired with round 0 on the same questions, from predictions.jsonl
    from fedlora.llm.eval_stats import paired_change

    last = max(p["round"] for p in preds)
    for task, pair in summary["paired_eval"].items():
        (p0,) = [p["correct"] for p in preds if p["round"] == 0 and p["task"] == task]
        (p1,) = [p["correct"] for p in preds if p["round"] == last and p["task"] == task]
        assert pair == paired_change(p0, p1)
    assert set(summary["paired_eval"]) == set(lines[0]["eval_n"])
    text = describe(summary)
    assert "(n = 10) in the harness format" in text and "acc_norm" in text and "mc_loss" in text
    assert "paired on the same 10 questions" in text and "exact McNemar p = " in text


@needs_data
def test_target_mc_loss_stops_the_run(tmp_path: Path) -> None:
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(None, [*TINY_EVAL_RUN, "training.rounds=5", "training.target_mc_loss=100.0"])
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    assert summary["stop_reason"] == "target_mc_loss" and summary["rounds"] == 0
    assert summary["time_to_target_mc_loss_s"] == 0.0 and summary["target_mc_loss"] == 100.0


@needs_data
def test_fedlora_eval_format(capsys: pytest.CaptureFixture[str]) -> None:
    from fedlora.cli import main

    argv = ["eval", "--model", "tiny-llama", "--task", "arc-e", "--data-dir", DATA, "--limit", "4"]
    assert main([*argv, "--json"]) == 0  # auto: harness for a tiny model on arc-e
    out = json.loads(capsys.readouterr().out)
    assert (out["format"], out["scoring"], out["n"]) == ("harness", "acc", 4)
    assert 0 <= out["acc_norm"] <= 1 and out["mc_chance"] == pytest.approx(math.log(4), abs=0.1)
    assert main([*argv, "--format", "llm-adapters", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["format"], out["scoring"]) == ("llm-adapters", "label")
    assert out["acc_norm"] is None and out["mc_loss"] > 0
    assert main([*argv, "--format", "harness"]) == 0
    text = capsys.readouterr().out
    assert "acc_norm" in text and "mc_loss" in text and "format harness" in text
    assert main([*argv, "--format", "cloze"]) == 2
    assert "--format = 'cloze' is invalid" in capsys.readouterr().err
