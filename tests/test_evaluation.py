"""Multiple-choice evaluation: batched scores equal a one-at-a-time reference, forced models,
ties, option parsing and the Wilson interval."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlora.errors import DataError
from fedlora.llm.eval_stats import wilson_interval
from fedlora.llm.evaluation import candidate_logprobs, evaluate
from fedlora.llm.models import load_model
from fedlora.llm.prompts import encode_continuation, encode_prompt, format_prompt, parse_options
from fedlora.llm.tasks import RESPONSE_PREFIX, Example


def mc(q: str, options: list[str], answer: int, task: str = "t") -> Example:
    labels = tuple(f"answer{i + 1}" for i in range(len(options)))
    opts = " ".join(f"Answer{i + 1}: {o}" for i, o in enumerate(options))
    instruction = (
        f"Please choose the correct answer to the question: {q}\n\n{opts}\n\n"
        f"Answer format: {'/'.join(labels)}"
    )
    return Example(task, instruction, RESPONSE_PREFIX + labels[answer], labels[answer], labels)


EXAMPLES = [
    mc("Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], 1),
    mc("What is frozen water called?", ["ice", "steam", "fog"], 0),
    mc(
        "A long question about the sun, the moon and the stars in the sky at night and the "
        "way they move across it over the seasons of one year?",
        ["the earth turns", "the stars move on their own", "clouds", "wind", "nothing"],
        0,
    ),
    mc("Which is a mammal?", ["shark", "whale", "trout", "eel"], 1),
    Example(
        "boolq",
        "Please answer the following question with true or false, question: is ice cold?"
        "\n\nAnswer format: true/false",
        "the correct answer is true",
        "true",
        ("true", "false"),
    ),
]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def model_tok(request: pytest.FixtureRequest):
    return load_model(request.param, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def llama() -> tuple:
    return load_model("tiny-llama", dtype="fp32", progress=False)


def reference_logprobs(model, tok, ex: Example, scoring: str) -> np.ndarray:
    """One unpadded forward per candidate, full logits."""
    prompt = encode_prompt(tok, format_prompt(ex))
    texts = ex.labels if scoring == "label" else parse_options(ex)
    out = []
    for text in texts:
        cont, n = encode_continuation(tok, RESPONSE_PREFIX, text)
        ids = prompt + cont
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        out.append(sum(float(logp[p - 1, ids[p]]) for p in range(len(ids) - n, len(ids))))
    return np.array(out)


@pytest.mark.parametrize("scoring", ["label", "option"])
def test_batched_scores_equal_one_at_a_time_reference(model_tok, scoring: str) -> None:
    model, tok = model_tok
    ref = [reference_logprobs(model, tok, ex, scoring) for ex in EXAMPLES]
    for batch_size, share in ((1, True), (16, True), (2, False)):
        got = candidate_logprobs(
            model, tok, EXAMPLES, batch_size=batch_size, scoring=scoring, share_prompt=share
        )
        assert [len(g) for g in got] == [len(ex.labels) for ex in EXAMPLES]
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, atol=1e-4, rtol=0)
    result = evaluate(model, tok, EXAMPLES, batch_size=2, scoring=scoring)
    expected = np.mean([ex.labels[int(np.argmax(r))] == ex.answer for ex, r in zip(EXAMPLES, ref)])
    assert result.accuracy == pytest.approx(expected)
    assert result.n == 5 and result.task == "t"


def test_bf16_model_scores_close_to_its_own_reference() -> None:
    model, tok = load_model("tiny-llama", dtype="bf16", progress=False)
    assert next(model.parameters()).dtype == torch.bfloat16
    got = candidate_logprobs(model, tok, EXAMPLES[:3], batch_size=3)
    full = candidate_logprobs(model, tok, EXAMPLES[:3], batch_size=3, share_prompt=False)
    for g, f, ex in zip(got, full, EXAMPLES[:3]):
        np.testing.assert_allclose(g, f, atol=1e-2)
        # bf16 activations: padding may change reduction order; measured here: 5e-7
        np.testing.assert_allclose(g, reference_logprobs(model, tok, ex, "label"), atol=1e-2)


def test_slot_lora_model_scores_equal_reference() -> None:
    """The engine evaluates the global adapter through fedlora.llm.lora's slot hooks."""
    from fedlora.config import LoraConfig
    from fedlora.llm.lora import inject_lora

    model, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    lora = inject_lora(model, LoraConfig(rank=4, layers="all"), slots=2, seed=0)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) * 0.5 for k, v in lora.global_state().items()}
    lora.load_global(state)
    lora.set_clients(torch.ones(1, 4))
    shared = candidate_logprobs(model, tok, EXAMPLES, batch_size=3)
    full = candidate_logprobs(model, tok, EXAMPLES, batch_size=3, share_prompt=False)
    for s, f, ex in zip(shared, full, EXAMPLES):
        ref = reference_logprobs(model, tok, ex, "label")
        np.testing.assert_allclose(s, ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(f, ref, atol=1e-4, rtol=0)


def _bias_tokens(model, token_ids: list[int], amount: float):
    """Add `amount` to some vocabulary entries' logits everywhere (a hook on the LM head)."""

    def hook(_module, _inputs, output):
        output = output.clone()
        output[..., sorted(set(token_ids))] += amount
        return output

    return model.get_output_embeddings().register_forward_hook(hook)


def test_model_forced_to_prefer_a_label_gets_accuracy_one(llama) -> None:
    model, tok = llama
    ids, n = encode_continuation(tok, RESPONSE_PREFIX, "answer2")
    assert n >= 1
    all_answer2 = [mc(f"q{i}", ["a", "b", "c"], 1) for i in range(6)]
    all_answer1 = [mc(f"q{i}", ["a", "b", "c"], 0) for i in range(6)]
    handle = _bias_tokens(model, [ids[-1]], 100.0)  # the token that tells "answer2" apart
    try:
        right = evaluate(model, tok, all_answer2, batch_size=4)
        wrong = evaluate(model, tok, all_answer1, batch_size=4)
    finally:
        handle.remove()
    assert (right.accuracy, right.n) == (1.0, 6)
    assert wrong.accuracy == 0.0
    assert right.ci95 == pytest.approx(wilson_interval(6, 6))


def test_option_scoring_follows_the_option_text(llama) -> None:
    model, tok = llama
    exs = [mc("q", ["red apple", "zebra", "blue"], 1), mc("p", ["zebra", "cat", "dog"], 0)]
    ids, n = encode_continuation(tok, RESPONSE_PREFIX, "zebra")
    handle = _bias_tokens(model, ids[-n:], 100.0)  # the tokens of " zebra"
    try:
        assert evaluate(model, tok, exs, scoring="option").accuracy == 1.0
    finally:
        handle.remove()


def test_ties_go_to_the_first_label(llama) -> None:
    model, tok = llama

    def flat(_module, _inputs, output):
        return torch.zeros_like(output)  # every token equally likely: all candidates tie

    exs = [mc("q", ["a", "b", "c", "d"], 0), mc("r", ["a", "b", "c", "d"], 2)]
    handle = model.get_output_embeddings().register_forward_hook(flat)
    try:
        scores = candidate_logprobs(model, tok, exs)
        result = evaluate(model, tok, exs)
    finally:
        handle.remove()
    assert np.ptp(scores[0]) == 0.0
    assert result.accuracy == 0.5  # answer1 predicted for both


def test_evaluate_restores_training_mode_and_needs_no_grad(llama) -> None:
    model, tok = llama
    model.train()
    try:
        evaluate(model, tok, EXAMPLES[:2])
        assert model.training
    finally:
        model.eval()
    evaluate(model, tok, EXAMPLES[:2])
    assert not model.training


def test_evaluate_bad_input(llama) -> None:
    model, tok = llama
    with pytest.raises(
        DataError, match=r"scoring = 'text' is invalid: allowed: label, option, option_norm"
    ):
        evaluate(model, tok, EXAMPLES, scoring="text")
    with pytest.raises(DataError, match=r"batch_size = 0 is invalid: must be an integer >= 1"):
        evaluate(model, tok, EXAMPLES, batch_size=0)
    with pytest.raises(DataError, match=r"task 'arc-e': no examples to evaluate"):
        evaluate(model, tok, [], task="arc-e")


# ----------------------------------------------------------------------------- options


def test_parse_options_llm_adapters_formats() -> None:
    assert parse_options(EXAMPLES[0]) == ("oxygen", "carbon dioxide", "helium", "neon")
    assert parse_options(EXAMPLES[4]) == ("true", "false")  # no markers: the labels themselves
    piqa = Example(
        "piqa",
        "Please choose the correct solution to the question: g\n\nSolution1: use a cup."
        "\n\nSolution2: use a fork.\n\nAnswer format: solution1/solution2",
        "the correct answer is solution1",
        "solution1",
        ("solution1", "solution2"),
    )
    assert parse_options(piqa) == ("use a cup.", "use a fork.")
    wino = Example(
        "winogrande",
        "Please choose the correct answer to fill in the blank to complete the given sentence: "
        "A _ B.\n\nOption1: Tom Option2: Ann Answer format: option1/option2",
        "the correct answer is option2",
        "option2",
        ("option1", "option2"),
    )
    assert parse_options(wino) == ("Tom", "Ann")
    broken = Example(
        "t",
        "Q\n\nAnswer1: x\n\nAnswer format: answer1/answer2",
        "o",
        "answer1",
        ("answer1", "answer2"),
    )
    with pytest.raises(DataError, match=r"no 'answer2:' marker"):
        parse_options(broken)


# ----------------------------------------------------------------------------- interval


def test_wilson_interval_hand_computed() -> None:
    # 8/10: p = 0.8, z² = 3.8415; centre = (0.8 + 0.19207)/1.38415, half = 1.96·0.16001/1.38415
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.49016, abs=1e-4)
    assert hi == pytest.approx(0.94332, abs=1e-4)
    lo0, hi0 = wilson_interval(0, 20)
    assert lo0 == 0.0 and hi0 == pytest.approx(3.8415 / (20 + 3.8415), abs=1e-4)
    lo, hi = wilson_interval(50, 100)
    assert (lo + hi) / 2 == pytest.approx(0.5) and hi - lo < 2 * 1.96 * math.sqrt(0.25 / 100)
    with pytest.raises(DataError, match=r"n = 0 is invalid"):
        wilson_interval(0, 0)
    with pytest.raises(DataError, match=r"correct = 11 is invalid: must be in 0..10"):
        wilson_interval(11, 10)
