"""A quiet terminal: `fedlora eval` on a tiny model prints no other library's warning unless
--verbose (a fresh process each, as a user runs it: warnings are shown once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from fedlora.commands.terminal import _show_own_warnings

SRC = Path(__file__).resolve().parents[1] / "src"


# Another library's warning, raised while `fedlora eval` runs (when it imports its evaluation
# module: after the command line has set up the terminal), from a file outside fedlora.
FOREIGN_WARNING = """import sys, warnings

def _hook(event, args):
    if event == "import" and args[0] == "fedlora.llm.evaluation" and not _hook.done:
        _hook.done = True
        warnings.warn("a foreign library's deprecation", FutureWarning)

_hook.done = False
sys.addaudithook(_hook)
"""


def _eval(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    recs = [
        {"instruction": f"Please choose the correct answer to the question: q{i}?\n\n"
         "Answer1: red Answer2: green\n\nAnswer format: answer1/answer2", "input": "",
         "output": "the correct answer is answer1", "answer": "answer1"}
        for i in range(4)
    ]  # fmt: skip
    path = tmp_path / "mytask" / "test.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(recs))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
                        "PYTHONWARNINGS")}  # fmt: skip
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(FOREIGN_WARNING)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(site), env.get("PYTHONPATH", "")])
    argv = [*flags, "eval", "--model", "tiny-llama", "--task-file", str(path), "--json"]
    cmd = [sys.executable, "-m", "fedlora.cli", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_eval_prints_no_foreign_warning_unless_verbose(tmp_path: Path) -> None:
    quiet = _eval(tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["n"] == 4
    assert quiet.stderr == ""
    loud = _eval(tmp_path, "--verbose")  # the same run shows what was silenced
    assert loud.returncode == 0
    assert "a foreign library's deprecation" in loud.stderr and "FutureWarning" in loud.stderr


def test_own_warnings_still_show(capsys) -> None:
    shown = []
    show = _show_own_warnings(lambda *a: shown.append(a[2]))
    show("x", UserWarning, str(SRC / "fedlora" / "llm" / "models.py"), 1)
    show("y", FutureWarning, "/site-packages/transformers/generic.py", 1)
    assert shown == [str(SRC / "fedlora" / "llm" / "models.py")]
    assert _show_own_warnings(show) is show  # installed once
    assert warnings.showwarning is not show


def test_flower_deprecation_notices_are_dropped() -> None:
    import logging

    from fedlora.commands.terminal import quiet_libraries

    quiet_libraries(verbose=False)
    quiet_libraries(verbose=False)  # twice: one filter
    flwr = logging.getLogger("flwr")
    assert len([f for f in flwr.filters if getattr(f, "fedlora_quiet", False)]) == 1
    make = flwr.makeRecord
    notice = make("flwr", logging.WARNING, "x", 1, "DEPRECATED FEATURE: run_simulation", (), None)
    info = make("flwr", logging.INFO, "x", 1, "[ROUND 1]", (), None)
    assert not flwr.filter(notice) and flwr.filter(info)
