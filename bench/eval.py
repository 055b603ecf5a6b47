"""Evaluation inside a run: today's path against the frozen-layer eval cache, side by side.

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
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="arc-e")
    ap.add_argument("--n", type=int, default=100, help="eval questions (seeded subset)")
    ap.add_argument("--k", type=int, default=8, help="LoRA on the top K layers")
    ap.add_argument("--scoring", default="label", choices=("label", "option", "option_norm"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--evals", type=int, default=3, help="evaluations per path")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()

    from fedlora.config import LoraConfig
    from fedlora.data import load_task, resolve_data_dir, seeded_subset, stream_rng
    from fedlora.evaluation import eval_cache_for, evaluate
    from fedlora.lora import inject_lora
    from fedlora.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    examples = seeded_subset(
        load_task(args.task, resolve_data_dir(""), "test"), args.n, stream_rng(0, "eval", args.task)
    )
    model, tok = load_model(args.model, dtype="fp32", progress=False)
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


if __name__ == "__main__":
    main()
