"""model.device / model.dtype: resolution, clean errors, and that tensors follow the device.

The main test of the tensor-moving code paths runs the engine with the model on torch's
`meta` device under a dispatch mode that records every op whose tensor arguments sit on more
than one device: a tensor created on a hard-coded device (the CPU) inside training,
aggregation or evaluation shows up there, as it would on a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fedlora.llm.device as dev
from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.llm.device import (
    activation_bytes_per_slot,
    choose_dtype,
    cpu_flags,
    inherit_auto,
    resolve_device,
    resolve_dtype,
    resolve_runtime,
    slots_for_memory,
)

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
needs_data = pytest.mark.skipif(not Path(DATA).is_dir(), reason="commonsense data not found")

TINY = [
    "model.name=tiny-llama",
    "model.threads=1",
    f'data.data_dir="{DATA}"',
    'data.tasks=["arc-e", "boolq"]',
    "data.train_limit=24",
    "data.eval_limit=6",
    "data.max_seq_len=96",
    "data.n_clients=3",
    "data.min_client_examples=4",
    "lora.rank=4",
    'lora.layers="all"',
    "training.rounds=2",
    "training.local_steps=2",
    "training.batch_size=2",
    "training.slots=2",
    "training.eval_every=1",
    "training.checkpoint_every=1",
    "training.lr=0.05",
    "method.q=[1.0, 1.0, 0.5]",
    "method.k=[1, 2, 4]",
    "output.progress=false",
]

CPUINFO_BF16 = """processor\t: 0
model name\t: Some Xeon
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""
CPUINFO_AMX = "model name\t: Sapphire\nflags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
CPUINFO_PLAIN = "model name\t: Older Xeon\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "_mps_available", lambda: False)


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(dev, "_mps_available", lambda: False)


def _probe(speedup: float, calls: list | None = None):
    def probe() -> dict[str, float]:
        if calls is not None:
            calls.append(1)
        return {"fp32_s": 1.0, "bf16_s": 1.0 / speedup}

    return probe


def _never() -> dict[str, float]:
    raise AssertionError("the probe must not run")


# ----------------------------------------------------------------------------- device


def test_device_auto_prefers_cuda_then_mps_then_cpu(monkeypatch):
    _no_gpu(monkeypatch)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(dev, "_mps_available", lambda: True)
    assert resolve_device("auto") == "mps"
    _fake_gpus(monkeypatch, 2)
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("cuda") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("cpu") == "cpu"


@pytest.mark.parametrize(
    ("spec", "gpus", "available"),
    [
        ("cuda", 0, "available: cpu"),
        ("cuda:0", 0, "available: cpu"),
        ("mps", 0, "available: cpu"),
        ("cuda:2", 2, "available: cpu, cuda:0, cuda:1"),
    ],
)
def test_a_device_that_is_not_there_is_a_config_error_naming_the_available(
    monkeypatch, spec, gpus, available
):
    if gpus:
        _fake_gpus(monkeypatch, gpus)
    else:
        _no_gpu(monkeypatch)
    with pytest.raises(ConfigError) as info:
        resolve_device(spec)
    assert f"model.device = {spec!r} is invalid: not available on this machine; {available}" in str(
        info.value
    )


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "CPU", "", "meta", 0, None])
def test_device_spelling_is_checked(spec):
    with pytest.raises(ConfigError, match=r"model.device = .* is invalid: allowed: auto, cpu"):
        resolve_device(spec)


# ----------------------------------------------------------------------------- dtype


def test_cpu_flags_are_read_from_cpuinfo_text():
    assert {"avx512_bf16", "avx512f"} <= cpu_flags(CPUINFO_BF16)
    assert "avx512_bf16" not in cpu_flags(CPUINFO_PLAIN)
    assert cpu_flags("") == set()


def test_auto_dtype_on_a_cpu_without_native_bf16_is_fp32_without_probing():
    dtype, why = resolve_dtype("auto", "cpu", flags=cpu_flags(CPUINFO_PLAIN), probe=_never)
    assert dtype == "fp32" and "no native bf16" in why


@pytest.mark.parametrize("info", [CPUINFO_BF16, CPUINFO_AMX])
def test_auto_dtype_on_a_cpu_with_native_bf16_follows_the_timings(info):
    flags = cpu_flags(info)
    fast = resolve_dtype("auto", "cpu", flags=flags, probe=_probe(2.0))
    assert fast[0] == "bf16" and "2.00x" in fast[1]
    slow = resolve_dtype("auto", "cpu", flags=flags, probe=_probe(0.5))
    assert slow[0] == "fp32" and "not 1.1x faster" in slow[1]
    # a 5% win is within noise: not enough to leave fp32
    near = resolve_dtype("auto", "cpu", flags=flags, probe=_probe(1.05))
    assert near[0] == "fp32"


def test_choose_dtype_from_injected_timings():
    # bf16 at 1.1x and above; the reason names both timings and what was timed
    assert choose_dtype(1.0, 0.5, "training step") == (
        "bf16",
        "training step: fp32 1 s, bf16 0.5 s, bf16/fp32 speed 2.00x",
    )
    assert choose_dtype(1.1, 1.0)[0] == "bf16"  # exactly the threshold
    assert choose_dtype(1.09, 1.0)[0] == "fp32"
    # a machine where bf16 collapses under load now: fp32
    dtype, why = choose_dtype(2.4, 29.0)
    assert dtype == "fp32" and "bf16 29 s" in why and "not 1.1x faster" in why
    for bad in (0.0, float("nan"), float("inf"), -1.0):  # never bf16 on a broken timing
        assert choose_dtype(1.0, bad)[0] == "fp32" and choose_dtype(bad, 1.0)[0] == "fp32"


def test_auto_times_the_runs_own_step_now_and_a_resume_keeps_the_choice(monkeypatch):
    # Prepare: a CPU with AMX; the run's step timed by an injected timer (no real timings)
    _no_gpu(monkeypatch)
    monkeypatch.setattr(dev, "cpu_flags", lambda cpuinfo=None: cpu_flags(CPUINFO_AMX))
    seen = []

    def timer(cfg):
        seen.append(cfg.training.batch_size)
        return {"fp32_s": 3.0, "bf16_s": 1.0, "what": "training step of 8 x 64 tokens"}

    monkeypatch.setattr(dev, "run_step_probe", timer)
    cfg = load_config(None, ["model.name=tiny-llama", "training.batch_size=8"])
    # Execute
    res = resolve_runtime(cfg)
    resumed = resolve_runtime(res.cfg)  # a resume reads the saved (resolved) config
    # Assert: timed once, on the run's config; the choice and both timings recorded
    assert seen == [8] and res.cfg.model.dtype == "bf16"
    assert res.cfg.model.dtype_choice == (
        "bf16: CPU with amx_bf16; training step of 8 x 64 tokens: fp32 3 s, "
        "bf16 1 s, bf16/fp32 speed 3.00x"
    )
    assert "fp32 3 s, bf16 1 s" in res.describe()
    assert resumed.cfg == res.cfg and seen == [8]  # never re-decided
    assert resumed.dtype_reason.startswith("set in the config; chosen by auto")
    # an explicit dtype is untouched and never timed
    fixed = resolve_runtime(load_config(None, ["model.name=tiny-llama", "model.dtype=fp32"]))
    assert fixed.cfg.model.dtype == "fp32" and fixed.cfg.model.dtype_choice == ""
    assert seen == [8]


def test_the_step_timer_measures_the_runs_shape(monkeypatch):
    # The shape the timer uses: slots x batch rows, min(max_seq_len, 64) tokens
    from fedlora.llm.step_probe import probe_shape

    cfg = load_config(None, ["training.batch_size=4", "training.slots=5"])
    assert probe_shape(cfg) == (20, 64, 16)
    short = load_config(None, ["training.batch_size=2", "training.slots=1", "data.max_seq_len=32"])
    assert probe_shape(short) == (2, 32, 8)


def test_explicit_dtypes_are_kept_and_bad_ones_named(tmp_path):
    flags = cpu_flags(CPUINFO_BF16)
    assert resolve_dtype("fp32", "cpu", flags=flags, probe=_never)[0] == "fp32"
    assert resolve_dtype("bf16", "cpu", flags=set(), probe=_never)[0] == "bf16"
    with pytest.raises(ConfigError, match=r"model.dtype = 'fp16' is invalid: allowed: auto, fp32"):
        resolve_dtype("fp16", "cpu")


def test_auto_dtype_on_gpus(monkeypatch):
    _fake_gpus(monkeypatch, 1, bf16=True)
    dtype, why = resolve_dtype("auto", "cuda:0", probe=_never)
    assert dtype == "bf16" and "fp32 master LoRA weights" in why
    _fake_gpus(monkeypatch, 1, bf16=False)
    assert resolve_dtype("auto", "cuda:0", probe=_never)[0] == "fp32"
    assert resolve_dtype("auto", "mps", probe=_never)[0] == "fp32"


def test_resolve_runtime_gives_concrete_values_and_says_why(monkeypatch, tmp_path):
    _no_gpu(monkeypatch)
    monkeypatch.setattr(dev, "cpu_flags", lambda cpuinfo=None: cpu_flags(CPUINFO_PLAIN))
    res = resolve_runtime(load_config(None, ["model.name=tiny-llama", "model.threads=1"]))
    assert (res.cfg.model.device, res.cfg.model.dtype) == ("cpu", "fp32")
    assert res.describe() == (
        "device cpu (auto: no CUDA or MPS); "
        "dtype fp32 (the CPU has no native bf16 (no avx512_bf16/amx_bf16 flag))"
    )
    again = resolve_runtime(res.cfg)  # idempotent
    assert again.cfg == res.cfg and again.dtype_reason.startswith("set in the config; chosen")
    monkeypatch.setattr(dev, "cpu_flags", lambda cpuinfo=None: cpu_flags(CPUINFO_BF16))
    fresh = load_config(None, ["model.threads=1"])
    bf16 = resolve_runtime(fresh, probe=_probe(4.0))
    assert bf16.cfg.model.dtype == "bf16" and "avx512_bf16" in bf16.dtype_reason


def test_a_resume_keeps_the_device_and_dtype_the_run_started_with():
    saved = load_config(None, ['model.device="cuda:1"', "model.dtype=bf16"])
    given = load_config(None, [])  # auto, auto
    assert inherit_auto(given, saved).model == saved.model
    explicit = load_config(None, ["model.device=cpu", "model.dtype=fp32"])
    assert inherit_auto(explicit, saved) == explicit


# ----------------------------------------------------------------------------- memory


def test_slots_for_memory_hand_computed():
    gib = 2**30
    assert slots_for_memory(8, free_bytes=10 * gib, per_slot_bytes=gib) == 5  # half of 10 GiB
    assert slots_for_memory(4, free_bytes=10 * gib, per_slot_bytes=gib) == 4  # what was asked
    assert slots_for_memory(4, free_bytes=gib, per_slot_bytes=4 * gib) == 1  # at least one
    assert slots_for_memory(4, free_bytes=0, per_slot_bytes=0) == 4
    with pytest.raises(ConfigError, match=r"training.slots = 0 is invalid"):
        slots_for_memory(0, free_bytes=gib, per_slot_bytes=1)


def test_activation_bytes_per_slot_hand_computed():
    from fedlora.llm.tiny_models import tiny_config

    c = tiny_config("tiny-llama")  # hidden 64, intermediate 128, 4 heads
    # per token and layer: 12·64 + 4·128 + 4·T(=10) = 1320; tokens 2·10; layers 2; + d = 64
    got = activation_bytes_per_slot(c, batch_size=2, seq_len=10, trained_layers=2, dtype_bytes=4)
    assert got == 2 * 10 * (2 * 1320 + 64) * 4


# ----------------------------------------------------------------------------- the engine


@needs_data
def test_cuda_on_a_machine_without_one_is_exit_2_before_anything_loads(
    tmp_path, monkeypatch, capsys
):
    _no_gpu(monkeypatch)

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("fedlora.llm.models.load_model", no_load)
    out = tmp_path / "run"
    assert main(["run", *TINY, "model.device=cuda", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "model.device = 'cuda' is invalid: not available on this machine; available: cpu" in err
    assert "Traceback" not in err and not out.exists()


@needs_data
def test_the_run_config_holds_the_resolved_device_and_dtype(tmp_path, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    out = tmp_path / "run"
    overrides = [*TINY, "training.rounds=1"]
    assert main(["run", *overrides, "--out", str(out), "--quiet"]) == 0
    saved = load_config(out / "config.toml")
    assert (saved.model.device, saved.model.dtype) == ("cpu", "fp32")  # auto, auto -> here
    assert "on device cpu (auto: no CUDA or MPS); dtype fp32" in capsys.readouterr().err
    # a resume with the same (auto) overrides is not a config change
    assert main(["run", *overrides, "training.rounds=2", "--resume", str(out), "--force"]) == 0


class DeviceGuard(TorchDispatchMode):
    """Records ops whose tensor arguments lie on more than one device (0-d CPU scalars,
    which torch allows anywhere, excepted). Moving data off the `meta` device to the CPU
    (`.cpu()`, `.item()`, `.tolist()`) returns ones: the engine's host-side bookkeeping runs
    on made-up numbers, so only WHERE tensors are created is under test here."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[tuple[str, tuple[str, ...]]] = []
        self.meta_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        self.meta_ops += "meta" in devices
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default and tensors[0].device.type == "meta":
            return 1.0 if tensors[0].dtype.is_floating_point else 1
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            if tensors[0].device.type == "meta" and target is not None:
                if torch.device(target).type == "cpu":
                    dtype = kwargs.get("dtype") or tensors[0].dtype
                    return torch.ones(tensors[0].shape, dtype=dtype)
            return func(*args, **kwargs)
        if func is aten.copy_.default:  # a transfer: fine in both directions
            if tensors[1].device.type == "meta" and tensors[0].device.type == "cpu":
                return tensors[0].fill_(1)
            return func(*args, **kwargs)
        if len(devices) > 1:
            self.mixed.append((str(func), tuple(sorted(devices))))
        try:
            return func(*args, **kwargs)
        except NotImplementedError:  # no meta kernel (e.g. bincount): shape from zeros on the CPU
            if devices != {"meta"}:
                raise
            host = [
                torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a
                for a in args
            ]
            out = func(*host, **kwargs)
            return torch.empty(out.shape, dtype=out.dtype, device="meta")


@needs_data
@pytest.mark.parametrize(
    "extra",
    [
        ['lora.layers="all"', "method.name=sketched"],  # no layer cache
        ["lora.layers=1", "method.name=sketched"],  # the frozen-layer cache path
        ["lora.layers=1", "method.name=fedstacklora", "method.ranks=[2, 4, 3]"],  # add_to_base
    ],
    ids=["sketched", "sketched-layer-cache", "fedstacklora"],
)
def test_nothing_is_created_on_a_hard_coded_device(tmp_path, monkeypatch, extra):
    """The whole engine (training, aggregation, evaluation, checkpoints) with the model on
    `meta`: no op may mix the model's device with a tensor made on the CPU."""
    import re

    from fedlora.federation.checkpoints import load_checkpoint
    from fedlora.federation.run import prepare_run_dir, run_experiment

    monkeypatch.setattr(dev, "resolve_device", lambda spec, field="model.device": "meta")
    # a test-only device: the config's device syntax accepts meta
    monkeypatch.setattr("fedlora.config.checks.DEVICE_SPEC_RE", re.compile(r"^(auto|meta)$"))
    cfg = load_config(None, [*TINY, *extra])
    run_dir = tmp_path / "meta"
    prepare_run_dir(cfg, run_dir)
    # data-dependent shapes (the target-token selection) on meta: assume every element selected
    from torch.fx.experimental import _config as fx_config

    guard = DeviceGuard()
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True), guard:
        summary = run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    assert guard.mixed == []
    assert guard.meta_ops > 100  # the model really ran on meta
    assert summary["rounds"] == 2
    state = load_checkpoint(run_dir)  # written device-independent
    tensors = [v for v in state["global"].values()]
    assert tensors and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def test_the_guard_catches_a_tensor_made_on_the_cpu():
    a = torch.zeros(2, 3, device="meta")
    with DeviceGuard() as guard:
        torch.bmm(a[None], torch.ones(1, 3, 2))
        a.sum().item()
    assert guard.mixed == [("aten.bmm.default", ("cpu", "meta"))]


def test_the_paper_config_is_a_run_config_and_asks_for_the_gpu(tmp_path, monkeypatch, capsys):
    """`fedlora run --config configs/paper_table1.toml` (a suite file) runs its experiment;
    without a GPU an explicit cuda is refused before the 1.5B model is fetched."""
    _no_gpu(monkeypatch)
    paper = Path(__file__).resolve().parents[1] / "configs" / "paper_table1.toml"
    out = tmp_path / "paper"
    assert main(["run", "--config", str(paper), "model.device=cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is a suite file: running its experiment once" in err
    assert "model.device = 'cuda' is invalid: not available on this machine" in err
    cfg = load_config(None, [])
    from fedlora.commands.run import load_run_file

    paper_cfg = load_run_file(str(paper), [])
    assert (paper_cfg.model.device, paper_cfg.model.dtype) == ("auto", "auto")
    assert paper_cfg.model.name == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.model.device == "auto"
    with pytest.MonkeyPatch.context() as m:
        _fake_gpus(m, 1, bf16=True)
        gpu = resolve_runtime(paper_cfg).cfg.model
    assert (gpu.device, gpu.dtype) == ("cuda:0", "bf16")


def test_slots_per_pass_on_a_gpu_follow_free_memory(monkeypatch):
    """The engine's cap with a mocked CUDA device: tiny-llama, LoRA on both layers, b = 2,
    T = 16, fp32: 2·16·(2·(12·64 + 4·128 + 4·16) + 64)·4 bytes per slot."""
    from types import SimpleNamespace

    from fedlora.federation.runstate import device_slots_per_pass
    from fedlora.llm.tiny_models import tiny_config

    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    run = SimpleNamespace(
        cfg=load_config(None, ["training.slots=8", "training.batch_size=2", "model.dtype=fp32"]),
        device="cuda:0",
        model=SimpleNamespace(config=tiny_config("tiny-llama")),
        lora=SimpleNamespace(names=names),
    )
    run.cfg = run.cfg.replace(data=run.cfg.data.__class__(max_seq_len=16))
    per_slot = 2 * 16 * (2 * (12 * 64 + 4 * 128 + 4 * 16) + 64) * 4
    logged: list[str] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * per_slot, 10**12))
    assert device_slots_per_pass(run, logged.append) == 3  # half of 6 slots' worth
    assert "training.slots = 8: 3 per pass fit" in logged[0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**12, 10**12))
    assert device_slots_per_pass(run, logged.append) == 8
    run.device = "cpu"
    assert device_slots_per_pass(run, logged.append) == 8  # no cap off the GPU
