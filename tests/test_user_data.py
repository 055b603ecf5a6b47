"""Your own multiple-choice data (JSON, JSONL, CSV through the [data.mc] field map): the
examples and lm-eval requests it becomes, the errors naming file, line and field, and a tiny
run that trains and evaluates on the committed CSV fixture from the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.config import McConfig, load_config
from fedlora.errors import ConfigError, DataError
from fedlora.llm.harness import harness_request
from fedlora.llm.prompts import format_prompt
from fedlora.llm.user_tasks import load_mc_files

OWN = Path(__file__).resolve().parent / "fixtures" / "own"
COLUMNS = McConfig(choices=("A", "B", "C", "D"), answer_type="label")


def _write(path: Path, records: list, kind: str) -> str:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records, indent=1))
    return str(path)


def test_csv_columns_with_a_label_answer_become_arc_style_questions() -> None:
    exs = load_mc_files([str(OWN / "quiz_test.csv")], replace(COLUMNS, task="quiz"))
    assert len(exs) == 4 and {e.task for e in exs} == {"quiz"}
    ex = exs[1]  # Which season is the coldest?, answer D
    assert ex.labels == ("answer1", "answer2", "answer3", "answer4") and ex.answer == "answer4"
    assert ex.instruction.startswith("Please choose the correct answer to the question: Which")
    req = harness_request(ex)
    assert req.task == "quiz" and req.gold == 3
    assert req.context == "Question: Which season is the coldest?\nAnswer:"
    assert req.continuations == (" summer", " spring", " autumn", " winter")


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_a_list_field_with_index_or_text_answers_and_a_context(tmp_path: Path, kind: str) -> None:
    recs = [
        {"q": "Who wrote it?", "opts": ["Ann", "Bob"], "gold": 1, "passage": "Bob wrote it."},
        {"q": "Which is red?", "opts": ["grass", "a cherry", "sky"], "gold": 1, "passage": "x"},
    ]
    path = _write(tmp_path / f"own.{kind}", recs, kind)
    fm = McConfig(task="own", question="q", choices=("opts",), answer="gold", context="passage")
    a, b = load_mc_files([path], fm)
    assert (a.answer, b.labels) == ("answer2", ("answer1", "answer2", "answer3"))
    assert harness_request(a).context == "Bob wrote it.\nQuestion: Who wrote it?\nAnswer:"
    assert "### Input:\nBob wrote it." in format_prompt(a)  # the LLM-Adapters format
    recs[0]["gold"], recs[1]["gold"] = "Bob", "a cherry"
    path = _write(tmp_path / f"own.{kind}", recs, kind)
    text = load_mc_files([path], replace(fm, answer_type="text"))
    assert text == [a, b]


BAD = [
    ({"question": "q", "choices": ["a", "b"]}, r"line 2: field 'answer' is missing"),
    ({"question": "q", "choices": ["a", "b"], "answer": 2}, r"line 2: field 'answer' = 2 is not"),
    (
        {"question": "q", "choices": [], "answer": 0},
        r"line 2: field 'choices' needs >= 2 choices, got 0",
    ),
    ({"question": "q", "choices": ["a", ""], "answer": 0}, r"line 2: choice 'choices\[1\]' is"),
    ({"choices": ["a", "b"], "answer": 0}, r"line 2: field 'question' is missing"),
    ({"question": "q Answer2: x", "choices": ["a", "b"], "answer": 0}, r"line 2: field 'q"),
]


@pytest.mark.parametrize(("record", "message"), BAD)
def test_a_bad_record_names_file_line_and_field(tmp_path: Path, record, message) -> None:
    good = {"question": "ok?", "choices": ["yes", "no"], "answer": 0}
    path = _write(tmp_path / "bad.jsonl", [good, record], "jsonl")
    with pytest.raises(DataError, match=rf"bad\.jsonl: {message}"):
        load_mc_files([path], McConfig(task="own"))


def test_json_and_csv_lines_are_where_the_record_starts(tmp_path: Path) -> None:
    good = {"question": "ok?", "choices": ["yes", "no"], "answer": 0}
    path = _write(tmp_path / "bad.json", [good, {**good, "answer": 5}], "json")
    with pytest.raises(DataError, match=r"bad\.json: line 10: field 'answer' = 5"):
        load_mc_files([path], McConfig(task="own"))
    csv = tmp_path / "bad.csv"
    csv.write_text('question,A,B,answer\n"two\nlines",x,y,A\nq,x,y,C\n')
    with pytest.raises(DataError, match=r"bad\.csv: line 4: field 'answer' = 'C' is not one"):
        load_mc_files([str(csv)], McConfig(choices=("A", "B"), answer_type="label", task="own"))
    with pytest.raises(DataError, match=r"unknown file type '\.txt'"):
        load_mc_files([str(tmp_path / "x.txt")], McConfig(task="own"))


def test_config_checks_the_field_map() -> None:
    with pytest.raises(ConfigError, match=r"data.mc.answer_type = 'letter' is invalid"):
        load_config(None, ['data.mc.answer_type="letter"'])
    with pytest.raises(ConfigError, match=r"data.mc.choices = \['A', 'A'\] is invalid"):
        load_config(None, ['data.mc.choices=["A", "A"]'])
    with pytest.raises(DataError, match=r"data.mc.task = 'arc-e' is a built-in task"):
        load_mc_files([str(OWN / "quiz_test.csv")], replace(COLUMNS, task="arc-e"))


RUN = [
    "model.name=tiny-llama",
    "model.threads=1",
    "data.tasks=[]",
    "data.eval_tasks=[]",
    f'data.mc.files=["{OWN / "quiz_train.csv"}"]',
    f'data.mc.eval_files=["{OWN / "quiz_test.csv"}"]',
    'data.mc.choices=["A", "B", "C", "D"]',
    'data.mc.answer_type="label"',
    "data.n_clients=2",
    "data.min_client_examples=2",
    "lora.rank=2",
    "lora.layers=1",
    "training.rounds=1",
    "training.local_steps=1",
    "training.batch_size=2",
    "method.q=full",
    "method.k=full",
    "output.progress=false",
]


def test_a_run_on_a_users_csv_trains_and_evaluates_it(tmp_path: Path, capsys) -> None:
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), *RUN]) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["eval_n"] == {"mine": 4} and last["eval_format"] == "harness"
    bad = tmp_path / "bad.csv"
    bad.write_text((OWN / "quiz_test.csv").read_text().replace(",B\n", ",E\n", 1))
    argv = ["run", "--quiet", "--out", str(tmp_path / "run2"), *RUN]
    capsys.readouterr()
    assert main([*argv, f'data.mc.eval_files=["{bad}"]']) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bad.csv: line 4: field 'answer' = 'E'" in err


def test_partition_by_a_column_per_value_or_dirichlet(tmp_path: Path) -> None:
    from fedlora.llm.data import stream_rng
    from fedlora.llm.partition import dirichlet_partition, partition_keys, per_value_partition

    csv = tmp_path / "q.csv"
    rows = [f"q{i}?,x,y,{'AB'[i % 2]},{['ann', 'bob', 'cy'][i % 3]}" for i in range(9)]
    csv.write_text("question,A,B,answer,user\n" + "\n".join(rows) + "\n")
    fm = McConfig(choices=("A", "B"), answer_type="label", task="own")
    exs = load_mc_files([str(csv)], fm)
    keys = partition_keys(exs, "user")
    assert keys == ["ann", "bob", "cy"] * 3
    assert partition_keys(exs, "label")[:2] == ["answer1", "answer2"]
    clients = per_value_partition(keys, 3)
    assert [c.tolist() for c in clients] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    with pytest.raises(DataError, match=r"3 values \(ann, bob, cy\), so data.n_clients must be 3"):
        per_value_partition(keys, 2)
    parts = dirichlet_partition(keys, 2, 0.5, 1, stream_rng(0, "partition"))
    assert sorted(np.concatenate(parts).tolist()) == list(range(9))
    with pytest.raises(DataError, match=r"partition_key = 'team': training example 0 .* has no"):
        partition_keys(exs, "team")


def test_a_run_per_user_gives_each_user_one_client(tmp_path: Path) -> None:
    from fedlora.llm.data import build_federated_data
    from fedlora.llm.tiny_models import build_tiny_tokenizer

    cfg = load_config(
        None,
        [
            *RUN,
            'data.partition_key="answer"',
            'data.partition_mode="per_value"',
            "data.n_clients=3",
        ],
    )
    fed = build_federated_data(cfg.data, build_tiny_tokenizer(), seed=0, fmt="harness")
    answers = [dict(e.fields)["answer"] for e in fed.examples]
    assert [sorted({answers[i] for i in c}) for c in fed.client_indices] == [
        ["A"],
        ["B"],
        ["C"],
    ]


def test_hub_datasets_use_the_same_field_map_and_say_offline_in_one_line(
    tmp_path: Path, monkeypatch
) -> None:
    import sys
    import types

    calls = []

    def load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return [{"question": "Which is wet?", "choices": ["sand", "water"], "answer": 1}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    (ex,) = load_mc_files(["hf:me/quiz:easy@train"], McConfig(task="own"))
    assert calls == [("me/quiz", "easy", "train")] and ex.answer == "answer2"
    with pytest.raises(DataError, match=r"hf:me/quiz@test: record 0: field 'answer' = 1"):
        load_mc_files(["hf:me/quiz@test"], McConfig(answer_type="label", task="own"))
    with pytest.raises(DataError, match=r"hf:owner/name\[:config\]@split"):
        load_mc_files(["hf:quiz"], McConfig(task="own"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"online only and HF_HUB_OFFLINE=1 is set") as e:
        load_mc_files(["hf:me/quiz@train"], McConfig(task="own"))
    assert "\n" not in str(e.value) and len(calls) == 2
