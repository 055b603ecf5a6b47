"""Client-steps per second of local LoRA training on a SmolLM2-135M-shaped model, against the
field's usual client loop, with each path's GFLOP/s beside a torch.mm of the same dtype.

Prints, side by side in one run, for fp32 and bf16 (bf16 = frozen base stored in bf16, eager
attention, autocast; LoRA weights stay fp32), LoRA (q,v, rank 16) on the top `--k` layers:

- peft adamw       : the field's client loop: one PEFT model; per client, the global adapter
                     copied in, a new torch.optim.AdamW, H steps of the full-logit loss
- peft sgd         : the same loop with plain SGD steps
- fedlora C=1      : `local_train` with one slot (LM head only at target tokens), no cache
- fedlora C=<slots>: `local_train` with <slots> clients in one forward/backward, no cache
- fedlora C=<slots> warm: the same with the frozen-layer cache warm (every example seen
                     before, as on every round after a client's first; in a suite or study,
                     from the disk cache)
- fedlora C=<slots> warm adamw: the same with a new per-slot AdamW per client (SlotAdamW,
                     `training.optimizer = "adamw"`): the like-for-like of the PEFT AdamW loop

Each path's FLOPs per client-step are counted by torch's FlopCounterMode (matmuls and
attention, forward and backward); GFLOP/s = those FLOPs / the time, and "% of mm" compares it
with torch.mm of a (batch*seq, hidden) x (hidden, intermediate) product in the same dtype at
the same threads (what the machine's matmuls reach). The goal line: fedlora warm >= 4x the
PEFT AdamW loop in client-steps/s (both warm paths are checked). The CPU flags and the load average are printed: timings
taken beside other jobs are not comparable across machines or runs, only side by side.

The model is random-initialised from SmolLM2-135M's config (30 layers, hidden 576, 9 heads,
3 kv heads, intermediate 1536, vocab 49152): speed does not depend on the weights. Each
example has `--seq` tokens of which the last `--target` are the response (loss tokens).

    .venv/bin/python bench/train_step.py --threads 2 --json train_step.json   # ~2-4 min
    .venv/bin/python bench/train_step.py --threads 2 --k 0 --steps 3          # LoRA on all 30
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYERS = 30
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def smollm2_shaped(dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        use_cache=False,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    cfg._attn_implementation = "eager" if dtype == torch.bfloat16 else "sdpa"
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def make_batches(clients: int, steps: int, b: int, seq: int, target: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(clients):
        row = []
        for _ in range(steps):
            ids = torch.randint(3, 49152, (b, seq), generator=gen)
            labels = torch.full((b, seq), -100)
            labels[:, -target:] = ids[:, -target:]
            row.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        out.append(row)
    return out


def autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def cpu_flags() -> list[str]:
    from fedlora.llm.device import cpu_flags as flags

    have = flags()
    return [f for f in FLAGS if f in have]


def peft_model(base, rank: int, k: int):
    from peft import LoraConfig, get_peft_model

    layers = list(range(LAYERS - k, LAYERS)) if k else None
    cfg = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
        layers_to_transform=layers,
    )  # fmt: skip
    return get_peft_model(copy.deepcopy(base), cfg)


class Peft:
    """One PEFT model; per client: the global adapter in, H steps (AdamW or SGD), read out."""

    def __init__(self, base, rank: int, k: int, lr: float, bf16: bool, adamw: bool) -> None:
        self.model = peft_model(base, rank, k)
        self.lora = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.global_state = {n: p.detach().clone() for n, p in self.lora.items()}
        self.lr, self.bf16, self.adamw = lr, bf16, adamw

    def __call__(self, batches) -> None:
        params = list(self.lora.values())
        for client in batches:
            with torch.no_grad():
                for n, p in self.lora.items():
                    p.copy_(self.global_state[n])
            opt = (
                torch.optim.AdamW(params, lr=self.lr)
                if self.adamw
                else torch.optim.SGD(params, lr=self.lr)
            )
            for batch in client:
                with autocast(self.bf16):
                    loss = self.model(**batch).loss  # full-logit loss, as a PEFT loop computes
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            _ = {n: p.detach().clone() for n, p in self.lora.items()}


class Fedlora:
    """`local_train` on `slots` clients per forward/backward, optionally the layer cache."""

    def __init__(
        self, base, rank: int, k: int, lr: float, bf16: bool, slots: int, cache: bool,
        adamw: bool = False,
    ):  # fmt: skip
        from fedlora.config import LoraConfig
        from fedlora.llm.layer_cache import LayerCache
        from fedlora.llm.lora import inject_lora

        self.model = copy.deepcopy(base)
        cfg = LoraConfig(rank=rank, alpha=2.0 * rank, layers=k or "all")
        self.lora = inject_lora(self.model, cfg, slots=slots)
        self.cache = LayerCache(self.model, self.lora) if cache else None
        self.rank, self.lr, self.bf16, self.slots, self.adamw = rank, lr, bf16, slots, adamw

    def __call__(self, batches) -> None:
        from fedlora.llm.train import local_train

        for start in range(0, len(batches), self.slots):
            chunk = batches[start : start + self.slots]
            self.lora.set_clients(torch.ones(len(chunk), self.rank))
            optimizer = None
            if self.adamw:  # a new AdamW per client and round (the field's convention)
                from fedlora.llm.client_optim import SlotAdamW

                optimizer = SlotAdamW(self.lora)
            local_train(
                self.model, self.lora, chunk, self.lr, autocast_bf16=self.bf16, cache=self.cache,
                optimizer=optimizer,
            )  # fmt: skip
            _ = [self.lora.slot_state(i) for i in range(len(chunk))]


def flops_per_client_step(path, batches) -> float:
    """FLOPs of one client-step of `path` (FlopCounterMode over one step of every client)."""
    from torch.utils.flop_counter import FlopCounterMode

    one = [client[:1] for client in batches]
    with FlopCounterMode(display=False) as counter:
        path(one)
    return counter.get_total_flops() / len(one)


def mm_gflops(dtype: torch.dtype, m: int, k: int, n: int, repeats: int = 10) -> float:
    """GFLOP/s of torch.mm (m, k) x (k, n) in `dtype`, fastest of `repeats`."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--target", type=int, default=16, help="response (loss) tokens per example")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--k", type=int, default=8, help="LoRA on the top K layers (0 = all 30)")
    ap.add_argument("--steps", type=int, default=2, help="local steps H per client")
    ap.add_argument("--clients", type=int, default=2, help="clients of the PEFT loops and C=1")
    ap.add_argument("--slots", type=int, default=5, help="C of the batched fedlora runs")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", default="", help="write the figures to this JSON file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()
    flags = cpu_flags()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU flags "
        f"{' '.join(flags) or 'none of ' + ' '.join(FLAGS)}, load average {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f} (cpus {os.cpu_count()})"
    )
    where = f"the top K = {args.k}" if args.k else "all 30"
    print(
        f"SmolLM2-135M-shaped, batch {args.batch}, seq {args.seq} ({args.target} target tokens),"
        f" rank {args.rank}, q,v on {where} layers, H = {args.steps} steps per client"
    )
    report = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_flags": flags,
        "load_start": list(load), "args": vars(args), "paths": {},
    }  # fmt: skip
    precs = args.precisions.split(",")
    c = args.slots
    names = ["peft adamw", "peft sgd", "fedlora C=1", f"fedlora C={c}", f"fedlora C={c} warm",
             f"fedlora C={c} warm adamw"]  # fmt: skip
    for prec in precs:
        bf16 = prec == "bf16"
        dtype = torch.bfloat16 if bf16 else torch.float32
        base = smollm2_shaped(dtype)
        small = make_batches(args.clients, args.steps, args.batch, args.seq, args.target)
        big = make_batches(c, args.steps, args.batch, args.seq, args.target, seed=1)
        common = (base, args.rank, args.k, args.lr, bf16)
        paths = {
            names[0]: (Peft(*common, adamw=True), small),
            names[1]: (Peft(*common, adamw=False), small),
            names[2]: (Fedlora(*common, 1, cache=False), small),
            names[3]: (Fedlora(*common, c, cache=False), big),
            names[4]: (Fedlora(*common, c, cache=args.k > 0), big),
            names[5]: (Fedlora(*common, c, cache=args.k > 0, adamw=True), big),
        }
        peak = mm_gflops(dtype, args.batch * args.seq, 576, 1536)
        report[f"mm_gflops_{prec}"] = peak
        print(f"  {prec}: torch.mm ({args.batch * args.seq}x576)x(576x1536): {peak:.1f} GFLOP/s")
        for path, data in paths.values():  # warm-up: allocator, thread pools; the cache filled
            path([client[:1] for client in data])
        for name in names[4:]:  # every example of the warm paths seen once
            paths[name][0](big)
        for name, (path, data) in paths.items():
            t0 = time.perf_counter()
            path(data)
            seconds = time.perf_counter() - t0
            steps = len(data) * args.steps
            flops = flops_per_client_step(path, data)
            rate = steps / seconds
            report["paths"][f"{name} {prec}"] = {
                "path": name, "precision": prec, "client_steps_per_s": rate, "seconds": seconds,
                "gflop_per_client_step": flops / 1e9, "gflops": flops * rate / 1e9,
                "share_of_mm": flops * rate / 1e9 / peak,
            }  # fmt: skip
            print(
                f"  {prec:5s} {name:24s} {rate:6.3f} client-steps/s ({seconds:.1f} s), "
                f"{flops / 1e9:.1f} GFLOP/client-step, {flops * rate / 1e9:.1f} GFLOP/s",
                flush=True,
            )
    rows = report["paths"]
    print()
    print(
        "| path | "
        + " | ".join(f"{p} steps/s | {p} GFLOP/s | {p} % of mm | {p} vs peft adamw" for p in precs)
        + (" | bf16 / fp32 |" if {"fp32", "bf16"} <= set(precs) else " |")
    )
    print("|---" * (1 + 4 * len(precs) + ({"fp32", "bf16"} <= set(precs))) + "|")
    for n in names:
        cells = []
        for p in precs:
            r = rows[f"{n} {p}"]
            cells += [
                f"{r['client_steps_per_s']:.3f}",
                f"{r['gflops']:.1f}",
                f"{100 * r['share_of_mm']:.0f}%",
                f"{r['client_steps_per_s'] / rows[f'peft adamw {p}']['client_steps_per_s']:.2f}x",
            ]
        if {"fp32", "bf16"} <= set(precs):
            cells.append(
                f"{rows[f'{n} bf16']['client_steps_per_s'] / rows[f'{n} fp32']['client_steps_per_s']:.2f}x"
            )
        print(f"| {n} | " + " | ".join(cells) + " |")
    for p in precs:
        for name in names[4:]:
            ratio = (
                rows[f"{name} {p}"]["client_steps_per_s"]
                / rows[f"peft adamw {p}"]["client_steps_per_s"]
            )
            report[f"{name.replace(' ', '_')}_vs_peft_adamw_{p}"] = ratio
            print(
                f"{p}: {name} vs peft adamw: {ratio:.2f}x (goal >= 4x: "
                f"{'met' if ratio >= 4 else 'NOT met'})"
            )
    report["load_end"] = list(os.getloadavg())
    print(f"(threads {torch.get_num_threads()}; load average at end {report['load_end'][0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
