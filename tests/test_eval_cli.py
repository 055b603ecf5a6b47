"""`fedlora eval`: output, agreement with the library, adapters, and exit 2 on bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.llm.data import seeded_subset, stream_rng
from fedlora.llm.eval_stats import wilson_interval
from fedlora.llm.evaluation import evaluate
from fedlora.llm.models import load_model
from fedlora.llm.tasks import load_task_file

DATA = os.environ.get("FEDLORA_DATA", "")


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


@pytest.fixture()
def task_file(tmp_path: Path) -> Path:
    recs = [mc_record(f"question number {i}?", ["red", "green", "blue"], i % 3) for i in range(12)]
    path = tmp_path / "mytask" / "test.json"
    path.parent.mkdir()
    path.write_text(json.dumps(recs))
    return path


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_matches_the_library(capsys, task_file: Path) -> None:
    out = run_json(capsys, ["--model", "tiny-llama", "--task-file", str(task_file)])
    assert {"accuracy", "n", "ci95", "task", "model"} <= out.keys()
    assert (out["n"], out["task"], out["model"]) == (12, "mytask", "tiny-llama")
    model, tok = load_model("tiny-llama", progress=False)
    direct = evaluate(model, tok, load_task_file(str(task_file)))
    assert out["accuracy"] == pytest.approx(direct.accuracy)
    assert out["ci95"] == pytest.approx(list(wilson_interval(round(direct.accuracy * 12), 12)))


def test_limit_is_the_seeded_subset_and_text_output(capsys, task_file: Path) -> None:
    argv = ["--model", "tiny-llama", "--task-file", str(task_file), "--limit", "5", "--seed", "3"]
    out = run_json(capsys, argv)
    assert out["n"] == 5
    model, tok = load_model("tiny-llama", progress=False)
    subset = seeded_subset(load_task_file(str(task_file)), 5, stream_rng(3, "eval", "mytask"))
    assert out["accuracy"] == pytest.approx(evaluate(model, tok, subset).accuracy)
    assert main(["eval", *argv, "--scoring", "option", "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("mytask: accuracy ") and "n = 5" in text and "95% CI" in text
    assert "bf16" in text and "scoring option" in text


@pytest.mark.skipif(not DATA or not Path(DATA).is_dir(), reason="FEDLORA_DATA absent")
def test_named_task_from_data_dir(capsys) -> None:
    out = run_json(
        capsys, ["--model", "tiny-qwen2", "--task", "siqa", "--data-dir", DATA, "--limit", "4"]
    )
    assert (out["task"], out["n"]) == ("siqa", 4)
    assert 0.0 <= out["ci95"][0] <= out["accuracy"] <= out["ci95"][1] <= 1.0


def test_adapter_is_applied(capsys, tmp_path: Path, task_file: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    model, tok = load_model("tiny-llama", progress=False)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, cfg).save_pretrained(tmp_path / "adapter")
    out = run_json(
        capsys,
        [
            "--model",
            "tiny-llama",
            "--task-file",
            str(task_file),
            "--adapter",
            str(tmp_path / "adapter"),
        ],
    )
    base, tok = load_model("tiny-llama", progress=False)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    direct = evaluate(peft_model, tok, load_task_file(str(task_file)))
    assert out["accuracy"] == pytest.approx(direct.accuracy)
    assert out["adapter"] == str(tmp_path / "adapter")


def _bad(capsys, argv: list[str]) -> str:
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_inputs_exit_2_with_a_clear_message(capsys, tmp_path: Path, task_file: Path) -> None:
    m = ["--model", "tiny-llama"]
    tf = ["--task-file", str(task_file)]
    assert "task = 'arc' is invalid: allowed: arc-e, arc-c" in _bad(capsys, [*m, "--task", "arc"])
    err = _bad(capsys, [*m, "--task", "arc-e", "--data-dir", str(tmp_path / "nowhere")])
    assert "data directory" in err and "nowhere' does not exist" in err
    err = _bad(capsys, [*m, "--task", "arc-c", "--data-dir", str(tmp_path)])
    assert "ARC-Challenge' does not exist" in err and "holds: mytask" in err
    assert "task file" in _bad(capsys, [*m, "--task-file", str(tmp_path / "x.json")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([mc_record("q", ["a", "b"], 0), {"instruction": "q"}]))
    assert "bad.json: record 1: no answer" in _bad(capsys, [*m, "--task-file", str(bad)])
    nolabels = tmp_path / "nolabels.json"
    nolabels.write_text(json.dumps([{"instruction": "q", "answer": "yes"}]))
    assert "cannot parse the label set" in _bad(capsys, [*m, "--task-file", str(nolabels)])
    assert "--limit = -1 is invalid" in _bad(capsys, [*m, *tf, "--limit", "-1"])
    assert "--batch-size = 0 is invalid" in _bad(capsys, [*m, *tf, "--batch-size", "0"])
    assert "--scoring = 'text' is invalid" in _bad(capsys, [*m, *tf, "--scoring", "text"])
    assert "--dtype = 'fp16' is invalid" in _bad(capsys, [*m, *tf, "--dtype", "fp16"])
    err = _bad(capsys, ["--model", "no-such-model", *tf])
    assert "model.name = 'no-such-model' is invalid" in err and "smollm2-135m" in err
    err = _bad(capsys, [*m, *tf, "--adapter", str(tmp_path)])
    assert "--adapter" in err and "has no adapter_config.json" in err


def test_task_and_task_file_are_exclusive_and_one_is_required(capsys, task_file: Path) -> None:
    for argv in (
        ["--model", "tiny-llama"],
        ["--model", "tiny-llama", "--task", "arc-e", "--task-file", str(task_file)],
    ):
        with pytest.raises(SystemExit) as e:
            main(["eval", *argv])
        assert e.value.code == 2
        capsys.readouterr()


def test_device_is_honoured_and_a_missing_one_is_exit_2(capsys, task_file, monkeypatch) -> None:
    import torch

    import fedlora.llm.device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fedlora.llm.device, "_mps_available", lambda: False)
    argv = ["--model", "tiny-llama", "--task-file", str(task_file)]
    out = run_json(capsys, [*argv, "--device", "cpu"])
    assert (out["device"], out["dtype"]) == ("cpu", "fp32")
    assert run_json(capsys, argv)["device"] == "cpu"  # auto, without a GPU
    err = _bad(capsys, [*argv, "--device", "cuda"])
    assert "--device = 'cuda' is invalid: not available on this machine; available: cpu" in err
    assert "--device = 'gpu' is invalid: allowed: auto, cpu, cuda" in _bad(
        capsys, [*argv, "--device", "gpu"]
    )
