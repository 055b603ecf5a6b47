"""Chat templates, bounded: the Jinja file of `data.chat_template` is a user's file (a
regular file of at most `MAX_TEMPLATE_BYTES`), compiled in transformers' sandbox (the one
`apply_chat_template` renders in), and every rendering is bounded in time
(`RENDER_SECONDS`); before a run directory exists (`check_chat_records`) each chat record is
rendered with the template and bounded in output too (`render_limit`).

Every way a template fails (a syntax error, the sandbox's SecurityError, an `include`,
`raise_exception`, an error inside an expression, a rendering that does not end) is a
`DataError` naming the template or the record, never a traceback; a template that renders no
response for some records names them instead of dropping them silently.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fedlora.errors import DataError, cut, shown
from fedlora.files.data import read_data_text

MAX_TEMPLATE_BYTES = 2**20  # a chat template is a few KiB; 1 MiB is far above any model's
RENDER_SECONDS = 5.0  # one rendering of one conversation (milliseconds for a real template)
# the special tokens a tokenizer passes to its template; before the model loads, these
# stand-ins let a template that writes them render (their text does not matter for bounds)
STAND_IN_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": ""}

T = TypeVar("T")
Messages = Sequence[tuple[str, str]]


class RenderTimeout(Exception):
    """A rendering ran past its time limit."""


def _alarm_free() -> bool:
    """Whether SIGALRM can bound this call: the main thread, and no timer already armed."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


def within(seconds: float, fn: Callable[[], T]) -> T:
    """`fn()`, or `RenderTimeout` once `seconds` have passed. On the main thread a SIGALRM
    interrupts it (a Jinja loop is Python code, so it stops there); elsewhere it runs in a
    daemon thread that is stopped on timeout by an asynchronous `RenderTimeout` raised in it
    (`_stop`: the same stop, at the thread's next bytecode), never left spinning."""
    if _alarm_free():

        def on_alarm(signum: int, frame: Any) -> None:
            raise RenderTimeout

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True, name="fedlora-chat-render")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        _stop(worker)
        raise RenderTimeout
    if "error" in box:
        raise box["error"]
    return box["value"]


def _stop(worker: threading.Thread, wait_s: float = 1.0) -> None:
    """Raise `RenderTimeout` inside `worker` (CPython's PyThreadState_SetAsyncExc: delivered
    at its next bytecode, so a Python loop stops; a call into C finishes first) and wait up to
    `wait_s` for it to end. A thread left spinning holds the GIL's share of every later
    computation of the process (a test suite ran several times slower beside one)."""
    import ctypes

    ident = worker.ident
    if ident is None:
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(RenderTimeout)
    )
    worker.join(wait_s)


def template_failure(e: BaseException) -> str:
    """A template's error in one line: its kind and its first line (cut)."""
    if isinstance(e, RenderTimeout):
        return f"rendering did not end within {RENDER_SECONDS:g} s (a loop too long?)"
    first = (str(e).strip().splitlines() or [""])[0]
    lineno = getattr(e, "lineno", None)
    at = f" at template line {lineno}" if isinstance(lineno, int) else ""
    return f"{type(e).__name__}{at}: {cut(first)}" if first else f"{type(e).__name__}{at}"


def read_chat_template(path: str) -> str:
    """The text of the Jinja file `data.chat_template` (a regular file, at most 1 MiB)."""
    return read_data_text(path, "data.chat_template", MAX_TEMPLATE_BYTES)


def compile_chat_template(text: str, path: str) -> Any:
    """The template compiled in transformers' sandboxed environment (the filters and globals
    `apply_chat_template` gives it); `DataError` naming the file and the line of a syntax
    error."""
    # transformers' own compiler (private, cached): the same environment training renders in
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        return _compile_jinja_template(text)
    except Exception as e:  # noqa: BLE001 - TemplateSyntaxError, an old jinja2: one line
        raise DataError(f"data.chat_template = {shown(path)}: {template_failure(e)}") from None


def render_limit(messages: Messages) -> int:
    """The most characters one rendering may write: the conversation's text four times over
    plus 1 MiB (a template adds markers around each message, not megabytes)."""
    return 2**20 + 4 * sum(len(content) for _, content in messages)


def render(template: Any, messages: Messages, *, generation_prompt: bool, limit: int) -> str:
    """One conversation rendered as `apply_chat_template(tokenize=False)` renders it (with
    stand-in special tokens), stopping past `limit` characters or `RENDER_SECONDS`."""
    variables = {
        "messages": [{"role": r, "content": c} for r, c in messages],
        "tools": None,
        "documents": None,
        "add_generation_prompt": generation_prompt,
        **STAND_IN_TOKENS,
    }

    def stream() -> str:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > limit:
                raise DataError(f"it writes over {limit:,} characters for one conversation")
            pieces.append(piece)
        return "".join(pieces)

    return within(RENDER_SECONDS, stream)


def check_chat_records(path: str, chats: Sequence[tuple[str, Messages]]) -> None:
    """Before any run directory exists: the template of `data.chat_template` read, compiled
    and rendered for every chat record (`(where, messages)`), each rendering bounded; a
    failure names the template and the record, and records whose rendering has no response
    (the whole conversation renders as its prompt) are named, not dropped later."""
    template = compile_chat_template(read_chat_template(path), path)
    silent = []
    for where, messages in chats:
        limit = render_limit(messages)
        try:
            prompt = render(template, messages[:-1], generation_prompt=True, limit=limit)
            whole = render(template, messages, generation_prompt=False, limit=limit)
        except Exception as e:  # noqa: BLE001 - whatever the template raises: one line
            why = str(e) if isinstance(e, DataError) else template_failure(e)
            raise DataError(f"{where}: data.chat_template = {shown(path)} fails: {why}") from None
        if not whole.startswith(prompt):
            raise DataError(f"{where}: {NOT_PREFIX}")
        if len(whole) == len(prompt):
            silent.append(where)
    if silent:
        raise DataError(no_response(silent, f"data.chat_template = {shown(path)}"))


NOT_PREFIX = (
    "the chat template does not render the conversation as its prompt followed by the "
    "response, so the response tokens cannot be told apart"
)


def no_response(wheres: Sequence[str], template: str = "the chat template") -> str:
    """The error for records whose chat rendering has no response tokens."""
    listed = "; ".join(wheres[:3]) + ("; ..." if len(wheres) > 3 else "")
    return (
        f"{template} renders no response for {len(wheres)} chat record(s) ({listed}): the "
        "whole conversation renders the same as its prompt, so there is nothing to train on; "
        "the template must write the last assistant message"
    )
