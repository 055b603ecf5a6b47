"""Issue 39, items 6-10: reads are bounded and typed. The CLI cases of
tests/reliability_reads_cases.py (exit 2, one line, nothing lost, listed in
docs/reliability.md), and the same rules at the library's entry points: bounded regular-file
reads, parse failures naming file and line, hub specs that are hub names, record errors
without the text of the file, chat templates that fail in one line and are bounded in time,
and partition fields that are not scalar."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import pytest

from fedlora.config.data_mc import McConfig
from fedlora.errors import FedloraError
from fedlora.llm.instruct import load_instructions, tokenize_instructions
from fedlora.llm.tasks import load_task_file
from fedlora.llm.user_tasks import load_mc_files
from reliability_cases import CASES, DATA, make_finished_run, message, run_case
from reliability_reads_cases import CHAT, GOOD_TEMPLATE, READ_CASES, SHADOW

# ----------------------------------------------------------------------------- the CLI cases


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "run"
    make_finished_run(path)
    return path


def test_case_names_are_new_and_distinct():
    names = [c.name for c in READ_CASES]
    assert len(set(names)) == len(names) and not set(names) & {c.name for c in CASES}


@pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")
@pytest.mark.parametrize("case", READ_CASES, ids=[c.name for c in READ_CASES])
def test_a_bad_read_is_one_line_exit_2_and_loses_nothing(case, template, tmp_path):
    out = run_case(case, tmp_path / "case", template)
    assert out.rc == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert "error:" in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert case.expect in out.stderr, out.stderr
    assert out.lost == [] and out.present == [], (out.lost, out.present)
    assert "$6$" not in out.stderr and "c2VjcmV0aGFzaA" not in out.stderr
    assert message(out, tmp_path / "case")


def test_docs_list_every_read_case():
    text = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    for case in READ_CASES:
        assert f"| {case.name} |" in text, case.name


# ----------------------------------------------------------------------------- 6: bounded


def test_every_data_reader_refuses_a_device_and_a_fifo_unread(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    readers = [
        lambda p: load_mc_files([p], McConfig(task="own")),
        lambda p: load_instructions([p], "instruct"),
        lambda p: load_task_file(p),
    ]
    for name in ("fifo.jsonl", "zero.json"):
        for read in readers:
            start = time.monotonic()
            with pytest.raises(FedloraError, match=r"is not a regular file \(a device, pipe"):
                read(str(tmp_path / name))
            assert time.monotonic() - start < 5


def test_a_data_file_over_1_gib_is_refused_by_its_size(tmp_path):
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(2**31)  # the 2 GB sparse file: no disk used, never read
    with pytest.raises(FedloraError, match=r"is 2,147,483,648 bytes: at most 1,024 MiB"):
        load_instructions([str(big)], "instruct")


# ----------------------------------------------------------------------------- 7: parses


def _mc(tmp_path: Path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return lambda: load_mc_files(
        [str(path)], McConfig(choices=("A", "B"), answer_type="label", task="own")
    )


GOOD_ROW = "q?,x,y,A\n"


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        (
            "q.csv",
            "question,A,B,answer\n" + GOOD_ROW * 2 + "q?," + "x" * 131_073 + ",y,A\n",
            r"q\.csv: line 4: not CSV: a field is longer than 131,072 characters",
        ),
        (
            "q.jsonl",
            '\n{"question": "q?", "A": "x", "B": "y", "answer": ' + "9" * 5000 + "}\n",
            r"q\.jsonl: line 2: not a JSON value: a number of more than 4,300 digits",
        ),
        (
            "q.json",
            '[\n  {"question": "q?"},\n  {"question": "q?", "answer": ' + "9" * 5000 + "}]",
            r"q\.json: line 3: a number of more than 4,300 digits",
        ),
        (
            "q.jsonl",
            "[" * 100_000 + "]" * 100_000 + "\n",
            r"q\.jsonl: line 1: not a JSON value: nested too deeply",
        ),
        (
            "q.json",
            '[{"question": "q?"},\n\n' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "]",
            r"q\.json: line 3: nested too deeply",
        ),
    ],
)
def test_a_parse_past_a_parsers_limit_names_file_and_line(tmp_path, name, text, match):
    with pytest.raises(FedloraError, match=match):
        _mc(tmp_path, name, text)()


def test_a_task_file_names_the_line_of_its_bad_record(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        '[{"instruction": "x", "answer": "a"},\n[' + "[" * 100_000 + "]" * 100_000 + "]]"
    )
    with pytest.raises(FedloraError, match=r"t\.json: line 2: nested too deeply"):
        load_task_file(str(path))


def test_a_choices_cell_of_5000_digits_is_not_a_list_of_choices(tmp_path):
    text = 'question,choices,answer\nq?,"' + "7" * 5000 + '",0\n'
    path = tmp_path / "q.csv"
    path.write_text(text)
    with pytest.raises(FedloraError, match=r"line 2: field 'choices' must be a list .* got a str"):
        load_mc_files([str(path)], McConfig(task="own"))


# ----------------------------------------------------------------------------- 8: hub names


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A `datasets` that records what it is asked to load, run from `tmp_path`, online."""
    calls = []

    def load_dataset(repo, config, split):
        calls.append(repo)
        return [{"question": "Wet?", "choices": ["sand", "water"], "answer": 1}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    return calls


@pytest.mark.parametrize(
    "spec",
    [
        "hf:../secret@train",
        "hf:../..@train",
        "hf:/etc/x@train",
        "hf:~/x@train",
        "hf:a/b/c@train",
        "hf:me/.hidden@train",
        "hf:me/x--y@train",
        "hf:me/x..y@train",
        "hf:me/x-@train",
        "hf:me/" + "x" * 97 + "@train",
        "hf:me/quiz:../c@train",
        "hf:me/quiz@tr ain",
        "hf:me/quiz",
    ],
)
def test_a_hub_spec_that_is_no_hub_name_never_reaches_datasets(hub, spec):
    with pytest.raises(FedloraError, match=r"is invalid: a hub dataset reads hf:owner/name"):
        load_mc_files([spec], McConfig(task="own"))
    assert hub == []


def test_a_hub_name_that_is_also_a_local_folder_is_refused(hub, tmp_path):
    (tmp_path / "secret" / "x").mkdir(parents=True)
    with pytest.raises(FedloraError, match=r"'secret/x' is also a path here"):
        load_instructions(["hf:secret/x@train"], "instruct")
    assert hub == []
    for spec in ("hf:allenai/sciq@train", "hf:me/quiz:easy@train[:10%]", "hf:a.b/c_d-1@test"):
        assert len(load_mc_files([spec], McConfig(task="own"))) == 1
    assert hub == ["allenai/sciq", "me/quiz", "a.b/c_d-1"]


def test_a_built_in_tasks_hub_source_is_never_a_local_folder(hub, tmp_path):
    from fedlora.llm.tasks import load_hub_task

    (tmp_path / "allenai" / "ai2_arc").mkdir(parents=True)
    with pytest.raises(FedloraError, match=r"task 'arc-e': 'allenai/ai2_arc' is also a path"):
        load_hub_task("arc-e", "train")
    assert hub == []


# ----------------------------------------------------------------------------- 9: no content


def test_record_errors_show_no_text_of_a_foreign_file(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.write_text(SHADOW + "daemon:*:19000:0:99999:7:::\n")
    (tmp_path / "q.csv").symlink_to(shadow)
    with pytest.raises(FedloraError) as e:
        load_mc_files([str(tmp_path / "q.csv")], McConfig(task="own"))
    assert "q.csv: line 2: field 'question' is missing" in str(e.value)
    assert "root:" not in str(e.value) and "$6$" not in str(e.value)
    secret = "s3cr3t-token-line"
    bad = [
        ("a.jsonl", json.dumps(secret) + "\n", "own"),  # a record that is a JSON string
        ("b.jsonl", json.dumps({"question": "q", "choices": secret, "answer": 0}) + "\n", "own"),
        ("c.jsonl", json.dumps({"question": "q", "choices": [secret], "answer": 0}) + "\n", "own"),
        ("d.jsonl", json.dumps({"instruction": [secret], "output": "o"}) + "\n", "instruct"),
        ("e.jsonl", json.dumps({secret + ":x": 1}) + "\n", "instruct"),
    ]
    for name, text, kind in bad:
        (tmp_path / name).write_text(text)
        with pytest.raises(FedloraError) as e:
            if kind == "own":
                load_mc_files([str(tmp_path / name)], McConfig(task="own"))
            else:
                load_instructions([str(tmp_path / name)], "instruct")
        assert f"{name}: line 1: " in str(e.value) and secret not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- 10: templates


@pytest.fixture
def chat(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    return load_instructions([str(path)], "instruct")


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for %}", r"line 1: the chat template fails: TemplateSyntaxError"),
        ("{{ ''.__class__.__mro__ }}", r"line 1: the chat template fails: SecurityError"),
        ("{% include 'x.jinja' %}", r"line 1: the chat template fails: "),
        ("{{ raise_exception('no') }}", r"line 1: the chat template fails: TemplateError: no"),
        ("{{ messages[0]['content'] / 0 }}", r"line 1: the chat template fails: TypeError"),
        ("{# nothing #}", r"renders no response for 2 chat record\(s\) \(.*chat\.jsonl: line 1;"),
    ],
)
def test_a_tokenizers_own_template_fails_in_one_line_naming_the_record(chat, template, match):
    from fedlora.llm.tiny_models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = template  # not data.chat_template: checked only when rendered
    with pytest.raises(FedloraError, match=match):
        tokenize_instructions(chat, tok, 256)


def test_a_template_rendering_forever_stops_within_its_time(chat, monkeypatch):
    from fedlora.llm import chat_render, instruct
    from fedlora.llm.tiny_models import build_tiny_tokenizer

    monkeypatch.setattr(instruct, "RENDER_SECONDS", 0.5)
    monkeypatch.setattr(chat_render, "RENDER_SECONDS", 0.5)
    tok = build_tiny_tokenizer()
    tok.chat_template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    start = time.monotonic()
    with pytest.raises(FedloraError, match=r"rendering did not end within 0.5 s"):
        tokenize_instructions(chat, tok, 256)
    assert time.monotonic() - start < 5


def test_a_render_off_the_main_thread_is_bounded_too():
    import threading

    from fedlora.llm.chat_render import RenderTimeout, within

    out = {}

    def spin() -> None:
        while True:
            pass

    def worker() -> None:
        try:
            within(0.2, spin)
        except RenderTimeout:
            out["stopped"] = True
        out["value"] = within(0.2, lambda: 7)

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert out == {"stopped": True, "value": 7}
    # the abandoned rendering is stopped too, not left spinning for the rest of the process
    assert not [th for th in threading.enumerate() if th.name == "fedlora-chat-render"]


def test_a_good_template_trains_as_before(chat, tmp_path):
    from fedlora.llm.instruct import check_instruction_templates, set_chat_template
    from fedlora.llm.tiny_models import build_tiny_tokenizer

    path = tmp_path / "t.jinja"
    path.write_text(GOOD_TEMPLATE)
    check_instruction_templates(str(path), chat)  # renders every record, bounded: passes
    tok = build_tiny_tokenizer()
    set_chat_template(tok, str(path))
    ts, kept = tokenize_instructions(chat, tok, 256)
    assert kept == [0, 1]
    response = [int(i) for i, lab in zip(ts.input_ids[0], ts.labels[0]) if lab != -100]
    assert tok.decode(response) == "Hello</s>"


# ----------------------------------------------------------------------------- partition


def test_a_partition_field_holding_a_list_or_null_is_not_scalar(tmp_path):
    from fedlora.llm.partition import partition_keys

    path = tmp_path / "q.jsonl"
    rows = [{"question": "q?", "choices": ["a", "b"], "answer": 0, "user": "ann", "tags": []}]
    rows.append({**rows[0], "user": None, "tags": "t"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exs = load_mc_files([str(path)], McConfig(task="own"))
    with pytest.raises(
        FedloraError, match=r"q\.jsonl: line 1: field 'tags' is not scalar \(a list"
    ):
        partition_keys(exs, "tags")
    with pytest.raises(
        FedloraError, match=r"q\.jsonl: line 2: field 'user' is not scalar \(null\)"
    ):
        partition_keys(exs, "user")
    ins = tmp_path / "i.jsonl"
    ins.write_text(json.dumps({"instruction": "i", "output": "o", "user": {"id": 1}}) + "\n")
    with pytest.raises(
        FedloraError, match=r"i\.jsonl: line 1: field 'user' is not scalar \(an obj"
    ):
        partition_keys(load_instructions([str(ins)], "instruct"), "user")
    with pytest.raises(FedloraError, match=r"has no such field"):  # missing stays missing
        partition_keys(exs, "team")
