"""Local LoRA training at the paper's shape on a GPU: PEFT adapter-swap vs fedlora, and the
seconds of one Table-I round.

The model is random-initialised from Qwen2.5-1.5B-Instruct's config (28 layers, hidden 1536,
12 heads, 2 kv heads, intermediate 8960, vocab 151936; speed does not depend on the weights),
stored in `--dtype` (default bf16: bf16 base, fp32 LoRA weights, bf16 autocast, SDPA
attention). Each example has `--seq` tokens (default 256) of which the last `--target` are the
response; batch 4, LoRA rank 16 on q_proj and v_proj of every layer, plain SGD. Printed, in
one run:

- peft swap        : one PEFT model; per client, copy the global adapter in, H steps (full
                     logits, as a plain PEFT loop computes its loss), read the adapter out
- fedlora C=1      : `fedlora.train.local_train` with one slot (LM head only at the targets)
- fedlora C=<slots>: <slots> clients in one forward/backward
- one Table-I round: N = 50 clients, independent sampling with q = 0.2, k uniform in 1..γ,
  H = `--steps` local steps each, trained `--slots` at a time, then the unbiased aggregation;
  seconds from the first batch to the aggregated global adapter (CUDA synchronised)

    .venv/bin/python bench/gpu.py                              # needs CUDA (or --device mps)
    .venv/bin/python bench/gpu.py --device cpu --shape tiny    # a smoke test of this script

Exits with status 2 and a message when the device is not there.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES = {
    # Qwen2.5-1.5B-Instruct's config.json (the paper's model)
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # a few MB: for checking this script where no GPU is at hand
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
}


def paper_shaped(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], use_cache=False)
    # SDPA on a GPU; eager for bf16 on a CPU (fedlora.models does the same)
    cpu_bf16 = device == "cpu" and dtype == torch.bfloat16
    cfg._attn_implementation = "eager" if cpu_bf16 else "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)  # default init: speed does not need more
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def make_batches(clients: int, steps: int, b: int, seq: int, target: int, vocab: int, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(clients):
        row = []
        for _ in range(steps):
            ids = torch.randint(3, vocab, (b, seq), generator=gen)
            labels = torch.full((b, seq), -100)
            labels[:, -target:] = ids[:, -target:]
            row.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        out.append(row)
    return out


def sync(device: str) -> None:
    from fedlora.device import synchronize

    synchronize(device)


def bench_swap(base, batches, rank: int, lr: float, bf16: bool, device: str) -> float:
    from peft import LoraConfig, get_peft_model

    from fedlora.device import autocast_context

    model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]),
    )
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in lora.values():
        p.data = p.data.float()  # fp32 master LoRA weights, as fedlora
    global_state = {n: p.detach().clone() for n, p in lora.items()}
    sync(device)
    t0 = time.perf_counter()
    for client in batches:
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(global_state[n])
        for batch in client:
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast_context(torch.device(device).type, bf16):
                loss = model(**batch).loss
            loss.backward()
            with torch.no_grad():
                for p in lora.values():
                    p.sub_(p.grad, alpha=lr)
                    p.grad = None
        _ = {n: p.detach().cpu() for n, p in lora.items()}
    sync(device)
    return time.perf_counter() - t0


def fedlora_lora(base, rank: int, slots: int):
    from fedlora.config import LoraConfig
    from fedlora.lora import inject_lora

    model = copy.deepcopy(base)
    return model, inject_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank, layers="all"), slots)


def bench_fedlora(model, lora, batches, lr: float, bf16: bool, device: str, scales=None) -> float:
    from fedlora.train import local_train

    rank, slots = lora.rank, lora.slots
    states = []
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, len(batches), slots):
        chunk = batches[start : start + slots]
        s = torch.ones(len(chunk), rank) if scales is None else scales[start : start + len(chunk)]
        lora.set_clients(s)
        local_train(model, lora, chunk, lr, autocast_bf16=bf16)
        states += [lora.slot_state(i) for i in range(len(chunk))]
    sync(device)
    return time.perf_counter() - t0, states


def table1_round(model, lora, args, bf16: bool, vocab: int) -> tuple[float, int]:
    """One round of Algorithm 1 at N = 50, q = 0.2, k ~ U{1..γ}: (seconds, participants)."""
    from fedlora.sketch import sample_participants, sketch_scale_vectors, unbiased_aggregate

    rng = np.random.default_rng(args.seed)
    n, gamma = 50, args.rank
    q = np.full(n, 0.2)
    who = sample_participants(q, rng)
    k = rng.integers(1, gamma + 1, size=who.size)
    scales = torch.tensor(sketch_scale_vectors(gamma, k, rng), dtype=torch.float32)
    batches = make_batches(who.size, args.steps, args.batch, args.seq, args.target, vocab, seed=2)
    global_np = {k_: v.numpy() for k_, v in lora.global_state().items()}
    sync(args.device)
    t0 = time.perf_counter()
    _, states = bench_fedlora(model, lora, batches, args.lr, bf16, args.device, scales)
    client_np = [{k_: v.numpy() for k_, v in s.items()} for s in states]
    new_global = unbiased_aggregate(global_np, client_np, 1.0 / n / q[who])  # a_n = 1/N
    lora.load_global({k_: torch.from_numpy(v) for k_, v in new_global.items()})
    sync(args.device)
    return time.perf_counter() - t0, int(who.size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, mps or cpu (default cuda)")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--target", type=int, default=16, help="response (loss) tokens per example")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="local steps H (paper_table1: 10)")
    ap.add_argument("--clients", type=int, default=4, help="clients for swap and C=1")
    ap.add_argument("--slots", type=int, default=5, help="C of the batched path and the round")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    ap.add_argument("--skip-round", action="store_true", help="no Table-I round")
    args = ap.parse_args()

    from fedlora.device import resolve_device
    from fedlora.errors import ConfigError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        args.device = resolve_device(args.device, "--device")
    except ConfigError as e:
        print(f"bench/gpu.py: {e}", file=sys.stderr)
        return 2
    bf16 = args.dtype == "bf16"
    name = (
        torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
    )
    print(
        f"torch {torch.__version__}, device {args.device} ({name}), dtype {args.dtype} base + fp32 "
        f"LoRA, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{args.shape}-shaped (random init), batch {args.batch}, seq {args.seq} "
        f"({args.target} target tokens), rank {args.rank} on q,v of every layer, "
        f"H = {args.steps}"
    )
    vocab = SHAPES[args.shape]["vocab_size"]
    base = paper_shaped(args.shape, torch.bfloat16 if bf16 else torch.float32, args.device)
    small = make_batches(args.clients, args.steps, args.batch, args.seq, args.target, vocab)
    big = make_batches(args.slots, args.steps, args.batch, args.seq, args.target, vocab, seed=1)
    rows: list[tuple[str, float, float]] = []

    # warm-up of every path (allocator, kernels), then the timed runs
    bench_swap(base, [small[0][:1]], args.rank, args.lr, bf16, args.device)
    seconds = bench_swap(base, small, args.rank, args.lr, bf16, args.device)
    rows.append(("peft swap", len(small) * args.steps / seconds, seconds))
    for slots, data in ((1, small), (args.slots, big)):
        model, lora = fedlora_lora(base, args.rank, slots)
        bench_fedlora(model, lora, [c[:1] for c in data[:slots]], args.lr, bf16, args.device)
        seconds, _ = bench_fedlora(model, lora, data, args.lr, bf16, args.device)
        rows.append((f"fedlora C={slots}", len(data) * args.steps / seconds, seconds))
        if slots == args.slots and not args.skip_round:
            round_s, m = table1_round(model, lora, args, bf16, vocab)
        del model, lora
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated(args.device) / 2**30
        print(f"peak memory allocated: {peak:.1f} GiB")
    print()
    print("| path | client-steps/s | vs peft swap | seconds |")
    print("|---|---|---|---|")
    for label, rate, seconds in rows:
        print(f"| {label} | {rate:.3f} | {rate / rows[0][1]:.2f}x | {seconds:.2f} |")
    if not args.skip_round:
        print(
            f"\none Table-I round (N = 50, q = 0.2: {m} participants, H = {args.steps}, "
            f"{args.slots} slots per pass): {round_s:.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
