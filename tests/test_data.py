"""Tasks, LLM-Adapters records, prompts, tokenization and the Dirichlet partition."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import DataConfig
from fedlora.errors import DataError
from fedlora.llm.data import (
    IGNORE_INDEX,
    Example,
    FederatedData,
    build_federated_data,
    client_batches,
    client_weights,
    collate,
    convert_hub_record,
    dirichlet_partition,
    encode_continuation,
    format_prompt,
    load_hub_task,
    load_task,
    load_task_file,
    parse_answer_format,
    records_to_examples,
    resolve_data_dir,
    tokenize_examples,
    training_mix,
)

DATA = os.environ.get("FEDLORA_DATA", "")
needs_data = pytest.mark.skipif(
    not DATA or not Path(DATA).is_dir(), reason="FEDLORA_DATA (shared commonsense data) absent"
)


class CharTok:
    """One token per character (id = ord + 3); BOS = 1 when special tokens are asked for."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) + 3 for c in text]}


def chars(text: str) -> list[int]:
    return [ord(c) + 3 for c in text]


def mc_record(q: str, options: list[str], answer: int) -> dict[str, str]:
    labels = [f"answer{i + 1}" for i in range(len(options))]
    opts = " ".join(f"Answer{i + 1}: {o}" for i, o in enumerate(options))
    return {
        "instruction": f"Please choose the correct answer to the question: {q}\n\n{opts}\n\n"
        f"Answer format: {'/'.join(labels)}",
        "input": "",
        "output": f"the correct answer is {labels[answer]}",
        "answer": labels[answer],
    }


def write_layout(root: Path, tasks: dict[str, dict[str, list[dict]]]) -> Path:
    """An LLM-Adapters directory: {folder: {split: records}}."""
    for folder, splits in tasks.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for split, records in splits.items():
            (root / folder / f"{split}.json").write_text(json.dumps(records))
    return root


def small_layout(root: Path) -> Path:
    arc = [mc_record(f"arc q{i}", ["a", "b", "c", "d"], i % 4) for i in range(30)]
    obqa = [mc_record(f"obqa q{i}", ["w", "x", "y", "z"], (i + 1) % 4) for i in range(20)]
    siqa = [mc_record(f"siqa q{i}", ["p", "q", "r"], i % 3) for i in range(9)]
    return write_layout(
        root,
        {
            "ARC-Easy": {"train": arc, "test": arc[:12]},
            "openbookqa": {"train": obqa, "test": obqa[:5]},
            "social_i_qa": {"test": siqa},
        },
    )


# ----------------------------------------------------------------------------- records


def test_labels_from_answer_format_line() -> None:
    ex = records_to_examples([mc_record("q", ["a", "b", "c"], 2)], "f.json", "t")[0]
    assert ex.labels == ("answer1", "answer2", "answer3")
    assert ex.answer == "answer3"
    assert ex.output == "the correct answer is answer3"
    assert parse_answer_format("x\n\nAnswer format: true/false") == ("true", "false")
    assert parse_answer_format("no format here") is None


def test_labels_from_file_answers_in_natural_order_when_no_format_line() -> None:
    recs = [
        {"instruction": f"pick {i}", "input": "", "output": "", "answer": a}
        for i, a in enumerate(["option10", "option2", "option1", "option2"])
    ]
    exs = records_to_examples(recs, "f.json", "t")
    assert all(e.labels == ("option1", "option2", "option10") for e in exs)
    # an empty output is rebuilt from the answer
    assert exs[0].output == "the correct answer is option10"


def test_answer_read_from_output_when_answer_missing_and_bool_answers() -> None:
    recs = [
        {"instruction": "q1", "output": "the correct answer is solution2"},
        {"instruction": "q2", "output": "the correct answer is solution1"},
    ]
    exs = records_to_examples(recs, "f.json", "piqa")
    assert [e.answer for e in exs] == ["solution2", "solution1"]
    assert exs[0].labels == ("solution1", "solution2")
    bools = records_to_examples(
        [{"instruction": "x", "answer": True}, {"instruction": "y", "answer": False}], "b", "t"
    )
    assert [e.answer for e in bools] == ["true", "false"]
    assert bools[0].labels == ("false", "true")


@pytest.mark.parametrize(
    ("records", "match"),
    [
        ({"instruction": "x"}, r"f\.json: expected a JSON list of records, got dict"),
        ([], r"f\.json: the file holds no records"),
        ([mc_record("q", ["a", "b"], 0), "text"], r"f\.json: record 1 is not an object"),
        ([mc_record("q", ["a", "b"], 0), {"answer": "a"}], r"record 1: 'instruction' must be"),
        ([{"instruction": "q", "output": "no idea"}], r"record 0: no answer"),
        ([{"instruction": "q", "answer": "x", "input": 3}], r"record 0: 'input' must be a str"),
        ([{"instruction": "q", "answer": "yes"}] * 2, r"record 0: cannot parse the label set"),
        (
            [{"instruction": "q\n\nAnswer format: answer1/answer2", "answer": "answer3"}],
            r"record 0: answer 'answer3' is not one of the labels \['answer1', 'answer2'\]",
        ),
    ],
)
def test_malformed_records_name_file_and_index(records: object, match: str) -> None:
    with pytest.raises(DataError, match=match):
        records_to_examples(records, "f.json", "t")


def test_load_task_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"task file '.*nope\.json' does not exist"):
        load_task_file(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(DataError, match=r"task file '.*bad\.json' is not valid JSON"):
        load_task_file(str(bad))


def test_load_task_file_task_name_defaults_to_folder(tmp_path: Path) -> None:
    (tmp_path / "mytask").mkdir()
    f = tmp_path / "mytask" / "test.json"
    f.write_text(json.dumps([mc_record("q", ["a", "b"], 1)]))
    assert load_task_file(str(f))[0].task == "mytask"
    assert load_task_file(str(f), task="x")[0].task == "x"


# ----------------------------------------------------------------------------- tasks


def test_load_task_from_layout_and_its_errors(tmp_path: Path) -> None:
    root = small_layout(tmp_path / "cs")
    exs = load_task("arc-e", str(root), "train")
    assert len(exs) == 30 and exs[0].task == "arc-e" and exs[5].answer == "answer2"
    with pytest.raises(DataError, match=r"task = 'arc' is invalid: allowed: arc-e, arc-c"):
        load_task("arc", str(root), "train")
    with pytest.raises(DataError, match=r"split = 'dev' is invalid: allowed: train, test"):
        load_task("arc-e", str(root), "dev")
    with pytest.raises(DataError, match=r"data directory '.*missing' does not exist"):
        load_task("arc-e", str(tmp_path / "missing"), "test")
    with pytest.raises(
        DataError,
        match=r"folder '.*ARC-Challenge' does not exist; '.*cs' holds: ARC-Easy, openbookqa, "
        r"social_i_qa",
    ):
        load_task("arc-c", str(root), "test")
    with pytest.raises(
        DataError, match=r"split file '.*social_i_qa/train\.json' does not exist; .* holds: test"
    ):
        load_task("siqa", str(root), "train")


def test_resolve_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDLORA_DATA", "/env/dir")
    assert resolve_data_dir("/given") == "/given"
    assert resolve_data_dir("") == "/env/dir"
    monkeypatch.delenv("FEDLORA_DATA")
    assert resolve_data_dir("") is None


@needs_data
def test_shared_data_tasks_load_with_their_label_sets() -> None:
    # counts from ../shared/data/README.md
    expected = {"arc-e": 2376, "arc-c": 1172, "obqa": 500, "siqa": 1954, "boolq": 3270}
    for task, n in expected.items():
        exs = load_task(task, DATA, "test")
        assert len(exs) == n
        assert all(e.answer in e.labels for e in exs)
    assert {len(e.labels) for e in load_task("arc-e", DATA, "test")} == {3, 4, 5}
    assert load_task("boolq", DATA, "test")[0].labels == ("true", "false")
    assert load_task("siqa", DATA, "test")[0].labels == ("answer1", "answer2", "answer3")


# ----------------------------------------------------------------------------- hub


def test_hub_records_convert_to_llm_adapters_instructions() -> None:
    arc = {
        "question": "Which statement best explains why photosynthesis is the foundation of most "
        "food webs?",
        "choices": {
            "text": [
                "Sunlight is the source of energy for nearly all ecosystems.",
                "Most ecosystems are found on land instead of in water.",
                "Carbon dioxide is more available than other gases.",
                "The producers in all ecosystems are plants.",
            ],
            "label": ["A", "B", "C", "D"],
        },
        "answerKey": "A",
    }
    ex = convert_hub_record("arc-e", arc)
    # the first record of ARC-Easy/test.json in the LLM-Adapters files, verbatim
    assert ex.instruction == (
        "Please choose the correct answer to the question: Which statement best explains why "
        "photosynthesis is the foundation of most food webs?\n\nAnswer1: Sunlight is the source "
        "of energy for nearly all ecosystems. Answer2: Most ecosystems are found on land instead "
        "of in water. Answer3: Carbon dioxide is more available than other gases. Answer4: The "
        "producers in all ecosystems are plants.\n\nAnswer format: answer1/answer2/answer3/answer4"
    )
    assert (ex.answer, ex.output) == ("answer1", "the correct answer is answer1")
    boolq = convert_hub_record(
        "boolq", {"question": "does ethanol take more energy make that produces", "answer": False}
    )
    assert boolq.instruction == (
        "Please answer the following question with true or false, question: does ethanol take "
        "more energy make that produces?\n\nAnswer format: true/false"
    )
    assert (boolq.answer, boolq.labels) == ("false", ("true", "false"))
    siqa = convert_hub_record(
        "siqa",
        {
            "context": "C.",
            "question": "Q?",
            "answerA": "x",
            "answerB": "y",
            "answerC": "z",
            "label": "3",
        },
    )
    assert siqa.answer == "answer3" and "Answer3: z\n\nAnswer format" in siqa.instruction
    obqa = convert_hub_record(
        "obqa",
        {
            "question_stem": "S",
            "choices": {"text": list("abcd"), "label": list("ABCD")},
            "answerKey": "D",
        },
    )
    assert obqa.answer == "answer4"
    piqa = convert_hub_record("piqa", {"goal": "g", "sol1": "s1", "sol2": "s2", "label": 1})
    assert (piqa.answer, piqa.labels) == ("solution2", ("solution1", "solution2"))
    wino = convert_hub_record(
        "winogrande", {"sentence": "s _", "option1": "a", "option2": "b", "answer": "1"}
    )
    assert (wino.answer, wino.labels) == ("option1", ("option1", "option2"))
    hs = convert_hub_record("hellaswag", {"ctx": "c", "endings": list("abcd"), "label": "2"})
    assert hs.answer == "ending3" and hs.labels[-1] == "ending4"
    with pytest.raises(DataError, match=r"answer key 'E' is not one of the choice labels"):
        convert_hub_record("arc-c", {**arc, "answerKey": "E"})


def test_hub_without_datasets_package_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(DataError, match=r"needs the 'datasets' package: pip install datasets"):
        load_hub_task("arc-e", "test")
    with pytest.raises(DataError, match=r"--data-dir"):
        load_task("obqa", None, "test")


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
    # too long: the prompt loses tokens on its LEFT, keeps BOS; the response stays whole
    max_len = len(response) + 6
    ts = tokenize_examples([ex], CharTok(), max_len=max_len)
    assert ts.input_ids[0].tolist() == [1] + prompt[-5:] + response
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


# ----------------------------------------------------------------------------- partition


def test_dirichlet_partition_covers_every_index_once_and_respects_min_size() -> None:
    keys = ["a"] * 300 + ["b"] * 200 + ["c"] * 100
    parts = dirichlet_partition(keys, 20, 0.1, 8, np.random.default_rng(0))
    assert len(parts) == 20
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(600))
    assert min(len(p) for p in parts) >= 8
    a = client_weights(parts)
    assert a.sum() == pytest.approx(1.0)
    assert a[3] == pytest.approx(len(parts[3]) / 600)
    again = dirichlet_partition(keys, 20, 0.1, 8, np.random.default_rng(0))
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))


def test_dirichlet_alpha_controls_heterogeneity() -> None:
    keys = np.repeat(["a", "b", "c", "d"], 500).tolist()
    arr = np.asarray(keys)

    def dominant_share(alpha: float) -> float:
        parts = dirichlet_partition(keys, 10, alpha, 1, np.random.default_rng(1))
        shares = [np.unique(arr[p], return_counts=True)[1].max() / len(p) for p in parts]
        return float(np.mean(shares))

    assert dominant_share(0.05) > 0.9  # almost every client sees one key
    assert dominant_share(1000.0) < 0.3  # every client sees all four keys about equally (0.25)


def test_dirichlet_partition_bad_input() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(DataError, match=r"n_clients = 5 with min_size = 3 needs >= 15 examples"):
        dirichlet_partition(["a"] * 14, 5, 0.5, 3, rng)
    with pytest.raises(DataError, match=r"alpha = 0.0 is invalid: must be > 0"):
        dirichlet_partition(["a"] * 14, 2, 0.0, 1, rng)
    with pytest.raises(DataError, match=r"n_clients = 0 is invalid"):
        dirichlet_partition(["a"] * 14, 0, 0.5, 1, rng)


# ----------------------------------------------------------------------------- mixes


def test_training_mix_uses_present_tasks_limits_and_task_files(tmp_path: Path) -> None:
    root = small_layout(tmp_path / "cs")
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps([mc_record(f"e{i}", ["a", "b"], i % 2) for i in range(7)]))
    cfg = DataConfig(
        data_dir=str(root), tasks=("arc-e", "arc-c", "siqa", "obqa"), task_files=(str(extra),)
    )
    mix = training_mix(cfg, seed=0)  # arc-c absent, siqa has no train split: both skipped
    assert [sum(e.task == t for e in mix) for t in ("arc-e", "obqa")] == [30, 20]
    assert len(mix) == 57
    cfg5 = DataConfig(data_dir=str(root), tasks=("arc-e", "obqa"), train_limit=5)
    a, b = training_mix(cfg5, seed=3), training_mix(cfg5, seed=3)
    assert len(a) == 10 and a == b
    assert a != training_mix(cfg5, seed=4)
    with pytest.raises(DataError, match=r"none has a train split"):
        training_mix(DataConfig(data_dir=str(root), tasks=("siqa",)), seed=0)


def test_build_federated_data_and_client_batches(tmp_path: Path) -> None:
    root = small_layout(tmp_path / "cs")
    cfg = DataConfig(
        data_dir=str(root),
        tasks=("arc-e", "obqa"),
        eval_tasks=("arc-e", "siqa"),
        eval_limit=4,
        n_clients=5,
        min_client_examples=6,
        max_seq_len=64,
    )
    fed = build_federated_data(cfg, CharTok(), seed=0)
    assert isinstance(fed, FederatedData)
    assert len(fed.train) == len(fed.examples) == 50
    assert sorted(np.concatenate(fed.client_indices).tolist()) == list(range(50))
    assert fed.a.sum() == pytest.approx(1.0)
    assert {k: len(v) for k, v in fed.eval_sets.items()} == {"arc-e": 4, "siqa": 4}
    assert all(len(ids) <= 64 for ids in fed.train.input_ids)

    small = int(np.argmin([len(c) for c in fed.client_indices]))
    own = fed.client_indices[small]
    b = 3 if len(own) % 3 == 0 else 2
    steps = len(own) // b
    batches = client_batches(fed, small, steps, b, np.random.default_rng(0), pad_id=0)
    assert len(batches) == steps
    seen = []
    for batch in batches:
        assert batch["input_ids"].shape[0] == b
        for row, m in zip(batch["input_ids"], batch["attention_mask"]):
            seen.append(tuple(row[m.bool()].tolist()))
    # one epoch: every example of the client exactly once
    assert sorted(seen) == sorted(tuple(fed.train.input_ids[i].tolist()) for i in own)
    with pytest.raises(DataError, match=r"client = 5 is invalid: must be in 0..4"):
        client_batches(fed, 5, 1, 1, np.random.default_rng(0), pad_id=0)
