"""Instruction data: Alpaca and chat records, the loss on the response tokens only, the
held-out response loss and perplexity, and a run that trains on them from the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import DataError
from fedlora.llm.data import build_federated_data
from fedlora.llm.instruct import (
    load_instructions,
    response_loss,
    set_chat_template,
    tokenize_instructions,
)
from fedlora.llm.models import load_model
from fedlora.llm.prompts import IGNORE_INDEX
from fedlora.llm.tiny_models import build_tiny_tokenizer

FIX = Path(__file__).resolve().parent / "fixtures"
INS = FIX / "instruct"
TEMPLATE = str(INS / "chat_template.jinja")


@pytest.fixture(scope="module")
def tok():
    t = build_tiny_tokenizer()
    set_chat_template(t, TEMPLATE)
    return t


def _response(tok, ids, labels) -> str:
    return tok.decode([int(i) for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])


def test_the_loss_is_on_the_response_tokens_only(tok) -> None:
    recs = load_instructions([str(INS / "train.jsonl")], "instruct")
    assert [r.chat for r in recs] == [False] * 6 + [True] * 3
    ts, kept = tokenize_instructions(recs, tok, 256)
    assert kept == list(range(9))
    responses = [_response(tok, i, lab) for i, lab in zip(ts.input_ids, ts.labels)]
    assert responses[0] == "Red.</s>" and responses[1] == "5</s>"
    # chat: the last assistant message and the template's end of turn; earlier turns masked
    assert responses[6] == "Hello! How can I help?</s>\n"
    assert responses[8] == "Pear.</s>\n"
    whole = tok.decode([int(i) for i in ts.input_ids[8]])
    assert whole.startswith("<s><|user|>\nA fruit?\n<|assistant|>\nApple.</s>\n<|user|>")
    assert "### Input:\n2 and 3" in tok.decode([int(i) for i in ts.input_ids[1]])
    short, kept = tokenize_instructions(recs, tok, 53)  # too long: dropped, never cut
    assert kept == [0, 4, 6] and [len(x) for x in short.input_ids] == [51, 52, 38]


def test_chat_records_without_a_template_and_bad_records_say_where(tmp_path: Path) -> None:
    bare = build_tiny_tokenizer()
    recs = load_instructions([str(INS / "train.jsonl")], "instruct")
    with pytest.raises(DataError, match=r"set data.chat_template"):
        tokenize_instructions(recs[6:], bare, 256)
    bad = [
        ({"instruction": "x"}, r"line 2: field 'output' must be a non-empty string"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            r"line 2: field 'messages\[1\]': the last message must be the assistant's",
        ),
        (
            {"messages": [{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}]},
            r"line 2: field 'messages\[0\]' must be an object with role",
        ),
        ({"prompt": "x"}, r"line 2: neither 'messages' nor 'instruction'/'output'"),
    ]
    good = {"instruction": "i", "output": "o"}
    for rec, message in bad:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(rec) + "\n")
        with pytest.raises(DataError, match=rf"bad\.jsonl: {message}"):
            load_instructions([str(path)], "instruct")


def test_response_loss_is_each_records_mean_response_nll_padding_or_not(tok) -> None:
    model, _ = load_model("tiny-llama", dtype="fp32")
    recs = load_instructions([str(INS / "held_out.jsonl")], "instruct")
    got = response_loss(model, tok, recs, max_len=256, batch_size=3)
    ts, _ = tokenize_instructions(recs, tok, 256)
    want = []
    with torch.no_grad():
        for ids, labels in zip(ts.input_ids, ts.labels):  # one record at a time, no padding
            logp = torch.log_softmax(model(torch.from_numpy(ids)[None]).logits[0, :-1].float(), -1)
            pos = [t for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX]
            want.append(-sum(float(logp[t - 1, ids[t]]) for t in pos) / len(pos))
    assert got.nll == pytest.approx(want, abs=1e-4)
    assert got.loss == pytest.approx(sum(want) / 3, abs=1e-4) and got.n == 3
    assert got.perplexity == pytest.approx(math.exp(got.loss))
    lo, hi = got.perplexity_ci95
    assert lo < got.perplexity < hi and math.log(hi) == pytest.approx(got.loss_ci95[1])
    assert got.loss > math.log(2)  # a random-init model: far from fitting the responses


def test_instruction_and_multiple_choice_data_train_together_one_client_per_user(tok) -> None:
    cfg = load_config(
        None,
        [*RUN, "data.n_clients=3", 'data.partition_key="user"', 'data.partition_mode="per_value"'],
    )
    fed = build_federated_data(cfg.data, build_tiny_tokenizer(), seed=0, fmt="harness")
    assert len(fed.train) == 9 and set(fed.instruct_eval) == {"instruct"}
    users = [dict(e.fields)["user"] for e in fed.examples]
    assert [sorted({users[i] for i in c}) for c in fed.client_indices] == [["ann"], ["bob"], ["cy"]]
    with pytest.raises(DataError, match=r"instruction records of task 'instruct' have no answer"):
        build_federated_data(
            load_config(None, [*RUN, 'data.partition_key="label"']).data,
            build_tiny_tokenizer(),
            seed=0,
            fmt="harness",
        )


RUN = [
    "model.name=tiny-llama",
    "model.threads=1",
    "data.tasks=[]",
    "data.eval_tasks=[]",
    f'data.instruct_files=["{INS / "train.jsonl"}"]',
    f'data.instruct_eval_files=["{INS / "held_out.jsonl"}"]',
    f'data.chat_template="{TEMPLATE}"',
    f'data.mc.eval_files=["{FIX / "own" / "quiz_test.csv"}"]',
    'data.mc.choices=["A", "B", "C", "D"]',
    'data.mc.answer_type="label"',
    "data.n_clients=2",
    "data.min_client_examples=2",
    "data.max_seq_len=96",
]


def test_a_run_on_instruction_records_from_the_cli(tmp_path: Path) -> None:
    argv = [
        "lora.rank=2",
        "lora.layers=1",
        "training.rounds=1",
        "training.local_steps=1",
        "training.batch_size=2",
        "method.q=full",
        "method.k=full",
        "output.progress=false",
    ]
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *RUN, *argv]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["eval_n"] for x in lines] == [{"mine": 4}] * 2  # before and after the round
    for line in lines:
        held = line["eval_response"]["instruct"]
        assert held["n"] == 3 and held["perplexity"] == pytest.approx(math.exp(held["loss"]))
        assert held["loss_ci95"][0] < held["loss"] < held["loss_ci95"][1]
    assert (
        lines[1]["eval_response"]["instruct"]["loss"]
        != lines[0]["eval_response"]["instruct"]["loss"]
    )


def test_one_client_per_user_field_needs_no_minimum_size(tmp_path: Path) -> None:
    """docs/data.md's command: one client per `user`, each holding fewer examples than the
    default data.min_client_examples (no minimum applies to one client per value)."""
    argv = [
        "data.partition_key=user",
        "data.partition_mode=per_value",
        "data.n_clients=3",
        "data.max_seq_len=96",
        "lora.layers=1",
        "method.q=full",
        "method.k=full",
        "training.rounds=1",
        "training.local_steps=1",
        "output.progress=false",
    ]
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *RUN, *argv]) == 0
    clients = (tmp_path / "run" / "clients.csv").read_text().splitlines()
    assert len(clients) == 1 + 3  # a header and one row per user
