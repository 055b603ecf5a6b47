"""Prompts, training responses, tokenization and padded batches."""

from __future__ import annotations

from data_cases import CharTok, chars
from fedlora.llm.prompts import (
    IGNORE_INDEX,
    collate,
    encode_continuation,
    format_prompt,
    tokenize_examples,
)
from fedlora.llm.tasks import Example

# ----------------------------------------------------------------------------- prompts


def test_format_prompt_llm_adapters_template() -> None:
    ex = Example("t", "Do X.", "the correct answer is true", "true", ("true", "false"))
    assert format_prompt(ex) == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nDo X.\n\n### Response:\n"
    )
    with_input = Example("t", "Do X.", "o", "true", ("true", "false"), input="ctx")
    assert format_prompt(with_input).endswith(
        "### Instruction:\nDo X.\n\n### Input:\nctx\n\n### Response:\n"
    )


def test_tokenize_masks_prompt_and_keeps_response_when_truncating() -> None:
    ex = Example("t", "Q", "the correct answer is true", "true", ("true", "false"))
    prompt = [1] + chars(format_prompt(ex))
    response = chars(ex.output) + [2]
    ts = tokenize_examples([ex], CharTok(), max_len=1000)
    assert ts.input_ids[0].tolist() == prompt + response
    assert ts.labels[0].tolist() == [IGNORE_INDEX] * len(prompt) + response
    assert ts.cut == 0
    # too long: the prompt loses tokens on its LEFT, keeps BOS; the response stays whole
    max_len = len(response) + 6
    ts = tokenize_examples([ex], CharTok(), max_len=max_len)
    assert ts.input_ids[0].tolist() == [1] + prompt[-5:] + response
    assert tokenize_examples([ex, ex], CharTok(), max_len=max_len).cut == 2  # counted
    assert ts.labels[0].tolist() == [IGNORE_INDEX] * 6 + response
    # the response alone too long: only its first max_len tokens, no prompt
    ts = tokenize_examples([ex], CharTok(), max_len=4)
    assert ts.input_ids[0].tolist() == response[:4] == ts.labels[0].tolist()


def test_encode_continuation_scores_only_the_label_tokens() -> None:
    ids, n = encode_continuation(CharTok(), "the correct answer is ", "answer2")
    assert ids == chars("the correct answer is answer2")
    assert n == len(" answer2")


def test_collate_right_pads_with_mask_and_ignored_labels() -> None:
    ex1 = Example("t", "A", "o1", "true", ("true", "false"))
    ex2 = Example("t", "Bbb", "o2", "true", ("true", "false"))
    ts = tokenize_examples([ex1, ex2], CharTok(), max_len=512)
    batch = collate(ts, [0, 1], pad_id=0)
    n1, n2 = len(ts.input_ids[0]), len(ts.input_ids[1])
    assert n2 == n1 + 2
    assert batch["input_ids"].shape == (2, n2)
    assert batch["input_ids"][0, n1:].tolist() == [0, 0]
    assert batch["attention_mask"].sum(dim=1).tolist() == [n1, n2]
    assert batch["labels"][0, n1:].tolist() == [IGNORE_INDEX] * 2
    assert batch["labels"][1].tolist() == ts.labels[1].tolist()
