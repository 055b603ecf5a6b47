"""Evaluation speed, side by side in one process: fedlora's scorer against lm-eval in fp32
and bf16 (``--mode lmeval``, the default), the scoring paths (``--mode pairs``) or the
frozen-layer eval cache (``--mode cache``).

``--mode lmeval``: per precision (fp32, then bf16: stored in bf16, as `load_model` gives it),
on the same questions of `--task` in lm-evaluation-harness's zero-shot format:

- lm-eval        : lm-eval's `simple_evaluate` with its HFLM on the model instance, offline
                   (`fedlora.llm.lm_eval_bridge.run_lm_eval`), batch `--batch-size`
- fedlora cold   : `evaluate` standalone (`fedlora eval`: no cache)
- fedlora in-run : LoRA on the top `--k` layers, the eval cache (memory, and the disk store in
                   a temporary folder); the first evaluation fills it, the later ones (a new
                   adapter each, as after a round) are timed: "warm"

Wall and CPU seconds (this process, all threads) of each, the ratios to lm-eval (goals: warm
>= 4x less CPU than lm-eval; cold never slower), acc of each and the questions whose acc
differs from lm-eval's, the CPU flags and the load; `--json PATH` writes the figures.

    .venv/bin/python bench/eval.py --threads 2 --json eval.json           # ~2-4 min
    .venv/bin/python bench/eval.py --threads 2 --n 500 --json eval.json   # the issue's size

``--mode pairs``: lm-evaluation-harness's requests (evaluation.format = "harness") for the same
questions, scored three ways by `fedlora.llm.scoring.pair_logliks`:

- per-option    : one (context, continuation) request per forward, as a plain cloze scorer
                  (and lm-eval's own loop, one request at a time) does
- per-option b. : the same full sequences, `--batch-size` questions' requests per forward
- shared        : each question's context once with a KV cache, then only the continuations,
                  `--batch-size` questions per forward (what `evaluate` runs)

prints questions/s of each and the speed-up (target >= 3x over per-option), and checks the
scores are the same (max |diff| of the summed log-likelihoods, acc predictions that differ).
The paths take turns on chunks of `--chunk` questions (rotating order), so that a change of a
shared machine's load mid-run falls on every path alike; CPU seconds are printed beside wall
seconds.

    .venv/bin/python bench/eval.py --threads 2 --n 200

``--mode cache``: today's path against the frozen-layer eval cache.

With LoRA on the top K of L decoder layers, the lower L-K layers of the fixed eval set cannot
change during a run. Runs, in one process, on the same questions and the same adapter:

- today     : `evaluate` as before (each prompt once with a KV cache, the candidates' label
              tokens after it): all L layers every evaluation
- cache 1st : the first evaluation with `eval_cache_for`: one packed row per question (the
              prompt, then every candidate's tail, each attending to the prompt and itself),
              all L layers, the lower L-K layers' output stored
- cache 2nd+: every later evaluation: only the top K layers, the norm and the LM head at the
              scored positions

and checks that the predictions are equal and the per-question eval_loss agrees (max |diff|).
Between evaluations the global adapter changes (as after a round), so the top K layers must
be recomputed: the target is later evaluations <= 1.3 * K / L of today's time.

    .venv/bin/python bench/eval.py --threads 1
    .venv/bin/python bench/eval.py --threads 2 --n 200 --k 8 --scoring option_norm
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="lmeval", choices=("lmeval", "pairs", "cache"))
    ap.add_argument("--precisions", default="fp32,bf16", help="--mode lmeval")
    ap.add_argument("--json", default="", help="--mode lmeval: write the figures here")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="arc-e")
    ap.add_argument("--n", type=int, default=100, help="eval questions (seeded subset)")
    ap.add_argument("--k", type=int, default=8, help="LoRA on the top K layers")
    ap.add_argument("--scoring", default="label", choices=("label", "option", "option_norm"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--chunk", type=int, default=16, help="--mode pairs: questions per interleaved chunk"
    )
    ap.add_argument("--evals", type=int, default=3, help="evaluations per path")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()

    from fedlora.config import LoraConfig
    from fedlora.llm.data import seeded_subset, stream_rng
    from fedlora.llm.evaluation import eval_cache_for, evaluate
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.models import load_model
    from fedlora.llm.tasks import load_task, resolve_data_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    examples = seeded_subset(
        load_task(args.task, resolve_data_dir(""), "test"), args.n, stream_rng(0, "eval", args.task)
    )
    if args.mode == "lmeval":
        return bench_lmeval(examples, args)
    model, tok = load_model(args.model, dtype="fp32", progress=False)
    if args.mode == "pairs":
        return bench_pairs(model, tok, examples, args)
    n_layers = model.config.num_hidden_layers
    lora = inject_lora(model, LoraConfig(rank=16, layers=args.k), slots=1, seed=0)
    gen = torch.Generator().manual_seed(0)
    states = [
        {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in lora.global_state().items()}
        for _ in range(args.evals)
    ]
    cache = eval_cache_for(model, lora, 4096.0)
    assert cache is not None, "nothing to cache: is lora.layers < the number of layers?"

    def timed(use_cache: bool, state: dict) -> tuple[float, object]:
        lora.load_global(state)  # a new global adapter, as after a round
        lora.set_clients(torch.ones(1, 16))
        t0 = time.perf_counter()
        r = evaluate(
            model,
            tok,
            examples,
            batch_size=args.batch_size,
            scoring=args.scoring,
            cache=cache if use_cache else None,
        )
        return time.perf_counter() - t0, r

    print(
        f"{args.model}, {args.task}, n = {len(examples)}, LoRA on the top K = {args.k} of "
        f"L = {n_layers} layers, scoring {args.scoring}, batch {args.batch_size}, "
        f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}"
    )
    rows = []
    worst_pred, worst_nll = 0, 0.0
    for e, state in enumerate(states):
        t_today, r_today = timed(False, state)
        t_cache, r_cache = timed(True, state)
        worst_pred += sum(a != b for a, b in zip(r_today.predictions, r_cache.predictions))
        worst_nll = max(worst_nll, float(np.max(np.abs(np.subtract(r_today.nll, r_cache.nll)))))
        rows.append((e + 1, t_today, t_cache, r_today.accuracy, r_today.loss))
    print("| evaluation | today (s) | cached (s) | cached / today | accuracy | eval_loss |")
    print("|---|---|---|---|---|---|")
    for e, t_today, t_cache, acc, loss in rows:
        print(
            f"| {e} | {t_today:.2f} | {t_cache:.2f} | {t_cache / t_today:.3f} | {acc:.3f} | "
            f"{loss:.4f} |"
        )
    target = 1.3 * args.k / n_layers
    if len(rows) > 1:
        # the ratio of the summed times: one slow evaluation on a loaded machine weighs as
        # much as it lasted, not as a ratio of its own
        ratio = sum(r[2] for r in rows[1:]) / sum(r[1] for r in rows[1:])
        print(
            f"later evaluations: cached / today = {ratio:.3f} (sum over evaluations 2..; "
            f"target <= 1.3 K/L = {target:.3f}: {'met' if ratio <= target else 'NOT met'}); "
            f"speed-up {1 / ratio:.2f}x"
        )
    print(
        f"predictions that differ: {worst_pred}; max |eval_loss diff| per question: "
        f"{worst_nll:.2e}; cache: {cache.stats()}"
    )


def _timed(fn, *a, **kw):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0, time.process_time() - c0


def bench_lmeval(examples, args) -> None:
    """--mode lmeval: lm-eval, fedlora cold and fedlora in-run warm, per precision."""
    import json
    import tempfile
    from pathlib import Path

    from fedlora.config import LoraConfig
    from fedlora.llm import disk_cache
    from fedlora.llm.device import cpu_flags
    from fedlora.llm.evaluation import eval_cache_for, evaluate
    from fedlora.llm.lm_eval_bridge import run_lm_eval
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.models import load_model

    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
             if f in cpu_flags()]  # fmt: skip
    load = os.getloadavg()
    print(
        f"{args.model}, {args.task}, n = {len(examples)}, harness format, batch "
        f"{args.batch_size}, threads {torch.get_num_threads()}, CPU flags {' '.join(flags)}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (cpus {os.cpu_count()})"
    )
    report = {"n": len(examples), "task": args.task, "threads": torch.get_num_threads(),
              "cpu_flags": flags, "load_start": list(load), "args": vars(args), "rows": {}}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="fedlora-bench-eval-"))
    for i, prec in enumerate(args.precisions.split(",")):
        model, tok = load_model(args.model, dtype=prec, progress=False)
        if i == 0:  # lm-eval's one-off imports and set-up, not counted (each run's are)
            run_lm_eval(model, tok, examples[:2], work / "warm-up", batch_size=args.batch_size)
        lm, lm_wall, lm_cpu = _timed(
            run_lm_eval, model, tok, examples, work / f"lm-{prec}", batch_size=args.batch_size
        )
        lm_acc = [lm[i].acc == 1.0 for i in range(len(examples))]
        cold, cold_wall, cold_cpu = _timed(
            evaluate, model, tok, examples, batch_size=args.batch_size, fmt="harness"
        )
        lora = inject_lora(model, LoraConfig(rank=16, layers=args.k), slots=1, seed=0)
        disk = disk_cache.disk_store(work / f"disk-{prec}", 4096.0)
        cache = eval_cache_for(model, lora, 4096.0, disk=disk)
        gen = torch.Generator().manual_seed(0)
        warm_wall = warm_cpu = 0.0
        for e in range(max(2, args.evals)):
            lora.load_global(
                {k: torch.randn(v.shape, generator=gen) * 0.02
                 for k, v in lora.global_state().items()}
            )  # fmt: skip
            lora.set_clients(torch.ones(1, 16))
            _, wall, cpu = _timed(
                evaluate, model, tok, examples, batch_size=args.batch_size, fmt="harness",
                cache=cache,
            )  # fmt: skip
            if e == 0:
                first_wall, first_cpu = wall, cpu
            else:
                warm_wall, warm_cpu = warm_wall + wall, warm_cpu + cpu
        later = max(2, args.evals) - 1
        warm_wall, warm_cpu = warm_wall / later, warm_cpu / later
        lora.remove()
        rows = {
            "lm-eval": (lm_wall, lm_cpu, sum(lm_acc) / len(lm_acc), 0),
            "fedlora cold (standalone)": (
                cold_wall, cold_cpu, cold.accuracy,
                sum(a != b for a, b in zip(cold.correct, lm_acc)),
            ),
            "fedlora in-run, 1st (cache filled)": (first_wall, first_cpu, float("nan"), -1),
            "fedlora in-run, warm": (warm_wall, warm_cpu, float("nan"), -1),
        }  # fmt: skip
        print(f"\n{prec}:")
        print(
            "| path | wall s | CPU s | lm-eval CPU / CPU | lm-eval wall / wall | acc | acc differs |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, (wall, cpu, acc, differ) in rows.items():
            report["rows"][f"{name} {prec}"] = {
                "path": name, "precision": prec, "wall_s": wall, "cpu_s": cpu, "acc": acc,
                "acc_differs_from_lm_eval": differ,
            }  # fmt: skip
            print(
                f"| {name} | {wall:.1f} | {cpu:.1f} | {lm_cpu / cpu:.2f}x | {lm_wall / wall:.2f}x "
                f"| {acc:.3f} | {differ if differ >= 0 else '-'} |",
                flush=True,
            )
        print(
            f"{prec}: in-run warm uses {lm_cpu / warm_cpu:.2f}x less CPU than lm-eval (goal >= 4x:"
            f" {'met' if lm_cpu >= 4 * warm_cpu else 'NOT met'}); cold {lm_cpu / cold_cpu:.2f}x "
            f"CPU, {lm_wall / cold_wall:.2f}x wall (goal >= 1x: "
            f"{'met' if cold_cpu <= lm_cpu and cold_wall <= lm_wall else 'NOT met'})"
        )
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # lm-eval's task files and the disk store
    report["load_end"] = list(os.getloadavg())
    print(f"(load average at end {report['load_end'][0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"figures: {args.json}")


def bench_pairs(model, tok, examples, args) -> None:
    """--mode pairs: per-option, per-option batched and shared-context scoring of lm-eval's
    requests on the same questions."""
    from fedlora.llm.harness import acc_pred, harness_request
    from fedlora.llm.scoring import pair_logliks

    reqs = [harness_request(ex) for ex in examples]
    pairs = [p for r in reqs for p in r.pairs]
    print(
        f"{args.model}, {args.task}, n = {len(reqs)} questions ({len(pairs)} requests), harness "
        f"format, batch {args.batch_size}, threads {torch.get_num_threads()}, load "
        f"{os.getloadavg()[0]:.2f}"
    )
    paths = {
        "per-option": {"batch_size": 1, "share_prompt": False},
        "per-option batched": {"batch_size": args.batch_size, "share_prompt": False},
        "shared": {"batch_size": args.batch_size, "share_prompt": True},
    }
    # Interleaved: every chunk of questions goes through the three paths in turn (the order
    # rotating), so that a change of the shared machine's load mid-run hits every path alike.
    # CPU seconds (this process) beside wall seconds: less sensitive to other jobs.
    times = dict.fromkeys(paths, 0.0)
    cpu = dict.fromkeys(paths, 0.0)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in paths}
    names = list(paths)
    step = max(1, args.chunk)
    for c, lo in enumerate(range(0, len(reqs), step)):
        chunk = [p for r in reqs[lo : lo + step] for p in r.pairs]
        for name in names[c % 3 :] + names[: c % 3]:
            t0, c0 = time.perf_counter(), time.process_time()
            parts[name].append(np.asarray(pair_logliks(model, tok, chunk, **paths[name])))
            times[name] += time.perf_counter() - t0
            cpu[name] += time.process_time() - c0
    scores = {name: np.concatenate(parts[name]) for name in paths}

    def preds(lls: np.ndarray) -> list[int]:
        out, k = [], 0
        for r in reqs:
            out.append(acc_pred(lls[k : k + len(r.pairs)]))
            k += len(r.pairs)
        return out

    ref = scores["per-option"]
    acc = np.mean([p == r.gold for p, r in zip(preds(ref), reqs)])
    print(
        "| path | wall s | questions/s | speed-up (wall) | CPU s | speed-up (CPU) | "
        "max abs diff (nats) | acc differs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in paths:
        diff = float(np.max(np.abs(scores[name] - ref)))
        differ = sum(a != b for a, b in zip(preds(scores[name]), preds(ref)))
        print(
            f"| {name} | {times[name]:.1f} | {len(reqs) / times[name]:.2f} | "
            f"{times['per-option'] / times[name]:.2f}x | {cpu[name]:.1f} | "
            f"{cpu['per-option'] / cpu[name]:.2f}x | {diff:.1e} | {differ} |"
        )
    ratio = times["per-option"] / times["shared"]
    print(
        f"acc {acc:.4f}; shared vs per-option: {ratio:.2f}x wall, "
        f"{cpu['per-option'] / cpu['shared']:.2f}x CPU (target >= 3x: "
        f"{'met' if ratio >= 3 else 'NOT met'}); {step} questions per chunk; "
        f"load now {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
