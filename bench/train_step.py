"""Client-steps per second of local LoRA training on a SmolLM2-135M-shaped model.

Prints, side by side in one run, for fp32 and bf16 (bf16 = frozen base stored in bf16, eager
attention, autocast; LoRA weights stay fp32):

- peft deep-copy   : a fresh deep copy of the PEFT model per client, H SGD steps each
- peft swap        : one PEFT model; per client, copy the global adapter in, H steps, read out
- fedlora C=1      : `local_train` with one slot (LM head only at target tokens)
- fedlora C=<slots>: `local_train` with <slots> clients in one forward/backward

The model is random-initialised from SmolLM2-135M's config (30 layers, hidden 576, 9 heads,
3 kv heads, intermediate 1536, vocab 49152): speed does not depend on the weights. Each
example has `--seq` tokens of which the last `--target` are the response (loss tokens).

    .venv/bin/python bench/train_step.py --threads 2
    .venv/bin/python bench/train_step.py --slots 10 --steps 3   # needs ~15 GB in fp32
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


def peft_steps(model, batches, lr: float, bf16: bool) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for batch in batches:
        with autocast(bf16):
            loss = model(**batch).loss  # full-logit loss, as a plain PEFT loop computes it
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(p.grad, alpha=lr)
                p.grad = None


def peft_model(base, rank: int):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, cfg)


def bench_deepcopy(base, batches, rank, lr, bf16) -> float:
    template = peft_model(copy.deepcopy(base), rank)
    t0 = time.perf_counter()
    for client in batches:
        model = copy.deepcopy(template)
        peft_steps(model, client, lr, bf16)
        _ = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    return time.perf_counter() - t0


def bench_swap(base, batches, rank, lr, bf16) -> float:
    model = peft_model(copy.deepcopy(base), rank)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    global_state = {n: p.detach().clone() for n, p in lora.items()}
    t0 = time.perf_counter()
    for client in batches:
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(global_state[n])
        peft_steps(model, client, lr, bf16)
        _ = {n: p.detach().clone() for n, p in lora.items()}
    return time.perf_counter() - t0


def bench_fedlora(base, batches, rank, lr, bf16, slots: int) -> float:
    from fedlora.config import LoraConfig
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.train import local_train

    model = copy.deepcopy(base)
    cfg = LoraConfig(rank=rank, alpha=2.0 * rank, layers="all")  # q,v on all 30 layers
    lora = inject_lora(model, cfg, slots=slots)
    t0 = time.perf_counter()
    for start in range(0, len(batches), slots):
        chunk = batches[start : start + slots]
        lora.set_clients(torch.ones(len(chunk), rank))
        local_train(model, lora, chunk, lr, autocast_bf16=bf16)
        _ = [lora.slot_state(i) for i in range(len(chunk))]
    lora.remove()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--target", type=int, default=16, help="response (loss) tokens per example")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2, help="local steps H per client")
    ap.add_argument("--clients", type=int, default=2, help="clients for the PEFT loops and C=1")
    ap.add_argument("--slots", type=int, default=5, help="C of the batched fedlora run")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(
        f"SmolLM2-135M-shaped, batch {args.batch}, seq {args.seq} ({args.target} target tokens),"
        f" rank {args.rank}, q,v on all 30 layers, H = {args.steps} steps per client"
    )
    results: dict[tuple[str, str], float] = {}
    for prec in args.precisions.split(","):
        bf16 = prec == "bf16"
        base = smollm2_shaped(torch.bfloat16 if bf16 else torch.float32)
        small = make_batches(args.clients, args.steps, args.batch, args.seq, args.target)
        big = make_batches(args.slots, args.steps, args.batch, args.seq, args.target, seed=1)
        # warm-up: one step each path (allocator, thread pools)
        bench_fedlora(base, [small[0][:1]], args.rank, args.lr, bf16, 1)
        runs = [
            ("peft deep-copy", "deepcopy", small, 1),
            ("peft swap", "swap", small, 1),
            ("fedlora C=1", "fedlora", small, 1),
            (f"fedlora C={args.slots}", "fedlora", big, args.slots),
        ]
        for name, kind, data, slots in runs:
            if kind == "deepcopy":
                seconds = bench_deepcopy(base, data, args.rank, args.lr, bf16)
            elif kind == "swap":
                seconds = bench_swap(base, data, args.rank, args.lr, bf16)
            else:
                seconds = bench_fedlora(base, data, args.rank, args.lr, bf16, slots)
            rate = len(data) * args.steps / seconds
            results[(name, prec)] = rate
            print(
                f"  {prec:5s} {name:16s} {rate:6.3f} client-steps/s  ({seconds:.1f} s)", flush=True
            )
    precs = args.precisions.split(",")
    names = list(dict.fromkeys(n for n, _ in results))
    print()
    print(
        "| path | "
        + " | ".join(f"{p} steps/s" for p in precs)
        + " | "
        + " | ".join(f"{p} vs swap" for p in precs)
        + (" | bf16 / fp32 |" if {"fp32", "bf16"} <= set(precs) else " |")
    )
    print("|---" * (1 + 2 * len(precs) + ({"fp32", "bf16"} <= set(precs))) + "|")
    for n in names:
        cells = [f"{results[(n, p)]:.3f}" for p in precs]
        cells += [f"{results[(n, p)] / results[('peft swap', p)]:.2f}x" for p in precs]
        if {"fp32", "bf16"} <= set(precs):
            cells.append(f"{results[(n, 'bf16')] / results[(n, 'fp32')]:.2f}x")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print(f"(threads {torch.get_num_threads()}; load average at end {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
