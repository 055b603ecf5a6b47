"""The CPU-protocol pilot of issue 13 (rule: docs/cpu_protocol.md, fixed before it ran).

Trains each pilot setting with the real engine (`fedlora.federation.engine.run_experiment`), then scores
its final global adapter on the same 500 ARC-e test questions, once, in this process; the
untrained adapter is scored once per protocol (not once per run: it is the same model).
One JSON line per finished entry goes to `results/cpu_pilot/pilot.jsonl` (entries already
there are skipped, so a killed pilot resumes). `--summarize` applies the rule.

    nohup .venv/bin/python bench/cpu_pilot.py > pilot.log 2>&1 &
    .venv/bin/python bench/cpu_pilot.py --summarize
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EVAL_TASK, EVAL_N, SEED = "arc-e", 500, 0

COMMON = [
    "model.name=smollm2-135m",
    "model.dtype=bf16",
    "model.threads=2",
    "lora.rank=16",
    'lora.target_modules=["q_proj", "v_proj"]',
    "lora.layers=8",
    'data.tasks=["arc-e", "arc-c", "obqa"]',
    'data.eval_tasks=["arc-e"]',
    "data.train_limit=400",
    "data.eval_limit=10",  # in-run evaluation only as a smoke check: the pilot scores 500 here
    "data.max_seq_len=128",
    "data.n_clients=10",
    "data.dirichlet_alpha=0.1",
    "training.local_steps=5",
    "training.batch_size=4",
    "training.slots=5",
    "training.checkpoint_every=100",
    f"training.seed={SEED}",
    "evaluation.predictions=false",
    "output.progress=false",
]
METHODS = {
    "fedavg": ["method.name=fedavg", "method.clients_per_round=0", "training.rounds=6"],
    "alg1": [
        "method.name=sketched",
        "method.q=fixed",
        "method.q_fixed=0.2",
        "method.k=uniform",
        "training.rounds=30",
    ],
}
PROTOCOLS = {  # protocol -> (data.response, the scorings reported)
    "label": ("label", ("label",)),
    "option": ("option", ("option_norm", "option")),
}


def entry(name: str, protocol: str, method: str | None = None, lr=None, step=None) -> dict:
    return {"name": name, "protocol": protocol, "method": method, "lr": lr, "sketch_step": step}


# The grid, most informative first (docs/cpu_protocol.md): baselines, then runs.
GRID = [
    entry("untrained-label", "label"),
    entry("fedavg-label-lr0.2", "label", "fedavg", 0.2, "paper"),
    entry("alg1-label-lr0.2-paper", "label", "alg1", 0.2, "paper"),
    entry("alg1-label-lr0.2-scaled", "label", "alg1", 0.2, "scaled"),
    entry("untrained-option", "option"),
    entry("fedavg-option-lr0.2", "option", "fedavg", 0.2, "paper"),
    entry("alg1-option-lr0.2-scaled", "option", "alg1", 0.2, "scaled"),
    entry("alg1-label-lr0.5-scaled", "label", "alg1", 0.5, "scaled"),
    entry("fedavg-label-lr0.05", "label", "fedavg", 0.05, "paper"),
]


def load1() -> float:
    return os.getloadavg()[0]


def overrides(e: dict, out: Path) -> list[str]:
    response, scorings = PROTOCOLS[e["protocol"]]
    return [
        *COMMON,
        *METHODS[e["method"]],
        f"data.response={response}",
        f"evaluation.scoring={scorings[0]}",
        f"training.lr={e['lr']}",
        f"training.sketch_step={e['sketch_step']}",
        f"output.dir={json.dumps(str(out))}",
        f"output.name={e['name']}",
    ]


class Scorer:
    """The 500 questions and a bf16 SmolLM2 with the pilot's LoRA layout, for every entry."""

    def __init__(self, threads: int) -> None:
        import torch

        from fedlora.config import DataConfig, LoraConfig
        from fedlora.llm.data import load_eval_sets
        from fedlora.llm.lora import inject_lora
        from fedlora.llm.models import load_model

        torch.set_num_threads(threads)
        self.model, self.tok = load_model("smollm2-135m", dtype="bf16", progress=False)
        self.lora = inject_lora(
            self.model, LoraConfig(rank=16, layers=8), slots=1, seed=0
        )  # B = 0: the untrained adapter until load_global
        cfg = DataConfig(eval_tasks=(EVAL_TASK,), eval_limit=EVAL_N)
        self.examples = load_eval_sets(cfg, SEED)[EVAL_TASK]
        self.untrained = self.lora.global_state()

    def score(self, state, protocol: str) -> dict:
        """Accuracy, Wilson interval, eval_loss and per-question results per scoring."""
        import torch

        from fedlora.llm.evaluation import (
            candidate_scores,
            discriminative_start,
            majority_score,
            scoring_items,
            wilson_interval,
        )
        from fedlora.llm.scoring import token_logprobs

        self.lora.load_global(state)
        self.lora.set_clients(torch.ones(1, 16))
        scorings = PROTOCOLS[protocol][1]
        t0 = time.perf_counter()
        items = scoring_items(self.examples, self.tok, scorings[0])  # option & option_norm: same
        lps = token_logprobs(self.model, self.tok, items, batch_size=16, share_prompt=True)
        seconds = time.perf_counter() - t0
        nll = []
        for ex, (_, tails), tok_lps in zip(self.examples, items, lps):
            gold = ex.labels.index(ex.answer)
            nll.append(-float(np.mean(tok_lps[gold][discriminative_start(tails) :])))
        n = len(self.examples)
        loss = float(np.mean(nll))
        half = 1.959963984540054 * float(np.std(nll, ddof=1)) / math.sqrt(n)
        out = {"n": n, "eval_seconds": seconds, "eval_loss": loss}
        out["eval_loss_ci95"] = [loss - half, loss + half]
        out["nll"] = [round(v, 5) for v in nll]
        for sc in scorings:
            preds = [
                int(np.argmax(candidate_scores(ex, t, sc))) for ex, t in zip(self.examples, lps)
            ]
            correct = [int(ex.labels[p] == ex.answer) for ex, p in zip(self.examples, preds)]
            out[sc] = {
                "accuracy": sum(correct) / n,
                "ci95": list(wilson_interval(sum(correct), n)),
                "pred": preds,
                "correct": correct,
            }
        top = max({ex.answer for ex in self.examples}, key=[e.answer for e in self.examples].count)
        maj = [int(ex.answer == top) for ex in self.examples]
        out["majority"] = {
            "label": top,
            "accuracy": majority_score(self.examples),
            "ci95": list(wilson_interval(sum(maj), n)),
            "correct": maj,
        }
        return out


def run_entry(e: dict, scorer: Scorer, out: Path) -> dict:
    from fedlora.config import load_config
    from fedlora.federation.engine import load_checkpoint, prepare_run_dir, run_experiment

    rec = dict(e, load_before=load1())
    if e["method"] is None:
        rec.update(scorer.score(scorer.untrained, e["protocol"]))
    else:
        cfg = load_config(None, overrides(e, out))
        run_dir = out / e["name"]
        prepare_run_dir(cfg, run_dir, overwrite=True)
        t0 = time.perf_counter()
        summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: print(m, flush=True))
        rec["train_seconds"] = time.perf_counter() - t0
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rec["client_steps"] = cfg.training.local_steps * sum(x["n_participants"] for x in lines)
        rec["train_loss"] = [x["train_loss"] for x in lines if x["train_loss"] is not None]
        rec["rounds"] = summary.get("rounds")
        rec.update(scorer.score(load_checkpoint(run_dir)["global"], e["protocol"]))
    rec["load_after"] = load1()
    return rec


# ----------------------------------------------------------------------------- the rule


def paired_z(a: list[int] | list[float], b: list[int] | list[float]) -> float:
    """mean(a - b) / (sd(a - b) / √n): paired over the same questions."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    sd = float(np.std(d, ddof=1))
    if sd == 0:
        return 0.0 if d.mean() == 0 else math.copysign(math.inf, d.mean())
    return float(d.mean() / (sd / math.sqrt(d.size)))


def prior_nll(answers: list[str]) -> float:
    """eval_loss of the label-prior predictor: the entropy of the gold-label frequencies (the
    best constant distribution over labels, in nats per question)."""
    _, counts = np.unique(answers, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def prior_lines(records: list[dict]) -> list[str]:
    from fedlora.config import DataConfig
    from fedlora.llm.data import load_eval_sets

    if not any(r["protocol"] == "label" for r in records):
        return []
    examples = load_eval_sets(DataConfig(eval_tasks=(EVAL_TASK,), eval_limit=EVAL_N), SEED)
    answers = [ex.answer for ex in examples[EVAL_TASK]]
    counts = {a: answers.count(a) for a in sorted(set(answers))}
    return [
        f"gold labels of the {len(answers)} questions: {counts}; label-prior eval_loss "
        f"(entropy of these frequencies) = {prior_nll(answers):.3f} nats"
    ]


def summarize(records: list[dict]) -> str:
    base = {r["protocol"]: r for r in records if r["method"] is None}
    rows, lines = [], []
    for r in records:
        if r["method"] is None or r["protocol"] not in base:
            continue
        u = base[r["protocol"]]
        sc = PROTOCOLS[r["protocol"]][1][0]
        acc, uacc = r[sc]["accuracy"], u[sc]["accuracy"]
        m = r["majority"]
        z_u = paired_z(r[sc]["correct"], u[sc]["correct"])
        z_m = paired_z(r[sc]["correct"], m["correct"])
        lo, hi = r[sc]["ci95"]
        passes = (
            acc - max(uacc, m["accuracy"]) >= 0.08 and lo > u[sc]["ci95"][1] and lo > m["ci95"][1]
        )
        z_loss = paired_z(u["nll"], r["nll"])
        rows.append((min(z_u, z_m), r["protocol"] == "label", -r["lr"], r, passes, z_loss))
        lines.append(
            f"| {r['name']} | {sc} | {100 * acc:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | "
            f"{100 * uacc:.1f} | {100 * m['accuracy']:.1f} | {z_u:+.2f} | {z_m:+.2f} | "
            f"{r['eval_loss']:.3f} ({u['eval_loss']:.3f}) | {z_loss:+.2f} | "
            f"{r['client_steps']} | {r['train_seconds'] / 60:.1f} + "
            f"{r['eval_seconds'] / 60:.1f} | {r['load_before']:.1f} | {'yes' if passes else 'no'} |"
        )
    head = [
        "| setting | scoring | accuracy % [Wilson 95%] | untrained % | majority % | z vs "
        "untrained | z vs majority | eval_loss (untrained) | z loss decrease | client-steps"
        " | train + eval min | load | passes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, u in base.items():
        for sc in PROTOCOLS[p][1]:
            lo, hi = u[sc]["ci95"]
            lines.insert(
                0,
                f"| untrained ({p}) | {sc} | {100 * u[sc]['accuracy']:.1f} [{100 * lo:.1f}, "
                f"{100 * hi:.1f}] | | {100 * u['majority']['accuracy']:.1f} | | | "
                f"{u['eval_loss']:.3f} | | 0 | 0 + {u['eval_seconds'] / 60:.1f} | "
                f"{u['load_before']:.1f} | |",
            )
    text = "\n".join(head + lines)
    text += "".join(f"\n\n{x}" for x in prior_lines(records))
    if rows:
        best = max(rows, key=lambda x: (x[0], x[1], x[2]))
        text += f"\n\nchosen by the rule: {best[3]['name']} (margin z = {best[0]:+.2f}); "
        text += "passes acceptance" if best[4] else "does NOT pass acceptance"
        if not any(x[4] for x in rows):
            by_loss = max(rows, key=lambda x: x[5])
            text += (
                f"\nno setting passes: eval_loss is primary; largest paired loss decrease: "
                f"{by_loss[3]['name']} (z = {by_loss[5]:+.2f})"
            )
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results/cpu_pilot/pilot.jsonl")
    ap.add_argument("--out", default="runs/cpu_pilot", help="where the pilot's runs go")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="entry names to run (default: the whole grid)")
    ap.add_argument("--summarize", action="store_true", help="apply the rule and exit")
    args = ap.parse_args()
    results = Path(args.results)
    done = (
        [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
        if results.exists()
        else []
    )
    if args.summarize:
        print(summarize(done))
        return
    results.parent.mkdir(parents=True, exist_ok=True)
    scorer = Scorer(args.threads)
    names = {r["name"] for r in done}
    for e in GRID:
        if e["name"] in names or (args.only and e["name"] not in args.only):
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {e['name']} (load {load1():.1f})", flush=True)
        rec = run_entry(e, scorer, Path(args.out))
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        sc = PROTOCOLS[e["protocol"]][1][0]
        print(
            f"[{time.strftime('%H:%M:%S')}] {e['name']}: {sc} {rec[sc]['accuracy']:.3f} "
            f"eval_loss {rec['eval_loss']:.3f} (load {load1():.1f})",
            flush=True,
        )
    print(summarize(done + [json.loads(x) for x in results.read_text().splitlines()][len(done) :]))


if __name__ == "__main__":
    sys.exit(main())
