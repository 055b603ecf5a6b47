"""eval_loss, option_norm scoring, majority and chance scores, option training targets, and
the engine's evaluation fields (issue 13): hand-computed on a model whose logits are forced."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.errors import ConfigError, DataError
from fedlora.llm.eval_stats import chance_score, majority_score
from fedlora.llm.evaluation import (
    candidate_logprobs,
    candidate_token_logprobs,
    discriminative_start,
    evaluate,
    question_id,
)
from fedlora.llm.models import load_model
from fedlora.llm.prompts import encode_continuation, response_text, tokenize_examples
from fedlora.llm.tasks import RESPONSE_PREFIX, Example
from tiny_runs import DATA, TINY_EVAL_RUN


def mc(q: str, options: list[str], answer: int, task: str = "t") -> Example:
    labels = tuple(f"answer{i + 1}" for i in range(len(options)))
    opts = " ".join(f"Answer{i + 1}: {o}" for i, o in enumerate(options))
    instruction = (
        f"Please choose the correct answer to the question: {q}\n\n{opts}\n\n"
        f"Answer format: {'/'.join(labels)}"
    )
    return Example(task, instruction, RESPONSE_PREFIX + labels[answer], labels[answer], labels)


@pytest.fixture(scope="module")
def llama() -> tuple:
    return load_model("tiny-llama", dtype="fp32", progress=False)


def _force(model, bias: dict[int, float]):
    """Every position's logits become 0, plus `bias[token]` for the given tokens."""

    def hook(_module, _inputs, output):
        out = torch.zeros_like(output)
        for tok, b in bias.items():
            out[..., tok] = b
        return out

    return model.get_output_embeddings().register_forward_hook(hook)


def _tail(tok, text: str) -> list[int]:
    ids, n = encode_continuation(tok, RESPONSE_PREFIX, text)
    return ids[len(ids) - n :]


# ----------------------------------------------------------------------------- eval_loss


def test_discriminative_start() -> None:
    assert discriminative_start([[5, 1], [5, 2], [5, 3]]) == 1  # " answer" shared
    assert discriminative_start([[7], [8]]) == 0
    assert discriminative_start([[5, 6, 1], [5, 6, 1, 2]]) == 2  # every tail keeps a token
    assert discriminative_start([[5], [5]]) == 0


def test_eval_loss_hand_computed_on_a_forced_model(llama) -> None:
    model, tok = llama
    vocab = model.config.vocab_size
    tails = [_tail(tok, f"answer{i}") for i in (1, 2, 3)]
    p = discriminative_start(tails)
    assert p >= 1, tails  # " answer" + digit: the digit alone tells the labels apart
    digit2 = tails[1][p]
    exs = [mc("q1", ["a", "b", "c"], 1), mc("q2", ["a", "b", "c"], 0)]
    b = 3.0
    handle = _force(model, {digit2: b})
    try:
        result = evaluate(model, tok, exs, batch_size=2)
    finally:
        handle.remove()
    # every position: logits 0 except the digit "2" at b. log p(2) = b - log(e^b + V - 1),
    # log p(any other token) = -log(e^b + V - 1).
    log_z = math.log(math.exp(b) + vocab - 1)
    nll_q1 = -(b - log_z) * len(tails[1][p:]) / len(tails[1][p:])  # answer2 is right
    nll_q2 = log_z  # answer1 is right: its digit has logit 0
    assert result.nll == pytest.approx([nll_q1, nll_q2], abs=1e-5)
    assert result.loss == pytest.approx((nll_q1 + nll_q2) / 2, abs=1e-5)
    half = 1.959963984540054 * np.std([nll_q1, nll_q2], ddof=1) / math.sqrt(2)
    assert result.loss_ci95 == pytest.approx((result.loss - half, result.loss + half), abs=1e-5)
    # the forced model answers "answer2" everywhere: right on q1, wrong on q2
    assert result.predictions == [1, 1] and result.correct == [True, False]
    assert result.accuracy == 0.5 and result.ids == [question_id(e) for e in exs]


def test_eval_loss_of_a_flat_model_is_log_vocab(llama) -> None:
    model, tok = llama
    handle = _force(model, {})
    try:
        for scoring in ("label", "option", "option_norm"):
            r = evaluate(model, tok, [mc("q", ["red apple", "zebra", "blue"], 1)], scoring=scoring)
            assert r.loss == pytest.approx(math.log(model.config.vocab_size), abs=1e-5)
            assert math.isnan(r.loss_ci95[0])  # one question: no interval
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- option_norm


def test_option_norm_divides_by_option_characters(llama) -> None:
    model, tok = llama
    options = ["an elephant in the room", "ox", "a cat"]
    ex = mc("q", options, 0)
    handle = _force(model, {})  # flat: every token costs log V
    try:
        sums = candidate_logprobs(model, tok, [ex], scoring="option")[0]
        norm = candidate_logprobs(model, tok, [ex], scoring="option_norm")[0]
        token_lps = candidate_token_logprobs(model, tok, [ex], scoring="option")[0]
        acc_sum = evaluate(model, tok, [ex], scoring="option").predictions
        acc_norm = evaluate(model, tok, [ex], scoring="option_norm").predictions
    finally:
        handle.remove()
    log_v = math.log(model.config.vocab_size)
    n_tokens = [len(_tail(tok, o)) for o in options]
    assert [len(t) for t in token_lps] == n_tokens
    np.testing.assert_allclose(sums, [-n * log_v for n in n_tokens], atol=1e-4)
    expected = [-n * log_v / len(o) for n, o in zip(n_tokens, options)]
    np.testing.assert_allclose(norm, expected, atol=1e-5)
    # the sum prefers the fewest tokens; per character, the long option wins
    assert acc_sum == [int(np.argmin(n_tokens))]
    assert acc_norm == [int(np.argmax(expected))] == [0]


def test_option_norm_on_a_biased_model(llama) -> None:
    model, tok = llama
    vocab = model.config.vocab_size
    options = ["zebra", "zebra zebra zebra zebra"]  # the same tokens, 1x and 4x
    z = _tail(tok, "zebra")
    b = 2.0
    handle = _force(model, dict.fromkeys(z, b))
    try:
        norm = candidate_logprobs(model, tok, [mc("q", options, 0)], scoring="option_norm")[0]
    finally:
        handle.remove()
    tails = [_tail(tok, o) for o in options]
    log_z = math.log(len(set(z)) * math.exp(b) + vocab - len(set(z)))
    expected = [
        sum((b if t in z else 0.0) - log_z for t in tail) / len(o)
        for tail, o in zip(tails, options)
    ]
    np.testing.assert_allclose(norm, expected, atol=1e-5)


# ----------------------------------------------------------------------------- baselines


def test_majority_and_chance_scores() -> None:
    exs = [mc("a", ["x", "y", "z", "w"], i) for i in (0, 1, 2, 2, 2, 3)]
    assert majority_score(exs) == pytest.approx(3 / 6)  # "always answer3"
    assert chance_score(exs) == pytest.approx(0.25)
    mixed = [mc("a", ["x", "y"], 0), mc("b", ["x", "y", "z", "w"], 0)]
    assert chance_score(mixed) == pytest.approx((1 / 2 + 1 / 4) / 2)
    assert majority_score(mixed) == 1.0
    with pytest.raises(DataError, match="no examples"):
        majority_score([])
    with pytest.raises(DataError, match="no examples"):
        chance_score([])


def test_evaluate_reports_majority_and_chance(llama) -> None:
    model, tok = llama
    exs = [mc(q, ["x", "y", "z"], i) for q, i in (("a", 0), ("b", 2), ("c", 2))]
    r = evaluate(model, tok, exs)
    assert r.majority == pytest.approx(2 / 3) and r.chance == pytest.approx(1 / 3)
    assert len(set(r.ids)) == 3 and r.n == 3 and r.scoring == "label"


# ----------------------------------------------------------------------------- training target


def test_option_response_trains_on_the_option_text(llama) -> None:
    _, tok = llama
    ex = mc("q", ["red apple", "zebra", "blue"], 1)
    assert response_text(ex) == ex.output == "the correct answer is answer2"
    assert response_text(ex, "option") == "the correct answer is zebra"
    boolq = Example("boolq", "Q?\n\nAnswer format: true/false", "x", "false", ("true", "false"))
    assert response_text(boolq, "option") == "the correct answer is false"
    with pytest.raises(DataError, match=r"data.response = 'text' is invalid: allowed: label, opt"):
        response_text(ex, "text")
    ts = tokenize_examples([ex], tok, 128, response="option")
    target = ts.input_ids[0][ts.labels[0] != -100].tolist()
    # the scored option tokens are exactly what evaluation scores, then EOS
    assert target[-1] == tok.eos_token_id
    assert target[-1 - len(_tail(tok, "zebra")) : -1] == _tail(tok, "zebra")
    assert tok.decode(target[:-1]) == "the correct answer is zebra"


# ----------------------------------------------------------------------------- config


def test_evaluation_config_and_bad_values() -> None:
    cfg = load_config(None, ["evaluation.scoring=option_norm", "data.response=option"])
    assert cfg.evaluation.scoring == "option_norm" and cfg.data.response == "option"
    # the defaults are the CPU protocol (research/cpu_protocol/cpu_protocol.md)
    assert load_config().evaluation.scoring == "option_norm"
    assert load_config().data.response == "option"
    bad = {
        "evaluation.scoring=acc": r"evaluation.scoring = 'acc' is invalid: allowed: label, "
        r"option, option_norm",
        "evaluation.batch_size=0": r"evaluation.batch_size = 0 is invalid: must be >= 1",
        "evaluation.predictions=1": r"evaluation.predictions = 1 is invalid: true or false",
        "data.response=text": r"data.response = 'text' is invalid: allowed: label, option",
        "training.target_loss=-1": r"training.target_loss = -1(.0)? is invalid: must be >= 0",
    }
    for override, msg in bad.items():
        with pytest.raises(ConfigError, match=msg):
            load_config(None, [override])


# ----------------------------------------------------------------------------- engine


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_engine_logs_eval_loss_baselines_and_predictions(tmp_path: Path) -> None:
    from fedlora.federation.progress import describe
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(
        None,
        [
            *TINY_EVAL_RUN,
            "evaluation.format=llm-adapters",
            "evaluation.scoring=option_norm",
            "data.response=option",
        ],
    )
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1, 2]
    for line in lines:
        assert set(line["eval_losses"]) == {"arc-e", "boolq"}
        assert line["eval_loss"] == pytest.approx(np.mean(list(line["eval_losses"].values())))
        assert line["eval_n"] == {"arc-e": 10, "boolq": 10}
        assert line["eval_chance"]["boolq"] == 0.5 and line["eval_scoring"] == "option_norm"
        assert line["eval_format"] == "llm-adapters" and line["eval_acc_norm"]["boolq"] is None
        assert line["eval_mc_chance"]["boolq"] == pytest.approx(math.log(2))
        for task, (lo, hi) in line["eval_ci95"].items():
            assert lo <= line["eval"][task] <= hi
    preds = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [(p["round"], p["task"]) for p in preds] == [
        (r, t) for r in (0, 1, 2) for t in ("arc-e", "boolq")
    ]
    for p in preds:
        line = lines[p["round"]]
        assert len(p["ids"]) == len(p["pred"]) == len(p["correct"]) == len(p["nll"]) == 10
        assert np.mean(p["correct"]) == pytest.approx(line["eval"][p["task"]])
        assert np.mean(p["nll"]) == pytest.approx(line["eval_losses"][p["task"]], abs=1e-5)
    assert summary["initial_eval_loss"] == pytest.approx(lines[0]["eval_loss"])
    assert summary["final_eval_loss"] == pytest.approx(lines[-1]["eval_loss"])
    assert summary["final_eval"]["boolq"]["majority"] == lines[0]["eval_majority"]["boolq"]
    text = describe(summary)
    assert "most-frequent label" in text and "eval_loss" in text and "boolq (n = 10)" in text


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
def test_target_loss_stops_the_run(tmp_path: Path) -> None:
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(None, [*TINY_EVAL_RUN, "training.rounds=5", "training.target_loss=1000.0"])
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir)
    summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    # the untrained adapter's eval_loss (round 0) is already below 1000
    assert summary["stop_reason"] == "target_loss" and summary["rounds"] == 0
    assert summary["time_to_target_loss_s"] == 0.0 and summary["target_loss"] == 1000.0


# ----------------------------------------------------------------------------- eval cache

CACHE_EXAMPLES = [
    mc("Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], 1),
    mc("What is frozen water called?", ["ice", "steam", "fog"], 0),
    mc("A much longer question about the moon and the tides of the sea?", ["x", "y"], 1),
    Example(
        "boolq",
        "Please answer the following question with true or false, question: is ice cold?"
        "\n\nAnswer format: true/false",
        "the correct answer is true",
        "true",
        ("true", "false"),
    ),
]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("scoring", ["label", "option_norm"])
def test_cached_evaluation_equals_uncached(name: str, scoring: str) -> None:
    from fedlora.config import LoraConfig
    from fedlora.llm.evaluation import eval_cache_for
    from fedlora.llm.lora import inject_lora

    model, tok = load_model(name, dtype="fp32", progress=False)
    lora = inject_lora(model, LoraConfig(rank=4, layers=1), slots=2, seed=0)
    gen = torch.Generator().manual_seed(0)
    lora.load_global(
        {k: torch.randn(v.shape, generator=gen) * 0.5 for k, v in lora.global_state().items()}
    )
    lora.set_clients(torch.ones(1, 4))
    cache = eval_cache_for(model, lora, 64.0)
    assert cache is not None and cache.first_layer == 1
    assert eval_cache_for(model, lora, 64.0) is cache  # kept for the run
    ref = evaluate(model, tok, CACHE_EXAMPLES, batch_size=3, scoring=scoring)
    for _ in range(2):  # the first evaluation fills the cache, the second reads it
        got = evaluate(model, tok, CACHE_EXAMPLES, batch_size=3, scoring=scoring, cache=cache)
        assert got.predictions == ref.predictions and got.correct == ref.correct
        np.testing.assert_allclose(got.nll, ref.nll, atol=1e-5)
        ref_lp = candidate_token_logprobs(model, tok, CACHE_EXAMPLES, scoring=scoring)
        got_lp = candidate_token_logprobs(model, tok, CACHE_EXAMPLES, scoring=scoring, cache=cache)
        for r, g in zip(ref_lp, got_lp):
            for rt, gt in zip(r, g):
                np.testing.assert_allclose(gt, rt, atol=1e-5)
    stats = cache.stats()
    assert stats["misses"] == len(CACHE_EXAMPLES) and stats["hits"] == 3 * len(CACHE_EXAMPLES)
    # a new global adapter changes only the top layers: the cache stays valid
    lora.load_global({k: v * 0.5 for k, v in lora.global_state().items()})
    ref2 = evaluate(model, tok, CACHE_EXAMPLES, batch_size=2, scoring=scoring)
    got2 = evaluate(model, tok, CACHE_EXAMPLES, batch_size=2, scoring=scoring, cache=cache)
    np.testing.assert_allclose(got2.nll, ref2.nll, atol=1e-5)
    assert cache.stats()["misses"] == len(CACHE_EXAMPLES)


def test_eval_cache_is_bounded_and_off_when_nothing_is_frozen() -> None:
    from fedlora.config import LoraConfig
    from fedlora.llm.evaluation import eval_cache_for
    from fedlora.llm.lora import inject_lora

    model, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    lora_all = inject_lora(model, LoraConfig(rank=2, layers="all"), slots=1, seed=0)
    assert eval_cache_for(model, lora_all, 64.0) is None
    model, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    lora = inject_lora(model, LoraConfig(rank=2, layers=1), slots=1, seed=0)
    assert eval_cache_for(model, lora, 0.0) is None
    big = eval_cache_for(model, lora, 64.0)
    evaluate(model, tok, CACHE_EXAMPLES, cache=big)
    sizes = [big._entry_bytes(k, v) for k, v in big._entries.items()]
    assert len(sizes) == len(CACHE_EXAMPLES)
    # room for the largest question and not one more: it keeps the first, adds no other
    cache = eval_cache_for(model, lora, (max(sizes) + min(sizes) - 1) / 2**20)
    assert cache is not big
    ref = evaluate(model, tok, CACHE_EXAMPLES, batch_size=4)
    for _ in range(2):
        got = evaluate(model, tok, CACHE_EXAMPLES, batch_size=4, cache=cache)
        np.testing.assert_allclose(got.nll, ref.nll, atol=1e-5)
    assert len(cache) == 1 and cache.nbytes <= cache.max_bytes and cache.evictions == 0


def test_write_predictions_replaces_rounds_a_resumed_run_repeats(tmp_path: Path) -> None:
    from fedlora.federation.scoring import write_predictions
    from fedlora.llm.evaluation import EvalResult

    def result(pred: int) -> EvalResult:
        return EvalResult(
            "arc-e", 1.0, 1, (0.2, 1.0), 0.0, ids=["q"], predictions=[pred], correct=[True],
            nll=[0.5],
        )  # fmt: skip

    for r in (0, 4, 8):
        write_predictions(tmp_path, r, {"arc-e": result(r)})
    with open(tmp_path / "predictions.jsonl", "a") as f:
        f.write('{"round": 12, "task": "ar')  # torn by a kill
    write_predictions(tmp_path, 8, {"arc-e": result(99)})  # resumed after round 4
    lines = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [(x["round"], x["pred"]) for x in lines] == [(0, [0]), (4, [4]), (8, [99])]
