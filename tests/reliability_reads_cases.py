"""Bad inputs of issue 39's "reads are bounded and typed" (items 6-10), as data in the form of
tests/reliability_cases.py: every file fedlora reads (data, task, template and profiles
files) is a regular file of bounded size; a parse that fails names the file and the line; a
hub spec is a hub name, never a path; an error about a record never prints the text of a
file that may not be the user's; a chat template fails in one line, bounded in time, before
any run directory exists. tests/test_reliability_reads.py runs them; tests/reliability_table.py
lists them in docs/reliability.md.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

from reliability_cases import TINY, Case, Setup, _chain, _link, _write

RUN = ["run", *TINY, "--quiet"]
NEW = ["--out", "{tmp}/new"]

# a password-file line: what a link to /etc/shadow read as CSV makes the header
SHADOW = "root:$6$saltsalt$c2VjcmV0aGFzaA:19000:0:99999:7:::\n"
CHAT = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
]
GOOD_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _fifo(rel: str) -> Setup:
    """A FIFO at `rel`. A reader that opens it blocking (as fedlora did) is released by a
    writer that opens and closes it as soon as a reader is there, so the case fails instead
    of hanging; fedlora refuses it without opening it for a blocking read."""

    def setup(tmp: Path):
        path = tmp / rel
        os.mkfifo(path)
        stop = threading.Event()

        def release() -> None:
            while not stop.is_set():
                try:  # succeeds only while a reader has it open
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                    return
                except OSError as e:
                    if e.errno != errno.ENXIO:
                        return
                    stop.wait(0.05)

        threading.Thread(target=release, daemon=True).start()
        return stop.set

    return setup


def _sparse_beside(name: str, size: int) -> Setup:
    """A sparse file `name` beside {tmp} (no disk used; outside {tmp}, whose files the case
    hashes before and after), removed afterwards."""

    def setup(tmp: Path):
        path = tmp.parent / name
        with open(path, "wb") as f:
            f.truncate(size)
        return lambda: path.unlink()

    return setup


def _jsonl(rel: str, records: list) -> Setup:
    return _write(rel, "".join(json.dumps(r) + "\n" for r in records))


def _in_tmp(tmp: Path):
    """Run the case from {tmp} (a hub name that is also a local path there)."""
    before = Path.cwd()
    os.chdir(tmp)
    return lambda: os.chdir(before)


# a tiny run on two chat records rendered with the template {tmp}/t.jinja
CHAT_RUN = [
    *RUN,
    *NEW,
    'data.instruct_files=["{tmp}/chat.jsonl"]',
    'data.chat_template="{tmp}/t.jinja"',
]


def _chat_setup(template: str) -> Setup:
    return _chain(_jsonl("chat.jsonl", CHAT), _write("t.jinja", template))


MC = ['data.mc.choices=["A", "B"]', 'data.mc.answer_type="label"']

READ_CASES: list[Case] = [
    # 6: every file fedlora reads is a regular file of bounded size
    Case(
        "mc.files linked to /dev/zero",
        [*RUN, *NEW, 'data.mc.files=["{tmp}/zero.csv"]'],
        "is not a regular file (a device, pipe or socket)",
        _link("zero.csv", "/dev/zero"),
        absent=["new"],
    ),
    Case(
        "instruct_files linked to /dev/zero",
        [*RUN, *NEW, 'data.instruct_files=["{tmp}/zero.jsonl"]'],
        "is not a regular file (a device, pipe or socket)",
        _link("zero.jsonl", "/dev/zero"),
        absent=["new"],
    ),
    Case(
        "mc.files a FIFO",
        [*RUN, *NEW, 'data.mc.files=["{tmp}/fifo.csv"]'],
        "is not a regular file (a device, pipe or socket)",
        _fifo("fifo.csv"),
        absent=["new"],
    ),
    Case(
        "data.chat_template a FIFO",
        [*RUN, *NEW, 'data.instruct_files=["{tmp}/chat.jsonl"]', 'data.chat_template="{tmp}/t"'],
        "data.chat_template: '",
        _chain(_jsonl("chat.jsonl", CHAT), _fifo("t")),
        absent=["new"],
    ),
    Case(
        "task file of 1 GiB + 1 byte (sparse)",
        [*RUN, *NEW, 'data.task_files=["{tmp}/../big-task.json"]'],
        "is 1,073,741,825 bytes: at most 1,024 MiB is read",
        _sparse_beside("big-task.json", 2**30 + 1),
        absent=["new"],
    ),
    Case(
        "data.chat_template of 2 MiB",
        [*RUN, *NEW, 'data.instruct_files=["{tmp}/chat.jsonl"]', 'data.chat_template="{tmp}/t"'],
        "at most 1 MiB is read",
        _chain(_jsonl("chat.jsonl", CHAT), _write("t", "{# #}" * 2**19)),
        absent=["new"],
    ),
    # 7: a parse that fails names the file and the line
    Case(
        "mc.files CSV cell of 140,000 characters",
        [*RUN, *NEW, 'data.mc.files=["{tmp}/q.csv"]', *MC],
        "q.csv: line 3: not CSV: a field is longer than 131,072 characters",
        _write("q.csv", "question,A,B,answer\nq?,x,y,A\nq?," + "x" * 140_000 + ",y,B\n"),
        absent=["new"],
    ),
    Case(
        "mc.files JSONL number of 5,000 digits",
        [*RUN, *NEW, 'data.mc.files=["{tmp}/q.jsonl"]'],
        "q.jsonl: line 2: not a JSON value: a number of more than 4,300 digits",
        _write(
            "q.jsonl",
            '{"question": "q?", "choices": ["a", "b"], "answer": 0}\n'
            '{"question": "q?", "choices": ["a", "b"], "answer": ' + "1" * 5000 + "}\n",
        ),
        absent=["new"],
    ),
    Case(
        "instruct_files JSON list nested 100,000 deep",
        [*RUN, *NEW, 'data.instruct_files=["{tmp}/i.json"]'],
        "i.json: line 3: nested too deeply",
        _write(
            "i.json",
            '[\n{"instruction": "a", "output": "b"},\n' + "[" * 100_000 + "]" * 100_000 + "]",
        ),
        absent=["new"],
    ),
    Case(
        "profiles CSV cell of 140,000 characters",
        [*RUN, *NEW, 'network.profiles_file="{tmp}/p.csv"'],
        "p.csv: line 2: not CSV: a field is longer than 131,072 characters",
        _write("p.csv", "tau_full_s,t_full_s\n" + "1" * 140_000 + ",1\n2,2\n"),
        absent=["new"],
    ),
    # 8: a hub spec is owner/name by the hub's rules, never a path
    Case(
        "mc.files hf:../secret@train",
        [*RUN, *NEW, 'data.mc.files=["hf:../secret@train"]'],
        "is invalid: a hub dataset reads hf:owner/name[:config]@split",
        absent=["new"],
    ),
    Case(
        "instruct_files hf:secret/x@train with a folder secret/x here",
        [*RUN, *NEW, 'data.instruct_files=["hf:secret/x@train"]'],
        "'secret/x' is also a path here, and the datasets package would read it",
        _chain(_jsonl("secret/x/train.jsonl", CHAT), _in_tmp),
        absent=["new"],
    ),
    # 9: an error about a record shows no text of a file that may not be the user's
    Case(
        "mc.files linked to a password file",
        [*RUN, *NEW, 'data.mc.files=["{tmp}/q.csv"]'],
        "line 2: field 'question' is missing or empty (fields: 1 not shown",
        _chain(
            _write("shadow", SHADOW + "daemon:*:19000:0:99999:7:::\n"), _link("q.csv", "shadow")
        ),
        absent=["new"],
    ),
    # 10: chat templates fail in one line, bounded, before any run directory exists
    Case(
        "chat template with a syntax error",
        CHAT_RUN,
        "TemplateSyntaxError at template line 1",
        _chat_setup("{% for %}"),
        absent=["new"],
    ),
    Case(
        "chat template reading ''.__class__ (the sandbox's SecurityError)",
        CHAT_RUN,
        "SecurityError: access to attribute '__class__'",
        _chat_setup("{{ ''.__class__.__mro__ }}"),
        absent=["new"],
    ),
    Case(
        "chat template with an include",
        CHAT_RUN,
        "chat.jsonl: line 1: data.chat_template = ",
        _chat_setup("{% include 'other.jinja' %}"),
        absent=["new"],
    ),
    Case(
        "chat template calling raise_exception",
        CHAT_RUN,
        "fails: TemplateError: no chat here",
        _chat_setup("{{ raise_exception('no chat here') }}"),
        absent=["new"],
    ),
    Case(
        "chat template looping range(100000) twice, nested",
        CHAT_RUN,
        "rendering did not end within 5 s",
        _chat_setup(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        ),
        absent=["new"],
    ),
    Case(
        "chat template that renders nothing",
        CHAT_RUN,
        "renders no response for 2 chat record(s) (",
        _chat_setup("{# nothing #}"),
        absent=["new"],
    ),
    Case(
        "partition_key on a field holding a list",
        [
            *RUN,
            *NEW,
            "data.tasks=[]",
            'data.mc.files=["{tmp}/q.jsonl"]',
            'data.partition_key="tags"',
        ],
        "line 1: field 'tags' is not scalar (a list of 2)",
        _jsonl(
            "q.jsonl",
            [
                {"question": f"q{i}?", "choices": ["a", "b"], "answer": i % 2, "tags": ["x", "y"]}
                for i in range(4)
            ],
        ),
    ),
]
