"""lm-evaluation-harness's zero-shot requests rebuilt from LLM-Adapters records; acc, acc_norm
and mc_loss by hand."""

from __future__ import annotations

import math
import os
import re

import pytest

from fedlora.errors import DataError
from fedlora.llm.harness import (
    HarnessRequest,
    acc_norm_pred,
    acc_pred,
    harness_request,
    harness_task,
    harness_training_text,
    hellaswag_preprocess,
    mc_loss,
)
from fedlora.llm.tasks import Example, convert_hub_record, load_task, records_to_examples

ARC = {
    "instruction": "Please choose the correct answer to the question: Which gas do plants take "
    "in?\n\nAnswer1: oxygen Answer2: carbon dioxide Answer3: helium\n\n"
    "Answer format: answer1/answer2/answer3",
    "input": "",
    "output": "the correct answer is answer2",
    "answer": "answer2",
}


def _ex(task: str, rec: dict) -> Example:
    return records_to_examples([rec], "mem", task)[0]


def test_arc_is_question_answer_with_space_delimited_options() -> None:
    req = harness_request(_ex("arc-e", ARC))
    assert req.task == "arc_easy"
    assert req.context == "Question: Which gas do plants take in?\nAnswer:"
    assert req.continuations == (" oxygen", " carbon dioxide", " helium")
    assert req.choices == ("oxygen", "carbon dioxide", "helium")
    assert req.gold == 1 and req.shared_context
    assert harness_request(_ex("arc-c", ARC)).task == "arc_challenge"
    assert harness_task("ARC-Easy") == "arc-e"  # an LLM-Adapters folder name works too


def test_obqa_is_the_bare_question_stem() -> None:
    rec = {
        **ARC,
        "instruction": "Please choose the correct answer to the question: The sun is "
        "responsible for\n\nAnswer1: puppies Answer2: plants sprouting Answer3: x Answer4: y"
        "\n\nAnswer format: answer1/answer2/answer3/answer4",
    }
    req = harness_request(_ex("obqa", rec))
    assert (req.task, req.context) == ("openbookqa", "The sun is responsible for")
    assert req.continuations[1] == " plants sprouting"


def test_siqa_is_q_a() -> None:
    rec = {
        **ARC,
        "instruction": "Please choose the correct answer to the question: Tracy resisted "
        "Riley. What does Tracy need to do before this?\n\nAnswer1: make a plan Answer2: go "
        "home Answer3: find a place\n\nAnswer format: answer1/answer2/answer3",
        "answer": "answer3",
    }
    req = harness_request(_ex("siqa", rec))
    assert req.task == "social_iqa"
    assert req.context == "Q: Tracy resisted Riley. What does Tracy need to do before this?\nA:"
    assert req.continuations == (" make a plan", " go home", " find a place")
    assert req.gold == 2


def test_boolq_scores_no_yes_and_keeps_one_question_mark() -> None:
    rec = {
        "instruction": "Please answer the following question with true or false, question: "
        "is house tax and property tax are same?\n\nAnswer format: true/false",
        "input": "",
        "output": "the correct answer is true",
        "answer": "true",
    }
    req = harness_request(_ex("boolq", rec))
    assert req.context == "Question: is house tax and property tax are same?\nAnswer:"
    assert req.continuations == (" no", " yes") and req.gold == 1
    assert harness_request(_ex("boolq", {**rec, "answer": "false"})).gold == 0


# hub records: the fields lm-eval's YAMLs read, so its strings can be written down directly
PIQA = {"goal": "Open a jar", "sol1": "Twist the lid", "sol2": "Eat the lid", "label": 0}
WINO = {
    "sentence": "Sarah was a better surgeon than Maria so _ always got the harder cases.",
    "option1": "Sarah",
    "option2": "Maria",
    "answer": "1",
}
HELLA = {
    "activity_label": "Removing ice from car",
    "ctx_a": "Then, the man writes over the snow covering the window of a car.",
    "ctx_b": "then",
    "ctx": "Then, the man writes over the snow covering the window of a car. then",
    "endings": [", the man adds wax.", "Scrape it [title] Done  [step] now. ", "x", "y"],
    "label": "1",
}


def test_piqa_from_a_hub_record_matches_lm_evals_template() -> None:
    req = harness_request(convert_hub_record("piqa", PIQA))
    assert req.context == f"Question: {PIQA['goal']}\nAnswer:"
    assert req.continuations == (" Twist the lid", " Eat the lid") and req.gold == 0


def test_winogrande_is_partial_scoring() -> None:
    req = harness_request(convert_hub_record("winogrande", WINO))
    s = WINO["sentence"]
    i = s.index("_")
    assert req.contexts == (s[:i] + "Sarah", s[:i] + "Maria")
    assert req.continuations == (" " + s[i + 1 :].strip(),) * 2
    assert req.choices == req.contexts  # lm-eval's doc_to_choice: the filled-in contexts
    assert req.gold == 0 and not req.shared_context
    with pytest.raises(ValueError, match="different contexts"):
        _ = req.context
    assert req.pairs[1] == (s[:i] + "Maria", " always got the harder cases.")
    assert harness_training_text(convert_hub_record("winogrande", WINO)) == req.pairs[0]


def test_hellaswag_uses_lm_evals_preprocessing() -> None:
    req = harness_request(convert_hub_record("hellaswag", HELLA))
    ctx = HELLA["ctx_a"] + " " + HELLA["ctx_b"].capitalize()
    assert req.context == hellaswag_preprocess(HELLA["activity_label"] + ": " + ctx)
    assert req.context == (
        "Removing ice from car: Then, the man writes over the snow covering the window of a "
        "car. Then"
    )
    # " [title]" -> ". ", brackets dropped, then ONE pass of "  " -> " " (3 spaces leave 2)
    assert req.choices[:2] == (", the man adds wax.", "Scrape it. Done  now.")
    assert req.continuations[1] == " Scrape it. Done  now." and req.gold == 1


def test_malformed_records_name_the_problem() -> None:
    with pytest.raises(DataError, match="lead-in"):
        harness_request(_ex("arc-e", {**ARC, "instruction": "Pick:" + ARC["instruction"][50:]}))
    bad = convert_hub_record("winogrande", {**WINO, "sentence": "no blank here"})
    with pytest.raises(DataError, match="no '_' blank"):
        harness_request(bad)
    with pytest.raises(DataError, match="evaluation.format = 'llm-adapters'"):
        harness_request(_ex("mytask", ARC))
    with pytest.raises(DataError, match="gold = 3"):
        HarnessRequest("t", ("c",) * 2, (" a", " b"), ("a", "b"), 3)


@pytest.mark.skipif(not os.environ.get("FEDLORA_DATA"), reason="needs $FEDLORA_DATA")
@pytest.mark.parametrize("task", ["arc-e", "arc-c", "obqa", "siqa", "boolq"])
def test_every_local_record_parses(task: str) -> None:
    for ex in load_task(task, os.environ["FEDLORA_DATA"], "test"):
        req = harness_request(ex)
        assert "Answer format" not in req.context and "\n\n" not in req.context
        assert not re.search(r"Answer\d:", req.context)
        assert all(c.startswith(" ") and c.strip() for c in req.continuations)


# ----------------------------------------------------------------------------- metrics


def test_acc_and_acc_norm_by_hand() -> None:
    # acc: the largest summed loglik; ties go to the first option (np.argmax)
    assert acc_pred([-3.0, -1.1, -2.0]) == 1
    assert acc_pred([-1.0, -1.0]) == 0
    # acc_norm divides by the CHOICE's length, without the delimiter: "a" (1), "abc" (3):
    # -1.1 / 1 = -1.1 < -3.0 / 3 = -1.0, so option 1 wins (with " a", " abc" option 0 would)
    assert acc_pred([-1.1, -3.0]) == 0
    assert acc_norm_pred([-1.1, -3.0], ["a", "abc"]) == 1
    with pytest.raises(DataError, match="non-empty choice"):
        acc_norm_pred([-1.0, -2.0], ["a", ""])


def test_mc_loss_by_hand_on_three_options() -> None:
    # -log(e^-1 / (e^-1 + e^-2 + e^-3)) = ln(1 + e^-1 + e^-2)
    assert mc_loss([-1.0, -2.0, -3.0], 0) == pytest.approx(0.40760596444, abs=1e-10)
    assert mc_loss([-1.0, -2.0, -3.0], 2) == pytest.approx(2.40760596444, abs=1e-10)
    assert mc_loss([-7.0, -7.0, -7.0], 1) == pytest.approx(math.log(3))  # chance
    # only the differences between options matter, not how likely the text is
    assert mc_loss([-101.0, -102.0, -103.0], 0) == pytest.approx(mc_loss([-1, -2, -3], 0))
