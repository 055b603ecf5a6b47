"""fp32 vs bf16 speed of local training on the real SmolLM2-135M, as the CPU pilot trains.

One setting, the pilot's: LoRA rank 16 on q,v of the top 8 layers, 5 clients per
forward/backward (training.slots), batch 4, commonsense-mix examples (max_seq_len 128), the
frozen-layer cache on. Per dtype it times `local_train` on fresh examples (cache misses: the
first round a client joins) and on the same examples again (cache hits: later rounds), and
prints seconds per client-step.

    .venv/bin/python bench/pilot_dtype.py --threads 2 --steps 3
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import numpy as np
    import torch

    from fedlora.config import DataConfig, LoraConfig
    from fedlora.llm.data import build_federated_data, client_batches
    from fedlora.llm.lora import inject_lora
    from fedlora.llm.models import load_model
    from fedlora.llm.train import layer_cache_for, local_train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="local steps H per client")
    ap.add_argument("--slots", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = DataConfig(tasks=("arc-e", "arc-c", "obqa"), train_limit=400, n_clients=10)
    print(f"threads={args.threads} slots={args.slots} H={args.steps} batch=4 rank=16 layers=8")
    for dtype in ("fp32", "bf16"):
        model, tok = load_model("smollm2-135m", dtype=dtype, progress=False)
        lora = inject_lora(model, LoraConfig(), slots=args.slots, seed=0)
        fed = build_federated_data(data, tok, seed=0)
        cache = layer_cache_for(model, lora)
        scales = torch.ones(args.slots, 16)
        cold, warm = [], []
        for rep in range(args.repeats + 1):  # rep 0: warm-up (allocations, first calls)
            batches = [
                client_batches(
                    fed,
                    c % 10,
                    args.steps,
                    4,
                    np.random.default_rng(100 * rep + c),
                    tok.pad_token_id,
                )
                for c in range(args.slots)
            ]
            for out in (cold, warm):  # the second call hits the cache
                lora.set_clients(scales)
                t0 = time.perf_counter()
                local_train(model, lora, batches, 1e-3, autocast_bf16=dtype == "bf16", cache=cache)
                if rep:
                    out.append((time.perf_counter() - t0) / (args.slots * args.steps))
        print(
            f"{dtype}: {np.median(cold):.3f} s/client-step on new examples (cache fill), "
            f"{np.median(warm):.3f} s/client-step on cached examples"
        )


if __name__ == "__main__":
    main()
