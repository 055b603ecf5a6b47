"""The node's side of secure aggregation (``privacy.secure_aggregation``, docs/privacy.md):
what a SuperNode adds to its sum, and Flower's SecAgg+ mod that masks it.

The server's ``train`` messages of a SecAgg+ round carry Flower's ``secaggplus_configs``
record; `secagg_mod` hands those to Flower's `secaggplus_mod` (the key exchange, the masking,
the unmasking shares: Flower's own cryptography) and every other message straight to the
handler, so one ClientApp serves runs with and without secure aggregation.

In the masked stage the handler trains as usual and replies with `secure_content`: the
participant's weighted update u_n = w_n (X_n − X), on every tensor of the factors the round
trains (``secagg-keys``, in that order), zero outside the rank components it trained for
HeteroLoRA (``secagg-mask``), as a FitRes with weight 1 (num_examples = max_weight = 1, so
SecAgg+'s own weighting is the identity and the unmasked result is the plain sum Σ u_n).
Every update has the whole tensors' shape: a sketched client's untouched rank components
are zeros, the padding that makes every participant's vector the same length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedlora.federation.flower.common import apply_safe_env

apply_safe_env()

from flwr.app import Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: E402
    RECORD_KEY_CONFIGS,
)

# task fields of a SecAgg+ round (the ``task`` ConfigRecord)
WEIGHT, KEYS, MASK, CLIP = "secagg-weight", "secagg-keys", "secagg-mask", "secagg-clip"


def is_secure(message: Message) -> bool:
    """True for a message of a SecAgg+ round (it carries Flower's SecAgg+ config record)."""
    return RECORD_KEY_CONFIGS in message.content.config_records


def secagg_mod(message: Message, context: Context, call_next: Any) -> Message:
    """Flower's `secaggplus_mod` for the messages of a SecAgg+ round; the others pass."""
    if is_secure(message):
        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


def weighted_update(
    global_adapter: Mapping[str, np.ndarray],
    adapter: Mapping[str, np.ndarray],
    keys: Sequence[str],
    weight: float,
    scale: Sequence[float] | None = None,
) -> list[np.ndarray]:
    """u = weight · (X_n − X) on `keys` (float64, full shapes). `scale` (γ,): zero the rank
    components it does not train (rows of A, columns of B, rows and columns of R)."""
    out = []
    for k in keys:
        delta = np.asarray(adapter[k], dtype=np.float64) - np.asarray(
            global_adapter[k], dtype=np.float64
        )
        if scale is not None:
            on = (np.asarray(scale) != 0).astype(np.float64)
            if k.endswith(".lora_A"):
                delta = delta * on[:, None]
            elif k.endswith(".lora_B"):
                delta = delta * on[None, :]
            else:
                delta = delta * np.outer(on, on)
        out.append(float(weight) * delta)
    return out


def secure_content(
    task: Mapping[str, Any],
    global_adapter: Mapping[str, np.ndarray],
    adapter: Mapping[str, np.ndarray],
    metrics: MetricRecord,
) -> RecordDict:
    """The reply of a masked stage before `secaggplus_mod` masks it: the weighted update as
    a FitRes of weight 1, and the node's `metrics` (these travel in the clear), with
    ``secagg-clipped``: the entries of the update beyond ±``secagg-clip``."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict

    scale = task["scale"] if task.get(MASK) else None
    update = weighted_update(
        global_adapter, adapter, [str(k) for k in task[KEYS]], float(task[WEIGHT]), scale
    )
    if CLIP in task:  # how many entries SecAgg+'s quantizer will clip (a count, in the clear)
        clip = float(task[CLIP])
        metrics["secagg-clipped"] = int(sum(int(np.sum(np.abs(u) > clip)) for u in update))
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), 1, {})
    content = fitres_to_recorddict(fitres, keep_input=False)
    content.metric_records["metrics"] = metrics
    return content
