"""The timings ``model.dtype = "auto"`` decides from on a CPU with native bf16 (the decision
is `fedlora.llm.device.resolve_dtype`'s): the same work in fp32 and in bf16, timed now.

- `run_step_probe`: a run's own training step (`time_precisions`), kept for
  `STEP_PROBE_TTL_S` by the runs of one process with the same model, adapter, shape and
  threads (a suite's runs share one timing).
- `bf16_probe`: one training-shaped matmul, where no run's shapes are known (`fedlora eval`).

A matmul probe measured once and kept says nothing about a machine that is busy now (bf16 on
AMX collapses under contention, fp32 much less), nor about the run's shapes. So for a run the
run's model is loaded in each precision (bf16: stored in bf16, eager attention, autocast; as
the run would), LoRA of the run's rank is attached to the run's target modules of the top K
layers, and a few SGD steps of a random batch of the run's shape are timed: the LM head at
the target positions only, the backward down to the lowest LoRA layer, as `local_train`
does. The precisions take turns, so a load change falls on both alike; the fastest step of
each is kept.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = [
    "STEP_PROBE_TTL_S",
    "bf16_probe",
    "probe_shape",
    "run_step_probe",
    "time_precisions",
]

SEQ_CAP = 64  # tokens per row: a padded batch's length in the harness format (p99 ~75)


def probe_shape(cfg: Any) -> tuple[int, int, int]:
    """(rows, tokens, target tokens) of the timed step: `training.slots` clients of
    `training.batch_size` rows, min(`data.max_seq_len`, 64) tokens, the last quarter
    carrying the loss."""
    rows = int(cfg.training.batch_size) * int(cfg.training.slots)
    seq = max(4, min(int(cfg.data.max_seq_len), SEQ_CAP))
    return rows, seq, max(1, seq // 4)


def _attach_lora(model: Any, lora_cfg: Any) -> list[Any]:
    """LoRA factors (fp32, trainable) on the run's targets, added by forward hooks."""
    import torch

    from fedlora.llm.lora_targets import find_targets

    gen = torch.Generator().manual_seed(0)
    params: list[Any] = []
    modules = dict(model.named_modules())
    for name in find_targets(model, lora_cfg):
        lin = modules[name]
        a = (torch.randn(lora_cfg.rank, lin.in_features, generator=gen) * 0.01).requires_grad_()
        b = (torch.randn(lin.out_features, lora_cfg.rank, generator=gen) * 0.01).requires_grad_()
        params += [a, b]

        def hook(mod, inputs, out, a=a, b=b, s=lora_cfg.scaling):
            return out + (inputs[0] @ a.t().to(inputs[0].dtype)) @ b.t().to(out.dtype) * s

        lin.register_forward_hook(hook)
    return params


def _step(model: Any, params: list[Any], batch: dict[str, Any], bf16: bool) -> float:
    """Seconds of one SGD step (target-only LM head, as `local_train`)."""
    import torch
    import torch.nn.functional as F

    decoder = getattr(model, getattr(model, "base_model_prefix", "model"))
    head = model.get_output_embeddings()
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = decoder(input_ids=batch["ids"], attention_mask=batch["mask"]).last_hidden_state
        sel = batch["sel"]
        logits = head(hidden[:, :-1][sel]).float()
        loss = F.cross_entropy(logits, batch["ids"][:, 1:][sel])
    loss.backward()
    with torch.no_grad():
        for p in params:
            p.sub_(p.grad, alpha=1e-3)
            p.grad = None
    return time.perf_counter() - t0


def time_precisions(cfg: Any, *, steps: int = 3, device: str = "cpu") -> dict[str, float]:
    """Seconds of one training step of `cfg`'s run in fp32 and in bf16 (fastest of `steps`
    each, after one warm-up step each, the precisions alternating): {"fp32_s", "bf16_s"}."""
    import torch

    from fedlora.llm.models import load_model

    rows, seq, target = probe_shape(cfg)
    cache_dir = cfg.model.cache_dir or None
    setups = {}
    for dtype in ("fp32", "bf16"):
        model, _ = load_model(
            cfg.model.name, dtype=dtype, cache_dir=cache_dir, progress=False, device=device
        )
        setups[dtype] = (model, _attach_lora(model, cfg.lora))
    vocab = int(setups["fp32"][0].get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, seq), generator=gen)
    sel = torch.zeros(rows, seq - 1, dtype=torch.bool)
    sel[:, -target:] = True
    batch = {"ids": ids, "mask": torch.ones_like(ids), "sel": sel}
    best = {"fp32": float("inf"), "bf16": float("inf")}
    for i in range(steps + 1):  # the first of each is a warm-up
        for dtype in ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32"):
            model, params = setups[dtype]
            seconds = _step(model, params, batch, dtype == "bf16")
            if i > 0:
                best[dtype] = min(best[dtype], seconds)
    return {"fp32_s": best["fp32"], "bf16_s": best["bf16"]}


def _time_step(dtype: Any, tokens: int, d_in: int, d_out: int, repeats: int) -> float:
    """Fastest of `repeats` forward + input-gradient matmuls shaped like a frozen linear
    layer in training (weights frozen, as the base model's)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(d_out, d_in, generator=gen) * 0.02).to(dtype)
    x0 = torch.randn(tokens, d_in, generator=gen).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        x = x0.clone().requires_grad_(True)
        t0 = time.perf_counter()
        y = x @ w.t()
        y.sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def bf16_probe(
    *, tokens: int = 512, d_in: int = 576, d_out: int = 1536, repeats: int = 5
) -> dict[str, float]:
    """Seconds of one training-shaped matmul (forward + backward to the input) in fp32 and in
    bf16, fastest of `repeats`, measured now at the current torch thread count: what
    ``dtype = auto`` decides from where no run's shapes are known (`fedlora eval`).

    The default shape is SmolLM2-135M's MLP up-projection on a 4 x 128-token batch."""
    import torch

    fp32_s = _time_step(torch.float32, tokens, d_in, d_out, repeats)
    bf16_s = _time_step(torch.bfloat16, tokens, d_in, d_out, repeats)
    return {"fp32_s": fp32_s, "bf16_s": bf16_s, "what": "matmul probe"}


# (model, lora, shape, threads) -> (monotonic time, figures): a suite's runs started within
# STEP_PROBE_TTL_S of each other share one timing
_STEP_TIMINGS: dict[tuple, tuple[float, dict[str, float]]] = {}
STEP_PROBE_TTL_S = 600.0


def run_step_probe(cfg: Any) -> dict[str, Any]:
    """One training step of `cfg`'s run timed in fp32 and in bf16, now (`time_precisions`);
    reused for STEP_PROBE_TTL_S by the runs of this process with the same model, adapter,
    shape and threads."""
    import torch

    shape = probe_shape(cfg)
    key = (cfg.model.name, cfg.model.cache_dir, cfg.lora, shape, torch.get_num_threads())
    now = time.monotonic()
    known = _STEP_TIMINGS.get(key)
    what = f"training step of {shape[0]} x {shape[1]} tokens"
    if known is not None and now - known[0] < STEP_PROBE_TTL_S:
        return {**known[1], "what": f"{what}, timed {now - known[0]:.0f} s ago"}
    figures = time_precisions(cfg)
    _STEP_TIMINGS[key] = (now, figures)
    return {**figures, "what": what}
