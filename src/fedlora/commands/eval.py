"""`fedlora eval --model SPEC (--task NAME | --task-file FILE) [...]`: zero-shot or adapter
multiple-choice accuracy with a 95% Wilson interval.

The `--limit` subset is drawn from the same seeded stream as the engine's evaluation sets
(`data.eval_limit`, `training.seed`), so ``--limit 200 --seed 0`` scores the very examples a
run with ``eval_limit = 200`` and ``seed = 0`` reports on; ``--exclude-seed 0`` leaves that subset
out first (``data.eval_exclude``), for questions disjoint from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedlora.config.eval_format import EvalFormat
from fedlora.config.sections import SCORINGS
from fedlora.errors import ConfigError, DataError, bad_value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="multiple-choice accuracy of a model (and optional LoRA adapter) on a task",
        description="Accuracy by the log-likelihood of each answer option (no free "
        "generation), with a 95% Wilson interval: lm-evaluation-harness's zero-shot format "
        "(acc, acc_norm, mc_loss) for models below 3B parameters, the LLM-Adapters prompt "
        "otherwise (--format). --harness runs lm-eval's own evaluator instead.",
    )
    _add_what_arguments(p)
    _add_how_arguments(p)
    p.set_defaults(func=run_eval)


def _add_what_arguments(p: argparse.ArgumentParser) -> None:
    """What is evaluated: the model, its adapter, the task and which of its questions."""
    p.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="tiny-llama, tiny-qwen2, smollm2-135m, a local model directory or a hub id",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--task",
        metavar="NAME",
        help="arc-e, arc-c, obqa, siqa, boolq, piqa, winogrande, hellaswag (its test split)",
    )
    which.add_argument("--task-file", metavar="FILE", help="any LLM-Adapters JSON file")
    p.add_argument(
        "--data-dir",
        default="",
        metavar="DIR",
        help="LLM-Adapters directory (default: $FEDLORA_DATA, else the hub)",
    )
    p.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter directory to apply")
    p.add_argument(
        "--limit",
        type=int,
        default=0,
        metavar="N",
        help="a seeded subset of N examples (0 = all, the default)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the subset")
    p.add_argument(
        "--exclude-seed",
        type=int,
        action="append",
        default=[],
        metavar="S",
        help="leave out the questions the seed-S subset of the same --limit draws (repeatable; "
        'as data.eval_exclude = ["TASK:S"] in a run)',
    )


def _add_how_arguments(p: argparse.ArgumentParser) -> None:
    """How it is evaluated: scoring, prompt format, precision, device, batching, output."""
    p.add_argument(
        "--scoring",
        default="label",
        metavar="label|option|option_norm",
        help="score the answer labels (default), the option texts, or the option texts per "
        "character (lm-evaluation-harness acc_norm)",
    )
    p.add_argument(
        "--format",
        default=EvalFormat.AUTO,
        metavar="|".join(EvalFormat.NAMES),
        help="harness: lm-evaluation-harness's zero-shot format (acc, acc_norm); llm-adapters: "
        "the LLM-Adapters prompt scored by --scoring; auto (default): harness below 3B "
        "parameters for the tasks lm-eval defines (evaluation.format, docs/data.md)",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        metavar="fp32|bf16|auto",
        help="model precision (auto: as model.dtype = auto, see docs/models.md)",
    )
    p.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda|cuda:N|mps",
        help="where the model runs (auto: cuda if available, else mps, else cpu)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        metavar="B",
        help="examples (with all their candidates) per forward pass",
    )
    p.add_argument(
        "--threads", type=int, default=0, metavar="T", help="torch threads (0 = torch's default)"
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="where converted models are kept (default: ~/.cache/fedlora)",
    )
    p.add_argument(
        "--harness",
        action="store_true",
        help="run lm-evaluation-harness's own evaluator (its HFLM and task definitions, fed "
        "the local records offline) instead of fedlora's scorer: the field's exact numbers; "
        "needs pip install 'fedlora[harness]' (docs/data.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check_args(args: argparse.Namespace) -> None:
    if args.limit < 0:
        raise bad_value("--limit", args.limit, "must be >= 0 (0 = the whole test set)")
    if args.seed < 0:
        raise bad_value("--seed", args.seed, "must be >= 0")
    for s in args.exclude_seed:
        if s < 0:
            raise bad_value("--exclude-seed", s, "must be >= 0")
    if args.exclude_seed and args.limit == 0:  # the seed-S subset of "all" is every question
        raise bad_value(
            "--exclude-seed",
            args.exclude_seed[0],
            "needs --limit N > 0: it leaves out the N questions the seed-S subset of --limit N "
            "draws, and with --limit 0 (the whole test set) that subset is every question",
        )
    if args.batch_size < 1:
        raise bad_value("--batch-size", args.batch_size, "must be >= 1")
    if args.threads < 0:
        raise bad_value("--threads", args.threads, "must be >= 0 (0 = torch's default)")
    if args.scoring not in SCORINGS:
        raise bad_value("--scoring", args.scoring, f"allowed: {', '.join(SCORINGS)}")
    args.format = EvalFormat(args.format, field="--format")
    if args.dtype not in ("fp32", "bf16", "auto"):
        raise bad_value("--dtype", args.dtype, "allowed: fp32, bf16, auto")
    if args.adapter is not None:
        path = Path(args.adapter)
        if not (path / "adapter_config.json").is_file():
            what = "has no adapter_config.json" if path.is_dir() else "does not exist"
            raise bad_value("--adapter", args.adapter, f"a PEFT adapter directory; this one {what}")
    if args.harness and args.format == EvalFormat.LLM_ADAPTERS:
        raise bad_value("--format", args.format, "--harness runs lm-eval's format: auto or harness")
    if args.harness:
        from fedlora.llm.lm_eval_bridge import lm_eval_available

        if not lm_eval_available():
            raise ConfigError(
                "--harness needs lm-evaluation-harness: pip install 'fedlora[harness]' "
                "(lm-eval>=0.4,<0.5)"
            )


def _apply_adapter(model, adapter: str):
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, adapter, is_trainable=False)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise ConfigError(f"--adapter = {adapter!r} does not fit the model: {first}") from None


def run_eval(args: argparse.Namespace) -> int:
    _check_args(args)
    from fedlora.llm.device import resolve_device_dtype

    # a missing GPU fails here, before any loading
    args.device, _, args.dtype, _ = resolve_device_dtype(
        args.device, args.dtype, threads=args.threads or 0, device_field="--device"
    )
    # data first: bad data fails before the (slow) model load
    examples, task = _questions(args)
    from fedlora.llm.evaluation import evaluate
    from fedlora.llm.models import load_model

    model, tokenizer = load_model(
        args.model, dtype=args.dtype, cache_dir=args.cache_dir, progress=True, device=args.device
    )
    from fedlora.llm.harness import resolve_eval_format

    n_params = sum(p.numel() for p in model.parameters())
    fmt = resolve_eval_format(args.format, n_params, [task])
    if args.harness:  # lm-eval scores it (`_run_lm_eval`): `fmt` is not used
        from fedlora.llm.harness import harness_task

        harness_task(task)  # a task lm-eval does not define: a clear error before the run
    if args.adapter is not None:
        from fedlora.llm.adapters import check_adapter

        check_adapter(args.adapter, model, args.model)  # base model, file and shapes
        model = _apply_adapter(model, args.adapter)
    if args.harness:
        return _run_lm_eval(args, model, tokenizer, examples, task)
    result = evaluate(
        model,
        tokenizer,
        examples,
        batch_size=args.batch_size,
        scoring=args.scoring,
        task=task,
        fmt=fmt,
    )
    _refuse_non_finite(result, args)
    if args.json:
        print(json.dumps(_result_json(result, args, fmt)))
    else:
        print(_result_text(result, args, fmt))
    return 0


def _questions(args: argparse.Namespace) -> tuple[list, str]:
    """The task's test questions (--task) or a task file's (--task-file), and the task's
    name; the --limit subset drawn, the --exclude-seed subsets left out."""
    from fedlora.llm.data import eval_questions
    from fedlora.llm.tasks import load_task, load_task_file, resolve_data_dir

    if args.task is not None:
        examples = load_task(args.task, resolve_data_dir(args.data_dir), "test")
        task = args.task
    else:
        examples = load_task_file(args.task_file)
        task = examples[0].task
    examples = eval_questions(
        examples, task, args.limit, args.seed, args.exclude_seed, ("--exclude-seed", "--limit")
    )
    return examples, task


def _result_json(result: Any, args: argparse.Namespace, fmt: EvalFormat) -> dict[str, Any]:
    """`--json`'s object: the scores with their intervals and what produced them."""
    return {
        "accuracy": result.accuracy,
        "n": result.n,
        "ci95": list(result.ci95),
        "eval_loss": result.loss,
        "eval_loss_ci95": list(result.loss_ci95),
        "majority": result.majority,
        "chance": result.chance,
        "task": result.task,
        "model": args.model,
        "adapter": args.adapter,
        "scoring": result.scoring,
        "format": fmt,
        "acc_norm": result.acc_norm if fmt.harness else None,
        "acc_norm_ci95": list(result.acc_norm_ci95) if fmt.harness else None,
        "mc_loss": result.mc_loss,
        "mc_loss_ci95": list(result.mc_loss_ci95),
        "mc_chance": result.mc_chance,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "exclude_seeds": args.exclude_seed,
        "seconds": round(result.seconds, 3),
    }


def _result_text(result: Any, args: argparse.Namespace, fmt: EvalFormat) -> str:
    """The one line printed without --json."""
    import torch

    lo, hi = result.ci95
    adapter = f" + {args.adapter}" if args.adapter else ""
    norm = ""
    if fmt.harness:
        nlo, nhi = result.acc_norm_ci95
        norm = f"acc_norm {result.acc_norm:.4f} (95% CI {nlo:.4f}-{nhi:.4f}), "
    mlo, mhi = result.mc_loss_ci95
    return (
        f"{result.task}: accuracy {result.accuracy:.4f} (95% CI {lo:.4f}-{hi:.4f}), {norm}"
        f"n = {result.n}, {result.seconds:.1f} s; most-frequent label "
        f"{result.majority:.4f}, chance {result.chance:.4f}; mc_loss {result.mc_loss:.4f} "
        f"(95% CI {mlo:.4f}-{mhi:.4f}, chance {result.mc_chance:.4f}); eval_loss "
        f"{result.loss:.4f} [{args.model}{adapter}, {args.dtype} on {args.device}, format "
        f"{fmt}, scoring {result.scoring}, threads {torch.get_num_threads()}]"
    )


def _refuse_non_finite(result, args: argparse.Namespace) -> None:
    """A DataError when any question's scores are NaN or ±inf: an accuracy from them (the
    arg-max of NaNs) would be a number that means nothing."""
    import math

    bad = [
        i for i, (mc, nll) in enumerate(zip(result.mc, result.nll)) if not math.isfinite(mc + nll)
    ]
    if bad:
        adapter = f" with --adapter {args.adapter!r}" if args.adapter else ""
        raise DataError(
            f"--model {args.model!r}{adapter} gives non-finite scores (NaN or inf) on "
            f"{len(bad)} of the {result.n} questions (the first: #{bad[0]}): its weights hold "
            f"NaN or inf, or overflow in --dtype {args.dtype}; no accuracy reported"
        )


def _run_lm_eval(args: argparse.Namespace, model, tokenizer, examples, task: str) -> int:
    """`fedlora eval --harness`: lm-eval's `simple_evaluate` on the records (offline)."""
    import tempfile
    import time

    import numpy as np

    from fedlora.llm.eval_stats import wilson_interval
    from fedlora.llm.lm_eval_bridge import run_lm_eval

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedlora-lm-eval-") as work:
        res = run_lm_eval(
            model,
            tokenizer,
            examples,
            work,
            batch_size=args.batch_size,
            quiet=not getattr(args, "verbose", False),  # lm-eval's logs and bars: --verbose
        )
    seconds = time.perf_counter() - t0
    qs = [res[i] for i in range(len(examples))]
    n, acc = len(qs), int(sum(q.acc for q in qs))
    norms = [q.acc_norm for q in qs if not np.isnan(q.acc_norm)]
    acc_norm = sum(norms) / n if len(norms) == n else None
    out = {
        "accuracy": acc / n,
        "n": n,
        "ci95": list(wilson_interval(acc, n)),
        "acc_norm": acc_norm,
        "acc_norm_ci95": list(wilson_interval(int(sum(norms)), n))
        if acc_norm is not None
        else None,
        "task": task,
        "lm_eval_task": qs[0].task,
        "model": args.model,
        "adapter": args.adapter,
        "format": EvalFormat.HARNESS,
        "evaluator": "lm-eval",
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "seconds": round(seconds, 3),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    lo, hi = out["ci95"]
    norm = ""
    if acc_norm is not None:
        nlo, nhi = out["acc_norm_ci95"]
        norm = f"acc_norm {acc_norm:.4f} (95% CI {nlo:.4f}-{nhi:.4f}), "
    adapter = f" + {args.adapter}" if args.adapter else ""
    print(
        f"{task} (lm-eval {qs[0].task}): acc {acc / n:.4f} (95% CI {lo:.4f}-{hi:.4f}), {norm}"
        f"n = {n}, {seconds:.1f} s [lm-evaluation-harness's evaluator, {args.model}{adapter}, "
        f"{args.dtype} on {args.device}]"
    )
    return 0
