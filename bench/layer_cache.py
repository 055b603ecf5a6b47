"""Speed-up of the frozen-layer cache with LoRA on the top K layers (SmolLM2-135M-shaped, fp32).

Runs, side by side in one process, `local_train` with LoRA (q,v) on the top K of 30 layers:

- no cache  : every step runs all 30 layers forward (backward stops at layer 30-K)
- cache cold: first visit of every example: the lower 30-K layers are computed once (no
              grad, padded to the misses' longest row) and stored, then the top K run
- cache warm: the same examples again (a client's partition is reused every round it joins):
              only the top K layers, the final norm and the target-only LM head run
- disk warm : a new memory cache whose examples an earlier run left in the disk store
              (`model.disk_cache_mb`): a later run's or evaluation's first visit, read
              from disk instead of computed

and checks that the losses and the trained adapters of the three runs agree (max |diff|).
The model is random-initialised from SmolLM2-135M's config (see bench/train_step.py).

    .venv/bin/python bench/layer_cache.py --threads 1
    .venv/bin/python bench/layer_cache.py --threads 2 --k 4 --steps 3 --slots 2
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import make_batches, smollm2_shaped  # noqa: E402


def run(model, lora, batches, lr: float, cache) -> tuple[float, np.ndarray, list[dict]]:
    """Seconds, losses (c, H) and slot states of one `local_train` call from the global adapter."""
    from fedlora.llm.train import local_train

    lora.set_clients(torch.ones(len(batches), lora.rank))
    t0 = time.perf_counter()
    losses = local_train(model, lora, batches, lr, cache=cache)
    seconds = time.perf_counter() - t0
    return seconds, losses, [lora.slot_state(i) for i in range(len(batches))]


def max_diff(a: list[dict], b: list[dict]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--k", type=int, default=4, help="LoRA on the top K of the 30 layers")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--target", type=int, default=16, help="response (loss) tokens per example")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="local steps H per client")
    ap.add_argument("--slots", type=int, default=1, help="clients trained together (C)")
    ap.add_argument("--cache-dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--repeats", type=int, default=2, help="interleaved repeats; the fastest of each is shown"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from fedlora.config import LoraConfig
    from fedlora.llm.disk_cache import DiskStore
    from fedlora.llm.layer_cache import LayerCache
    from fedlora.llm.lora import inject_lora

    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, cpus {os.cpu_count()}"
    )
    print(
        f"SmolLM2-135M-shaped fp32, batch {args.batch}, seq {args.seq} ({args.target} target "
        f"tokens), rank {args.rank}, q,v on the top K = {args.k} of 30 layers, "
        f"C = {args.slots} slot(s), H = {args.steps} steps"
    )
    model = smollm2_shaped(torch.float32)
    cfg = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, layers=args.k)
    lora = inject_lora(model, cfg, slots=args.slots, seed=0)
    gen = torch.Generator().manual_seed(1)  # a non-zero B, so the adapter matters
    lora.load_global(
        {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in lora.global_state().items()}
    )
    batches = make_batches(args.slots, args.steps, args.batch, args.seq, args.target)
    warm = make_batches(args.slots, 1, args.batch, args.seq, args.target, seed=99)
    run(model, lora, warm, args.lr, None)  # warm-up: allocator, thread pools
    run(model, lora, warm, args.lr, LayerCache(model, lora))

    times: dict[str, list[float]] = {
        "no cache": [], "cache cold": [], "cache warm": [], "disk warm": []
    }  # fmt: skip
    store_root = Path(tempfile.mkdtemp(prefix="fedlora-bench-disk-"))
    for rep in range(args.repeats):  # interleaved, so a load change hits every path alike
        cache = LayerCache(model, lora, dtype=args.cache_dtype)  # empty: a cold start
        t_plain, l_plain, s_plain = run(model, lora, batches, args.lr, None)
        t_cold, l_cold, s_cold = run(model, lora, copy.deepcopy(batches), args.lr, cache)
        t_warm, l_warm, s_warm = run(model, lora, copy.deepcopy(batches), args.lr, cache)
        store = DiskStore(store_root / str(rep), 4096.0)  # an earlier run fills it (untimed)
        run(model, lora, copy.deepcopy(batches), args.lr, LayerCache(model, lora, disk=store))
        later = LayerCache(model, lora, dtype=args.cache_dtype, disk=store)  # a new run
        t_disk, l_disk, s_disk = run(model, lora, copy.deepcopy(batches), args.lr, later)
        for name, t in zip(times, (t_plain, t_cold, t_warm, t_disk)):
            times[name].append(t)
    shutil.rmtree(store_root, ignore_errors=True)
    stats = cache.stats()

    steps = args.slots * args.steps
    rows = [(name, min(ts)) for name, ts in times.items()]
    t_plain = rows[0][1]
    print()
    print(f"fastest of {args.repeats} interleaved repeats:")
    print("| path | client-steps/s | s per client-step | speed-up vs no cache | all runs (s) |")
    print("|---|---|---|---|---|")
    for name, seconds in rows:
        every = ", ".join(f"{t:.1f}" for t in times[name])
        print(
            f"| {name} | {steps / seconds:.3f} | {seconds / steps:.2f} | "
            f"{t_plain / seconds:.2f}x | {every} |"
        )
    print()
    print(
        f"agreement with no cache: losses max |diff| cold {np.abs(l_cold - l_plain).max():.2e}, "
        f"warm {np.abs(l_warm - l_plain).max():.2e}; adapters max |diff| cold "
        f"{max_diff(s_cold, s_plain):.2e}, warm {max_diff(s_warm, s_plain):.2e}; disk warm "
        f"losses {np.abs(l_disk - l_plain).max():.2e}, adapters {max_diff(s_disk, s_plain):.2e}"
    )
    print(
        f"cache: {stats['entries']} examples, {stats['mb']:.1f} MB ({args.cache_dtype}), "
        f"{stats['cached_layers']} layers cached, hits {stats['hits']}, misses {stats['misses']}"
    )
    print(f"(threads {torch.get_num_threads()}; load average at end {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
