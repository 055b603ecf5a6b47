"""Issue 38 item 3: your own multiple-choice data is one table, ``[data.mc]``
(`fedlora.config.data_mc.McConfig`: its defaults and checks declared once, the field map
`fedlora.llm.user_tasks` reads through), its files read once per run (the checks' read is the
build's), and the flat ``data.mc_*`` keys written before still read, with a FutureWarning,
and resume a run directory that holds them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import fedlora.files.data as files_data
from fedlora.cli import main
from fedlora.config import RENAMED_KEYS, DataConfig, McConfig, dump_toml, load_config
from fedlora.errors import ConfigError
from fedlora.federation.rundir import config_changes, load_run_config
from fedlora.files.data import reading_once
from fedlora.llm.user_tasks import load_mc_files

OWN = Path(__file__).resolve().parent / "fixtures" / "own"
TRAIN, TEST = str(OWN / "quiz_train.csv"), str(OWN / "quiz_test.csv")
TABLE = f"""[data]
tasks = []
eval_tasks = []

[data.mc]
files = ["{TRAIN}"]
eval_files = ["{TEST}"]
task = "quiz"
choices = ["A", "B", "C", "D"]
answer_type = "label"
"""
NEW = [
    f'data.mc.files=["{TRAIN}"]',
    f'data.mc.eval_files=["{TEST}"]',
    'data.mc.task="quiz"',
    'data.mc.choices=["A", "B", "C", "D"]',
    'data.mc.answer_type="label"',
]
EMPTY = ["data.tasks=[]", "data.eval_tasks=[]"]


def _cfg(tmp_path: Path, text: str, overrides: list[str] = ()):
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(str(path), list(overrides))


def test_the_table_the_command_line_and_the_dump_give_one_config(tmp_path):
    cfg = _cfg(tmp_path, TABLE)
    assert cfg.data.mc == McConfig(
        files=(TRAIN,), eval_files=(TEST,), task="quiz", choices=("A", "B", "C", "D"),
        answer_type="label",
    )  # fmt: skip
    assert load_config(None, [*EMPTY, *NEW]) == cfg
    dumped = dump_toml(cfg)
    assert '\n[data.mc]\nfiles = ["' in dumped and "mc_files" not in dumped
    assert _cfg(tmp_path, dumped) == cfg
    # the field map the records are read through is the config's own table
    exs = load_mc_files(cfg.data.mc.eval_files, cfg.data.mc)
    assert [e.task for e in exs] == ["quiz"] * 4 and exs[1].answer == "answer4"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('data.mc.task=""', "data.mc.task = '' is invalid: a non-empty task name"),
        ('data.mc.question=""', "data.mc.question = '' is invalid: a non-empty field name"),
        ('data.mc.answer=""', "data.mc.answer = '' is invalid: a non-empty field name"),
        ("data.mc.choices=[]", r"data.mc.choices = \[\] is invalid: distinct field names"),
        ('data.mc.choices=["A", "A"]', r"data.mc.choices = \['A', 'A'\] is invalid: distinct"),
        (
            'data.mc.answer_type="letter"',
            "data.mc.answer_type = 'letter' is invalid: allowed: index, label, text",
        ),  # fmt: skip
        ('data.mc.files=[""]', r"data.mc.files = \[''\] is invalid: a list of paths"),
        ("data.mc.eval_files=[1]", r"data.mc.eval_files\[0\] = 1 is invalid: a string"),
        ("data.mc.context=0", "data.mc.context = 0 is invalid: a string"),
        ('data.mc.qestion="q"', r"unknown key data.mc.qestion \(did you mean 'question'\?\)"),
        ("data.mc=3", r"data.mc must be a table \[data.mc\], got 3"),
    ],
)
def test_a_bad_value_names_its_key_in_the_table(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_the_python_form_is_checked_the_same_way():
    assert McConfig(files=["a.csv"]).files == ("a.csv",)  # a list given in Python: a tuple
    with pytest.raises(ConfigError, match=r"data.mc.files = 'a.csv' is invalid"):
        McConfig(files="a.csv")  # a string is not a list of one path
    with pytest.raises(ConfigError, match=r"data.mc = \{'files': \['a.csv'\]\} is invalid: a \["):
        DataConfig(mc={"files": ["a.csv"]})


# ----------------------------------------------------------------------------- the old keys

OLD_VALUES = {
    "files": [TRAIN],
    "eval_files": [TEST],
    "task": "quiz",
    "question": "q",
    "choices": ["A", "B"],
    "answer": "gold",
    "answer_type": "label",
    "context": "passage",
}


@pytest.mark.parametrize("key", sorted(OLD_VALUES))
def test_each_old_flat_key_is_read_with_the_new_spelling_named(key):
    value = json.dumps(OLD_VALUES[key])
    assert RENAMED_KEYS[f"data.mc_{key}"] == f"data.mc.{key}"
    new = load_config(None, [f"data.mc.{key}={value}"])
    with pytest.warns(FutureWarning) as caught:
        old = load_config(None, [f"data.mc_{key}={value}"])
    assert old == new and getattr(new.data.mc, key) != getattr(McConfig(), key)
    (warning,) = caught
    assert str(warning.message) == (
        f"config: data.mc_{key} is deprecated: write it as [data.mc] {key} = {value} "
        f"(on the command line: data.mc.{key}={value})"
    )


def test_both_spellings_agree_or_are_refused(tmp_path):
    both = '[data]\nmc_task = "quiz"\n[data.mc]\ntask = "{}"\n'
    with pytest.warns(FutureWarning):
        assert _cfg(tmp_path, both.format("quiz")).data.mc.task == "quiz"
    with pytest.raises(
        ConfigError,
        match=r"data.mc_task = 'quiz' and data.mc.task = 'exam' disagree: data.mc_task is the "
        r"old name of data.mc.task; give only \[data.mc\] task",
    ):
        _cfg(tmp_path, both.format("exam"))
    # an override replaces the file's value, in either spelling
    table, flat = '[data.mc]\ntask = "quiz"\n', '[data]\nmc_task = "quiz"\n'
    with pytest.warns(FutureWarning):
        for text, override in [(table, "data.mc_task=exam"), (flat, "data.mc.task=exam")]:
            assert _cfg(tmp_path, text, [override]).data.mc.task == "exam", (text, override)


def test_the_demo_config_writes_the_table():
    root = Path(__file__).resolve().parents[1]
    text = (root / "configs" / "demo.toml").read_text(encoding="utf-8")
    assert "\n[data.mc]\nfiles = []\n" in text and "mc_files" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(str(root / "configs" / "demo.toml")).data.mc == McConfig()


# ----------------------------------------------------------------------------- read once


def _count_reads(monkeypatch) -> dict[str, int]:
    reads: dict[str, int] = {}
    real = files_data.read_data_text

    def counted(path, what, *args, **kwargs):
        reads[str(path)] = reads.get(str(path), 0) + 1
        return real(path, what, *args, **kwargs)

    monkeypatch.setattr(files_data, "read_data_text", counted)
    return reads


def test_within_a_scope_a_file_is_read_once_and_outside_every_time(tmp_path, monkeypatch):
    reads = _count_reads(monkeypatch)
    path = tmp_path / "q.csv"
    path.write_text("question,A,B,answer\nq?,x,y,A\n", encoding="utf-8")
    mc = McConfig(choices=("A", "B"), answer_type="label")
    with reading_once():
        first = load_mc_files([str(path)], mc)
        path.write_text("question,A,B,answer\nq?,x,y,B\n", encoding="utf-8")  # same size
        with reading_once():  # a scope inside another is the outer one
            assert load_mc_files([str(path)], mc) == first  # the records first read
    assert reads == {str(path): 1} and first[0].answer == "answer1"
    (again,) = load_mc_files([str(path)], mc)  # outside: the file as it is now
    assert again.answer == "answer2" and reads == {str(path): 2}


RUN = [
    "model.name=tiny-llama",
    "model.threads=1",
    "model.dtype=fp32",
    *EMPTY,
    *NEW,
    "data.n_clients=2",
    "data.min_client_examples=2",
    "lora.rank=2",
    "lora.layers=1",
    "training.batch_size=2",
    "training.local_steps=1",
    "method.q=full",
    "method.k=full",
    "output.progress=false",
]


def _old_spelling(path: Path) -> None:
    """config.toml as fedlora wrote it before the table: the data.mc_* keys in [data]."""
    text = path.read_text(encoding="utf-8")
    head, _, rest = text.partition("\n[data.mc]\n")
    table, _, tail = rest.partition("\n\n")
    flat = "".join(f"mc_{line}\n" for line in table.splitlines())
    assert flat.count("mc_") == 8 and head.endswith('\nchat_template = ""\n')  # [data]'s last
    path.write_text(head + flat + "\n" + tail, encoding="utf-8")


def test_a_run_reads_each_file_once_and_resumes_from_the_old_spelling(
    tmp_path, monkeypatch, capsys
):
    reads = _count_reads(monkeypatch)
    run_dir = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(run_dir), *RUN, "training.rounds=1"]) == 0
    assert reads == {TRAIN: 1, TEST: 1}  # the checks' read is the build's
    _old_spelling(run_dir / "config.toml")
    assert "mc_files = [" in (run_dir / "config.toml").read_text(encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a run directory's old keys: read without a warning
        saved = load_run_config(run_dir)
    given = load_config(None, [*RUN, "training.rounds=1"])
    assert saved.data.mc == given.data.mc and config_changes(saved, given)[1] == []
    other = load_config(None, [*RUN, "training.rounds=1", 'data.mc.context="passage"'])
    assert config_changes(saved, other)[1] == ["data.mc.context"]
    capsys.readouterr()
    resume = ["run", "--quiet", "--resume", str(run_dir), "--force", "training.rounds=2"]
    assert main(resume) == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2]
    text = (run_dir / "config.toml").read_text(encoding="utf-8")
    assert "\n[data.mc]\nfiles = [" in text and "mc_files" not in text
    assert "FutureWarning" not in capsys.readouterr().err
    assert reads == {TRAIN: 2, TEST: 2}  # the resumed run: once more each
