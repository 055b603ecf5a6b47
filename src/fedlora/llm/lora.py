"""Client-batched LoRA: C client slots per adapted layer, one forward/backward for all of them.

Every adapted linear layer W0 (out × in) gets, besides the frozen base, per slot c:
A_c (r × in), B_c (out × r) and a rank scale vector s_c (r,). The input batch is grouped by
slot: rows ``[c*b:(c+1)*b]`` belong to slot c. The layer computes (paper Eq. 3 with the
sketch S_c = diag(s_c))

    y = W0 x + (α/r) · B_c diag(s_c) A_c x         for the rows of slot c,

with one batched matmul over the active slots. With a middle factor (`enable_middle`, Fed-SB's
LoRA-SB) the layer computes (α/r) · B_c R_c diag(s_c) A_c x with R_c (r × r). `set_trainable`
picks the factors local training moves (FFA-LoRA: B only; RoLoRA: A or B; Fed-SB: R). A sketch of k-of-γ indices is
s_c = γ/k on the sketched indices and 0 elsewhere (`fedlora.system.sketch.sketch_scale_vectors`);
a rank truncation is 1 on the first r_n indices (`truncation_scale_vectors`). Rank components
with s_c[j] = 0 receive exactly zero gradient, so a client trains only its sketch.

The *global* adapter (A: r × in, B: out × r per layer, fp32 on the CPU) lives outside the
slots: `set_clients` copies it into the first c slots, local training updates the slots, and
`slot_state` reads each slot back. The LoRA computation is attached with forward hooks, so
the base model's module names and state dict stay unchanged.

    lora = inject_lora(model, cfg.lora, slots=5, seed=0)
    lora.set_clients(torch.ones(1, lora.rank))   # slot 0 = the global adapter
    lora.export_peft("out/adapter", base_model_name_or_path="smollm2-135m")
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlora.config.checks import check_fits_in_memory
from fedlora.config.sections import LoraConfig
from fedlora.errors import ConfigError, bad_value
from fedlora.files import atomic_write
from fedlora.llm.device import autocast_state
from fedlora.llm.lora_targets import find_targets

__all__ = ["SlotLoraLayer", "SlotLora", "inject_lora"]


class SlotLoraLayer(nn.Module):
    """The LoRA part of one adapted linear layer, with `slots` client slots.

    Parameters: ``lora_A`` (C, r, in), ``lora_B`` (C, out, r), fp32; buffer ``scale`` (C, r);
    ``lora_R`` (C, r, r) or None (no middle factor).
    """

    def __init__(
        self, in_features: int, out_features: int, slots: int, rank: int, scaling: float, p: float
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.scaling, self.dropout_p = rank, scaling, p
        self.lora_A = nn.Parameter(torch.zeros(slots, rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(slots, out_features, rank))
        self.register_buffer("scale", torch.ones(slots, rank))
        self.lora_R: nn.Parameter | None = None  # Fed-SB's middle factor (`SlotLora.enable_middle`)
        self.active = 1  # slots 0..active-1 are used by the forward pass

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(α/r) · B_c diag(s_c) A_c x for the rows of each active slot; x: (c*b, ..., in)."""
        c = self.active
        n = x.shape[0]
        if n % c:
            raise ConfigError(
                f"batch of {n} rows cannot be split over {c} active LoRA slots "
                "(the batch must hold the same number of rows per client)"
            )
        a, b = self.lora_A[:c], self.lora_B[:c]
        if not autocast_state(x.device.type)[0] and x.dtype != a.dtype:
            x = x.to(a.dtype)  # e.g. a bf16 base without autocast: LoRA in fp32
        xs = x.reshape(c, -1, self.in_features)  # (c, b*T, in)
        if self.dropout_p > 0 and self.training:
            xs = F.dropout(xs, p=self.dropout_p, training=True)
        h = torch.bmm(xs, a.transpose(1, 2))  # (c, b*T, r)
        h = h * (self.scale[:c] * self.scaling).unsqueeze(1).to(h.dtype)  # × diag(s_c)·α/r
        if self.lora_R is not None:
            h = torch.bmm(h, self.lora_R[:c].transpose(1, 2))  # (c, b*T, r): × R_cᵀ
        d = torch.bmm(h, b.transpose(1, 2))  # (c, b*T, out)
        return d.reshape(*x.shape[:-1], self.out_features)  # (c*b, ..., out)

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + self.delta(args[0]).to(output.dtype)


class SlotLora:
    """The adapter of a model with `slots` client slots (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        cfg: LoraConfig,
        slots: int,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.names = list(names)
        self.rank = cfg.rank
        self.scaling = float(cfg.scaling)  # α/r, or α/√r with lora.rslora (PEFT's use_rslora)
        self.slots = slots
        self.cfg = cfg
        self.modules: dict[str, nn.Linear] = {n: model.get_submodule(n) for n in self.names}
        self.layers: dict[str, SlotLoraLayer] = {}
        self._base_w0: dict[str, torch.Tensor] = {}  # see add_to_base: the weight before merges
        self._base_total: dict[str, torch.Tensor] = {}  # and the fp32 sum of the merges
        self.middle = False  # Fed-SB's r × r factor R (`enable_middle`)
        self._handles = []
        for n, lin in self.modules.items():
            layer = SlotLoraLayer(
                lin.in_features, lin.out_features, slots, cfg.rank, self.scaling, cfg.dropout
            ).to(lin.weight.device)  # the slots live with the base (fp32 master weights)
            layer.train(False)  # dropout only inside local training (`SlotLora.train`)
            self.layers[n] = layer
            self._handles.append(lin.register_forward_hook(layer.hook))
        # Global init like PEFT: A ~ kaiming_uniform(a=√5) (seeded), B = 0.
        gen = torch.Generator().manual_seed(int(seed))
        self._global: dict[str, torch.Tensor] = {}
        for n, (out_f, in_f) in self.layer_shapes().items():
            a = torch.empty(cfg.rank, in_f)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            self._global[f"{n}.lora_A"] = a
            self._global[f"{n}.lora_B"] = torch.zeros(out_f, cfg.rank)
        self.set_clients(torch.ones(1, self.rank))

    # ------------------------------------------------------------------ state

    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """name -> (out_features, in_features) of each adapted layer."""
        return {n: (m.out_features, m.in_features) for n, m in self.modules.items()}

    def global_state(self) -> dict[str, torch.Tensor]:
        """fp32 CPU copies of the global adapter: ``{name}.lora_A`` (r, in), ``.lora_B`` (out, r)."""
        return {k: v.clone() for k, v in self._global.items()}

    def enable_middle(self) -> None:
        """Give every layer Fed-SB's middle factor R (C, r, r): ΔW = (α/r)·B R diag(s) A; the
        global adapter gains ``<name>.lora_R`` = I (ΔW unchanged). `load_global` calls it for a
        state with ``lora_R`` keys."""
        if self.middle:
            return
        self.middle = True
        for n, layer in self.layers.items():
            eye = torch.eye(self.rank).expand(self.slots, -1, -1).clone()
            layer.lora_R = nn.Parameter(eye.to(layer.lora_A.device))
            self._global[f"{n}.lora_R"] = torch.eye(self.rank)

    def set_trainable(self, parts: str = "AB") -> None:
        """The factors local training moves: a string of ``A``, ``B``, ``R`` (default ``AB``).
        A frozen factor gets no gradient, so `local_train` leaves it exactly as it was."""
        bad = sorted(set(parts) - set("ABR" if self.middle else "AB"))
        if bad or not parts:
            raise bad_value("trainable LoRA factors", parts, "letters of 'AB' (+ 'R' w/ middle)")
        for layer in self.layers.values():
            layer.lora_A.requires_grad_("A" in parts)
            layer.lora_B.requires_grad_("B" in parts)
            if layer.lora_R is not None:
                layer.lora_R.requires_grad_("R" in parts)

    def _check_state(self, state: dict[str, torch.Tensor], what: str) -> None:
        missing = sorted(set(self._global) - set(state))
        extra = sorted(set(state) - set(self._global))
        if missing or extra:
            raise ConfigError(
                f"{what}: keys do not match the adapter (missing {missing[:3]}, "
                f"unexpected {extra[:3]})"
            )
        for k, v in state.items():
            if tuple(v.shape) != tuple(self._global[k].shape):
                raise ConfigError(
                    f"{what}[{k!r}] has shape {tuple(v.shape)}, expected "
                    f"{tuple(self._global[k].shape)}"
                )

    def load_global(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the global adapter (copied, as fp32). Slots change only at `set_clients`.
        A state with ``lora_R`` keys turns the middle factor on (`enable_middle`)."""
        if any(k.endswith(".lora_R") for k in state):
            self.enable_middle()
        self._check_state(state, "global adapter")
        self._global = {
            k: torch.as_tensor(v).detach().float().cpu().clone() for k, v in state.items()
        }

    def set_clients(self, scales: torch.Tensor) -> None:
        """Copy the global adapter into slots 0..c-1, set their rank scales, activate c slots.

        `scales` is (c, r): s_c = γ/k on a sketch and 0 elsewhere, or 1 on the first r_n.
        """
        scales = torch.as_tensor(scales, dtype=torch.float32)
        if (
            scales.ndim != 2
            or scales.shape[1] != self.rank
            or not 1 <= scales.shape[0] <= self.slots
        ):
            raise ConfigError(
                f"scales has shape {tuple(scales.shape)}: expected (c, {self.rank}) with "
                f"1 <= c <= slots = {self.slots}"
            )
        if not torch.isfinite(scales).all() or (scales < 0).any():
            raise ConfigError("scales must be finite and >= 0")
        c = scales.shape[0]
        with torch.no_grad():
            for n, layer in self.layers.items():
                layer.lora_A[:c].copy_(self._global[f"{n}.lora_A"].unsqueeze(0))
                layer.lora_B[:c].copy_(self._global[f"{n}.lora_B"].unsqueeze(0))
                if layer.lora_R is not None:
                    layer.lora_R[:c].copy_(self._global[f"{n}.lora_R"].unsqueeze(0))
                    layer.lora_R.grad = None
                layer.scale[:c].copy_(scales)
                layer.active = c
                layer.lora_A.grad = layer.lora_B.grad = None

    def set_slot(self, c: int, values: dict[str, torch.Tensor]) -> None:
        """Overwrite some of slot c's tensors (keys as `global_state`'s) after `set_clients`:
        a client's own persistent part of the adapter (FedSA-LoRA's local B)."""
        if not 0 <= c < self.active:
            raise ConfigError(f"slot {c} is not active: 0 <= c < {self.active}")
        with torch.no_grad():
            for key, v in values.items():
                name, part = key.rsplit(".", 1)
                if name not in self.layers or part not in ("lora_A", "lora_B", "lora_R"):
                    raise ConfigError(f"set_slot: {key!r} is not a tensor of this adapter")
                getattr(self.layers[name], part)[c].copy_(torch.as_tensor(v))

    @property
    def active(self) -> int:
        """The number of active slots (clients trained together)."""
        return next(iter(self.layers.values())).active

    def slot_state(self, c: int) -> dict[str, torch.Tensor]:
        """Slot c's adapter (same keys and shapes as `global_state`), fp32 CPU copies."""
        if not 0 <= c < self.active:
            raise ConfigError(f"slot {c} is not active: 0 <= c < {self.active}")
        out = {}
        for n, layer in self.layers.items():
            out[f"{n}.lora_A"] = layer.lora_A[c].detach().float().cpu().clone()
            out[f"{n}.lora_B"] = layer.lora_B[c].detach().float().cpu().clone()
            if layer.lora_R is not None:
                out[f"{n}.lora_R"] = layer.lora_R[c].detach().float().cpu().clone()
        return out

    def parameters(self) -> list[nn.Parameter]:
        """The trainable slot tensors: per layer A (C, r, in), B (C, out, r) (then R (C, r, r))."""
        parts = [(la.lora_A, la.lora_B, la.lora_R) for la in self.layers.values()]
        return [p for ps in parts for p in ps if p is not None]

    def train(self, mode: bool = True) -> None:
        """Dropout on/off for the LoRA inputs (independent of the base model's mode)."""
        for layer in self.layers.values():
            layer.train(mode)

    def add_to_base(self, deltas: dict[str, torch.Tensor], *, total: bool = False) -> None:
        """W0[name] += delta (out, in) (FedStackLoRA merges, FedEx-LoRA's residual); with
        `total`, W0 = W_init + delta for every adapted layer (absent: + 0; a Flower node gets
        the server's sum of merges each round).

        The weight is always the weight before any merge plus the fp32 running sum of the
        merges, rounded once: W = W_init + ((d_1 + d_2) + …). So a resumed run that merges the
        checkpoint's sum at once gets the same bits as the run that merged round by round, and
        a base stored below fp32 (bf16) keeps small merges (rounding each one into bf16 would
        drop most of an update of 1e-5 at |W| ~ 0.02)."""
        if unknown := sorted(set(deltas) - set(self.modules)):
            raise ConfigError(f"add_to_base: unknown layers {unknown[:3]}; adapted: {self.names}")
        names = [n for n in self.names if n in deltas or (total and n in self._base_w0)]
        with torch.no_grad():
            for n in names:
                w = self.modules[n].weight
                d = torch.as_tensor(deltas.get(n, torch.zeros(w.shape)))
                if tuple(d.shape) != tuple(w.shape):
                    raise ConfigError(
                        f"add_to_base[{n!r}] has shape {tuple(d.shape)}, expected {tuple(w.shape)}"
                    )
                d = d.to(device=w.device, dtype=torch.float32)
                if n not in self._base_w0:
                    self._base_w0[n] = w.detach().clone()
                    self._base_total[n] = torch.zeros_like(d)
                self._base_total[n] = d.clone() if total else self._base_total[n] + d
                w.copy_((self._base_w0[n].float() + self._base_total[n]).to(w.dtype))

    def base_residual(self) -> dict[str, torch.Tensor]:
        """The fp32 rounding error of each merged layer of a bf16 base (zeros in fp32):
        weight + residual is the exact fp32 merge."""
        w = {n: self.modules[n].weight.detach().float() for n in self._base_total}
        return {n: self._base_w0[n].float() + t - w[n] for n, t in self._base_total.items()}

    def remove(self) -> None:
        """Detach the LoRA hooks: the model computes the base alone again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ PEFT export

    def export_peft(
        self,
        out_dir: str | Path,
        base_model_name_or_path: str,
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write `state` (default: the global adapter) as a PEFT LoRA adapter directory.

        ``PeftModel.from_pretrained(base, out_dir)`` then reproduces this model's logits with
        all scales 1 (slot 0 = the global adapter).
        """
        from peft import LoraConfig as PeftLoraConfig
        from safetensors.torch import save

        state = self._global if state is None else state
        self._check_state(state, "export state")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = PeftLoraConfig(
            r=self.rank,
            lora_alpha=self.cfg.alpha,
            lora_dropout=self.cfg.dropout,
            target_modules=list(self.names),  # full module paths: exact matches
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model_name_or_path,
            use_rslora=self.cfg.rslora,
        )
        # PEFT's save_pretrained, written through a temporary file; PEFT keeps target_modules
        # as a set (hash order): sorted, the file is reproducible
        saved = {k: list(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        saved["target_modules"] = sorted(saved["target_modules"])
        atomic_write(
            out / "adapter_config.json", json.dumps(saved, indent=2, sort_keys=True).encode()
        )
        tensors = {}
        for n in self.names:
            for part in ("lora_A", "lora_B"):
                t = torch.as_tensor(state[f"{n}.{part}"]).detach().float().cpu()
                if part == "lora_B" and f"{n}.lora_R" in state:  # PEFT's B = B R (Fed-SB)
                    t = t @ torch.as_tensor(state[f"{n}.lora_R"]).detach().float().cpu()
                tensors[f"base_model.model.{n}.{part}.weight"] = t.contiguous()
        # serialized here, not by save_file: a full disk is an OSError naming the file
        weights = save(tensors, metadata={"format": "pt"})
        atomic_write(out / "adapter_model.safetensors", weights)
        meta: dict[str, Any] = {"rank": self.rank, "alpha": self.cfg.alpha, "layers": self.names}
        atomic_write(out / "fedlora_adapter.json", (json.dumps(meta, indent=2) + "\n").encode())


def inject_lora(model: nn.Module, cfg: LoraConfig, slots: int, *, seed: int = 0) -> SlotLora:
    """Attach LoRA with `slots` client slots to the target modules of `model` (frozen base).

    Global init as PEFT: A kaiming-uniform(a=√5) from `seed`, B = 0; slot 0 holds it and is
    the only active slot until `set_clients`. Target modules that match nothing raise
    `ConfigError` listing the model's linear module names.
    """
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise bad_value("training.slots", slots, "an integer >= 1")
    names = find_targets(model, cfg)
    # A and B per slot and the global copy, fp32 (sizes as Python ints: no int64 overflow)
    dims = sum(m.in_features + m.out_features for m in map(model.get_submodule, names))
    need = 4 * (slots + 1) * cfg.rank * dims
    check_fits_in_memory("the adapter", f"lora.rank = {cfg.rank}, training.slots = {slots}", need)
    for p in model.parameters():
        p.requires_grad_(False)
    return SlotLora(model, names, cfg, slots, seed=seed)
