"""fedlora's harness scorer agrees with lm-evaluation-harness itself: lm-eval's own
`simple_evaluate` (its HFLM, its task YAMLs fed from local JSON) on a tiny random-init model
gives the same per-question log-likelihoods (<= 1e-4 nats) and the same acc / acc_norm as
`fedlora.llm.evaluation` on the same LLM-Adapters records."""

from __future__ import annotations

import numpy as np
import pytest

from fedlora.llm.lm_eval_bridge import lm_eval_available

pytestmark = pytest.mark.skipif(not lm_eval_available(), reason="lm_eval is not installed")


def _records():
    from fedlora.llm.tasks import Example, convert_hub_record

    def mc(task: str, q: str, options: list[str], answer: int) -> Example:
        labels = tuple(f"answer{i + 1}" for i in range(len(options)))
        opts = " ".join(f"Answer{i + 1}: {o}" for i, o in enumerate(options))
        instruction = (
            f"Please choose the correct answer to the question: {q}\n\n{opts}\n\n"
            f"Answer format: {'/'.join(labels)}"
        )
        out = "the correct answer is " + labels[answer]
        return Example(task, instruction, out, labels[answer], labels)

    def boolq(q: str, answer: str) -> Example:
        return Example(
            "boolq",
            f"Please answer the following question with true or false, question: {q}?"
            "\n\nAnswer format: true/false",
            f"the correct answer is {answer}",
            answer,
            ("true", "false"),
        )

    wino = [
        ("Sam beat Max because _ was fast.", "Sam", "Max", "1"),
        ("The cup fell off the table because _ was tilted.", "cup", "table", "2"),
    ]
    return [
        mc("arc-e", "Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium"], 1),
        mc("arc-e", "What melts ice?", ["heat", "cold", "dark", "salt water"], 0),
        mc("arc-c", "Why do leaves fall in autumn?", ["less light", "more rain", "wind"], 0),
        mc("obqa", "the sun is a", ["star", "planet", "moon", "comet"], 0),
        mc("obqa", "frozen water is called", ["ice", "steam", "fog", "dew"], 2),
        *[
            convert_hub_record(
                "winogrande", dict(zip(("sentence", "option1", "option2", "answer"), w))
            )
            for w in wino
        ],
        convert_hub_record(
            "piqa", {"goal": "Open a jar", "sol1": "Twist it", "sol2": "Eat it", "label": 0}
        ),
        boolq("is ice cold", "true"),
        boolq("is the sun a planet", "false"),
    ]


def test_lm_eval_agrees_with_fedlora(tmp_path) -> None:
    from fedlora.llm.evaluation import evaluate, harness_items
    from fedlora.llm.harness import acc_norm_pred, acc_pred, harness_request
    from fedlora.llm.lm_eval_bridge import run_lm_eval
    from fedlora.llm.models import load_model
    from fedlora.llm.scoring import token_logprobs

    model, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    examples = _records()
    theirs = run_lm_eval(model, tok, examples, tmp_path / "tasks", batch_size=4)
    assert sorted(theirs) == list(range(len(examples)))  # every question scored by lm-eval

    requests = [harness_request(ex) for ex in examples]
    items, where = harness_items(requests, tok)
    lps = token_logprobs(model, tok, items, batch_size=4, share_prompt=True)
    for q, req in enumerate(requests):
        ours = np.array([float(np.sum(lps[i][j])) for i, j in where[q]])
        ref = theirs[q]
        assert ref.task == req.task
        np.testing.assert_allclose(ours, ref.logliks, atol=1e-4, rtol=0)
        assert float(acc_pred(ours) == req.gold) == ref.acc
        if not np.isnan(ref.acc_norm):  # lm-eval defines acc_norm for arc, obqa, piqa
            assert float(acc_norm_pred(ours, req.choices) == req.gold) == ref.acc_norm
    assert sum(not np.isnan(r.acc_norm) for r in theirs.values()) == 6

    # and the evaluator's own numbers, task by task
    for task in ("arc-e", "obqa", "winogrande", "boolq"):
        sub = [q for q, ex in enumerate(examples) if ex.task == task]
        r = evaluate(model, tok, [examples[q] for q in sub], batch_size=4, fmt="harness")
        assert r.accuracy == pytest.approx(np.mean([theirs[q].acc for q in sub]))
        if task in ("arc-e", "obqa"):
            assert r.acc_norm == pytest.approx(np.mean([theirs[q].acc_norm for q in sub]))


def _arc_file(tmp_path, folder: str = "ARC-Easy"):
    import json

    def rec(q: str, options: list[str], answer: int) -> dict[str, str]:
        labels = [f"answer{i + 1}" for i in range(len(options))]
        opts = " ".join(f"Answer{i + 1}: {o}" for i, o in enumerate(options))
        return {
            "instruction": f"Please choose the correct answer to the question: {q}\n\n{opts}"
            f"\n\nAnswer format: {'/'.join(labels)}",
            "input": "",
            "output": f"the correct answer is {labels[answer]}",
            "answer": labels[answer],
        }

    recs = [
        rec(f"What colour is thing {i}?", ["red", "green", "deep blue"], i % 3) for i in range(6)
    ]
    path = tmp_path / folder / "test.json"
    path.parent.mkdir()
    path.write_text(json.dumps(recs))
    return path


def test_cli_harness_runs_lm_eval(capsys, tmp_path) -> None:
    import json

    from fedlora.cli import main

    path = str(_arc_file(tmp_path))
    base = ["eval", "--model", "tiny-llama", "--task-file", path, "--batch-size", "4", "--json"]
    assert main([*base, "--harness"]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert main([*base, "--format", "harness"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert (theirs["evaluator"], theirs["lm_eval_task"], theirs["n"]) == ("lm-eval", "arc_easy", 6)
    assert theirs["accuracy"] == ours["accuracy"]
    assert theirs["acc_norm"] == ours["acc_norm"]


def test_cli_harness_bad_input_exits_2(capsys, tmp_path) -> None:
    from fedlora.cli import main

    path = str(_arc_file(tmp_path))
    argv = ["eval", "--model", "tiny-llama", "--task-file", path, "--harness"]
    assert main([*argv, "--format", "llm-adapters"]) == 2
    assert "--format" in capsys.readouterr().err
    other = str(_arc_file(tmp_path, "mytask"))
    assert main(["eval", "--model", "tiny-llama", "--task-file", other, "--harness"]) == 2
    assert "no lm-evaluation-harness definition" in capsys.readouterr().err


def test_lm_eval_on_a_peft_adapter_agrees(tmp_path) -> None:
    from peft import LoraConfig, get_peft_model

    from fedlora.llm.harness import harness_request
    from fedlora.llm.lm_eval_bridge import run_lm_eval
    from fedlora.llm.models import load_model
    from fedlora.llm.scoring import pair_logliks

    base, tok = load_model("tiny-llama", dtype="fp32", progress=False)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, cfg)
    examples = _records()[:4]
    theirs = run_lm_eval(model, tok, examples, tmp_path / "tasks", batch_size=4)
    for q, ex in enumerate(examples):
        ours = pair_logliks(model, tok, harness_request(ex).pairs, batch_size=4)
        np.testing.assert_allclose(ours, theirs[q].logliks, atol=1e-4, rtol=0)
    plain, _ = load_model("tiny-llama", dtype="fp32", progress=False)
    no_adapter = pair_logliks(plain, tok, harness_request(examples[0]).pairs)
    assert np.max(np.abs(no_adapter - np.array(theirs[0].logliks))) > 1e-3  # it was applied
