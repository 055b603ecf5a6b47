"""The commonsense tasks: LLM-Adapters records, files, directories and hub records."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from data_cases import DATA, mc_record, needs_data, small_layout
from fedlora.config import EvalFormat, load_config
from fedlora.errors import ConfigError, DataError
from fedlora.llm.harness import HARNESS_TASKS, harness_request, resolve_eval_format
from fedlora.llm.prompts import format_prompt, response_text
from fedlora.llm.task_registry import BUILTIN_TASKS, TASKS, get_task, register_task
from fedlora.llm.tasks import (
    HUB_SOURCES,
    TASK_FOLDERS,
    convert_hub_record,
    load_hub_task,
    load_task,
    load_task_file,
    parse_answer_format,
    records_to_examples,
    resolve_data_dir,
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
    with pytest.raises(DataError, match=r"task file: '.*nope\.json' does not exist"):
        load_task_file(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(DataError, match=r"bad\.json: line 1: Expecting property name"):
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


# ----------------------------------------------------------------------------- the registry

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "golden_requests.json").read_text(encoding="utf-8"))
ROOT = Path(__file__).resolve().parents[1]


def _as_dicts(ex):
    req = harness_request(ex)
    example = {
        "task": ex.task,
        "instruction": ex.instruction,
        "output": ex.output,
        "answer": ex.answer,
        "labels": list(ex.labels),
        "input": ex.input,
    }
    request = {
        "task": req.task,
        "contexts": list(req.contexts),
        "continuations": list(req.continuations),
        "choices": list(req.choices),
        "gold": req.gold,
    }
    return example, request


def test_every_builtin_task_is_one_declaration() -> None:
    assert [s.name for s in BUILTIN_TASKS] == list(TASK_FOLDERS) == list(HARNESS_TASKS)
    assert set(HUB_SOURCES) == set(TASK_FOLDERS)
    assert get_task("ARC-Easy") is get_task("arc-e")  # a folder name finds its task
    assert get_task("boolq").metrics == ("acc",) and get_task("piqa").metrics[1] == "acc_norm"
    with pytest.raises(DataError, match=r"task = 'nope' is invalid: allowed: arc-e, arc-c"):
        get_task("nope")


@pytest.mark.parametrize("task", sorted(GOLDEN["hub"]))
def test_hub_records_give_the_same_examples_and_requests_as_before(task: str) -> None:
    """The hub-schema fixtures (piqa, winogrande, hellaswag and one record of the others)
    against the examples and requests the per-task code gave before the registry."""
    records = json.loads((FIXTURES / "hub_records.json").read_text(encoding="utf-8"))[task]
    for rec, want in zip(records, GOLDEN["hub"][task], strict=True):
        example, request = _as_dicts(convert_hub_record(task, rec))
        assert example == want["example"]
        assert request == want["request"]


@needs_data
@pytest.mark.parametrize("key", sorted(GOLDEN["local"]))
def test_local_files_give_the_same_examples_prompts_and_requests_as_before(key: str) -> None:
    """Every record of the five tasks with local files: examples, LLM-Adapters prompts,
    option responses and lm-eval requests hash as they did before the registry."""
    task, split = key.split("/")
    want = GOLDEN["local"][key]
    exs = load_task(task, DATA, split)
    h = hashlib.sha256()
    for ex in exs:
        example, request = _as_dicts(ex)
        h.update(
            json.dumps([example, request, format_prompt(ex), response_text(ex, "option")]).encode()
        )
    assert (len(exs), h.hexdigest()) == (want["n"], want["sha256"])
    assert _as_dicts(exs[0])[1] == want["first"]


@pytest.fixture
def my_task():
    """docs/examples/my_task.py, imported from its file; its registration undone after."""
    saved = dict(TASKS)
    spec = importlib.util.spec_from_file_location(
        "fedlora_docs_my_task", ROOT / "docs/examples/my_task.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    TASKS.clear()
    TASKS.update(saved)


def test_the_docs_adding_a_task_example_runs(my_task, tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    source = (ROOT / "docs/examples/my_task.py").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in doc
    rec = {
        "question": "What do plants need?",
        "distractor1": "salt",
        "distractor2": "sand",
        "distractor3": "noise",
        "correct_answer": "light",
    }
    ex = convert_hub_record("sciq", rec)
    assert ex.answer == "answer4" and "Answer4: light" in ex.instruction
    req = harness_request(ex)
    assert req.task == "sciq" and req.context == "Question: What do plants need?\nAnswer:"
    assert req.continuations == (" salt", " sand", " noise", " light") and req.gold == 3
    (tmp_path / "SciQ").mkdir()
    (tmp_path / "SciQ" / "test.json").write_text(
        json.dumps([{"instruction": ex.instruction, "output": ex.output}])
    )
    assert load_task("sciq", str(tmp_path), "test") == [ex]
    assert resolve_eval_format("auto", 10**6, ["sciq", "arc-e"]) == "harness"
    with pytest.raises(DataError, match="already declared differently"):
        register_task(replace(get_task("sciq"), lm_eval="other"))


def test_the_eval_format_is_checked_once_and_reads_as_its_name() -> None:
    fmt = resolve_eval_format("auto", 10**6, ["arc-e"])
    assert isinstance(fmt, EvalFormat) and fmt.harness and fmt == "harness"
    assert EvalFormat(fmt) is fmt and not EvalFormat("llm-adapters").harness
    assert resolve_eval_format("auto", 10**6, ["my-own"]) == "llm-adapters"
    assert pickle.loads(pickle.dumps(fmt)).harness
    with pytest.raises(ConfigError, match=r"evaluation.format = 'cloze' is invalid"):
        EvalFormat("cloze")
    # one home: the config holds the parsed value; scoring and training refuse an unresolved one
    assert isinstance(load_config(None, []).evaluation.format, EvalFormat)
    assert EvalFormat("auto").auto and EvalFormat(fmt).concrete() is fmt
    with pytest.raises(ConfigError, match=r"evaluation.format = 'auto' is invalid"):
        EvalFormat("auto").concrete()
