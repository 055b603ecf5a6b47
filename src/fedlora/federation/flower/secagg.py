"""The server's side of SecAgg+ on fedlora's Message-API ServerApp (docs/privacy.md, "Secure
aggregation on Flower").

`secure_sum` drives the four stages of Flower's SecAgg+ protocol over the Grid, the server
half of Flower's `SecAggPlusWorkflow` without its Strategy and LegacyContext; the key
agreement, the secret sharing and the mask generator are Flower's own
(`flwr.common.secure_aggregation`), never re-implemented here:

    setup        each node gets the protocol's parameters and answers two public keys
    share keys   each node gets the others' public keys and answers its encrypted shares
                 (of its mask seed and of its first secret key) for every other node
    masked       each node gets the shares meant for it and the round's ``train`` content;
                 it trains, and answers its weighted update quantized and masked
                 (`fedlora.federation.flower.secagg_node`); the server sums the masked
                 vectors modulo 2^32
    unmask       each node that sent a vector answers its shares of the senders' mask seeds
                 and of the dropped nodes' keys; the server removes the masks

Every participant of the round is every other's neighbour (SecAgg+ with the complete graph:
``share_num`` = the round's participants). A stage at which fewer than ``threshold`` nodes
answered stops the protocol: the round is skipped, never aggregated in the clear.

The result is Σ_n Q(u_n) over the nodes whose vectors arrived, with Q SecAgg+'s stochastic
quantization: every entry clipped to [-c, c] and rounded to a grid of step 2c / 2^22.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedlora.config.privacy_section import SECAGG_MODULUS_RANGE, SECAGG_QUANTIZATION_RANGE
from fedlora.federation.flower.common import TRAIN, apply_safe_env, exchange
from fedlora.federation.privacy_mechanisms.base import factor_keys

apply_safe_env()

from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.crypto.shamir import combine_shares  # noqa: E402
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (  # noqa: E402
    generate_shared_key,
)
from flwr.common.secure_aggregation.ndarrays_arithmetic import (  # noqa: E402
    factor_extract,
    get_parameters_shape,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: E402
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen  # noqa: E402
from flwr.supercore.primitives.asymmetric import (  # noqa: E402
    bytes_to_private_key,
    bytes_to_public_key,
)

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class SecAggSettings:
    """The protocol's parameters: `threshold` (shares needed to reconstruct a secret, and
    the fewest participants a round may have), `clipping_range` c, and the fixed
    quantization (2^22 levels) and modulus (2^32)."""

    threshold: int
    clipping_range: float
    quantization_range: int = SECAGG_QUANTIZATION_RANGE
    modulus_range: int = SECAGG_MODULUS_RANGE

    @property
    def step(self) -> float:
        """The quantization grid's step 2c / 2^22: each entry of each update is off by less."""
        return 2 * self.clipping_range / self.quantization_range


@dataclasses.dataclass
class SecureSum:
    """What `secure_sum` returns: `total` (Σ of the updates of `summed`, one array per key)
    or None with `reason` when the protocol stopped; `replies` the masked stage's replies
    (node id -> Message: their metrics travel in the clear); `asked` whether the nodes were
    asked at all (not when the round has fewer participants than the threshold)."""

    total: list[np.ndarray] | None
    summed: list[int]
    replies: dict[int, Message]
    reason: str = ""
    asked: bool = True


# ----------------------------------------------------------------------------- the update


def update_keys(global_state: Mapping[str, np.ndarray], factors: str) -> list[str]:
    """The tensors every participant sends, in order: all of the round's `factors`."""
    return sorted(factor_keys(dict(global_state), factors))


def secure_weights(method: Any, weights: Sequence[float]) -> np.ndarray:
    """w_n as `method` (a `Method` or its class) aggregates it: the task weight (a_n/q_n,
    1/m), or divided by the sum over the round's participants for the normalised means
    (`Method.normalised_weights`)."""
    w = np.asarray(weights, dtype=float)
    return w / w.sum() if method.normalised_weights and w.size else w


def padding_params(vector_params: int, uplink_params: Sequence[int]) -> int:
    """Parameters the zero padding adds to the uplink: each participant sends the whole
    vector instead of its own payload."""
    return int(sum(max(vector_params - int(p), 0) for p in uplink_params))


# ----------------------------------------------------------------------------- the protocol


def _ask(
    grid: Any, contents: Mapping[int, RecordDict], group: str, timeout_s: float, poll_s: float
) -> dict[int, Message]:
    """Send contents[node] to every node; returns node -> its reply without an error."""
    nodes = list(contents)
    messages = [Message(contents[n], n, TRAIN, group_id=group, ttl=timeout_s + 60) for n in nodes]
    replies = exchange(grid, messages, timeout_s, poll_s)
    return {nodes[i]: r for i, r in replies.items() if not r.has_error()}


def _configs(reply: Message) -> ConfigRecord:
    return reply.content.config_records[RECORD_KEY_CONFIGS]


def secure_sum(
    grid: Any,
    contents: Mapping[int, RecordDict],
    settings: SecAggSettings,
    group: str,
    timeout_s: float,
    poll_s: float,
) -> SecureSum:
    """Run SecAgg+ with the nodes of `contents` (node id -> the ``train`` content of its
    task); see the module docstring."""
    t, M = settings.threshold, settings.modulus_range
    nodes = list(contents)

    def ask(stage: Mapping[int, RecordDict]) -> dict[int, Message]:
        return _ask(grid, stage, group, timeout_s, poll_s)

    def stop(reason: str, summed: Sequence[int] = (), replies: Any = None) -> SecureSum:
        return SecureSum(None, list(summed), dict(replies or {}), reason)

    if len(nodes) < t:
        return SecureSum(None, [], {}, f"{len(nodes)} participant(s), the threshold is {t}", False)
    replies = ask({n: _record(_setup(settings, len(nodes))) for n in nodes})
    keys = {
        n: [_configs(r)[Key.PUBLIC_KEY_1], _configs(r)[Key.PUBLIC_KEY_2]]
        for n, r in replies.items()
    }
    if len(keys) < t:
        return stop(f"{len(keys)} node(s) answered the setup, the threshold is {t}")

    shared = {str(n): keys[n] for n in keys}
    replies = ask({n: _record({**shared, Key.STAGE: Stage.SHARE_KEYS}) for n in keys})
    u1 = sorted(replies)
    if len(u1) < t:
        return stop(f"{len(u1)} node(s) shared their keys, the threshold is {t}")

    collected = ask(_masked_stage(contents, _forwarded_shares(replies, u1)))
    u2 = sorted(collected)
    if len(u2) < t:
        return stop(f"{len(u2)} node(s) sent a masked update, the threshold is {t}", u2, collected)
    total: list[np.ndarray] | None = None
    for n in u2:
        vec = [bytes_to_ndarray(b) for b in _configs(collected[n])[Key.MASKED_PARAMETERS]]
        total = vec if total is None else parameters_addition(total, vec)
    assert total is not None
    total = parameters_mod(total, M)

    dead = sorted(set(u1) - set(u2))
    unmask = {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: u2, Key.DEAD_NODE_ID_LIST: dead}
    replies = ask({n: _record(unmask) for n in u2})
    shares: dict[int, list[bytes]] = {n: [] for n in u1}
    for reply in replies.values():
        for owner, share in zip(_configs(reply)[Key.NODE_ID_LIST], _configs(reply)[Key.SHARE_LIST]):
            shares[int(owner)].append(share)
    short = [n for n, s in shares.items() if len(s) < t]
    if short:
        return stop(f"too few shares to unmask node(s) {short}", u2, collected)
    total = _unmasked(total, shares, set(collected), u2, keys, M)
    return SecureSum(_dequantized(total, len(u2), settings), u2, collected)


def _setup(settings: SecAggSettings, n: int) -> dict[str, Any]:
    """The setup stage's content: the protocol's parameters for `n` participants, each the
    neighbour of every other (the complete graph)."""
    return {
        Key.STAGE: Stage.SETUP,
        Key.SAMPLE_NUMBER: n,
        Key.SHARE_NUMBER: n,
        Key.THRESHOLD: settings.threshold,
        Key.CLIPPING_RANGE: float(settings.clipping_range),
        Key.TARGET_RANGE: settings.quantization_range,
        Key.MOD_RANGE: settings.modulus_range,
        Key.MAX_WEIGHT: 1.0,
    }


def _forwarded_shares(
    replies: Mapping[int, Message], u1: Sequence[int]
) -> dict[int, tuple[list[int], list[bytes]]]:
    """The encrypted shares of the share-keys stage regrouped by their destination in `u1`:
    node -> (the source of each, the ciphertexts)."""
    fwd: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in u1}
    for src, reply in replies.items():
        for dst, ctxt in zip(
            _configs(reply)[Key.DESTINATION_LIST], _configs(reply)[Key.CIPHERTEXT_LIST]
        ):
            if dst in fwd:
                fwd[dst][0].append(src)
                fwd[dst][1].append(ctxt)
    return fwd


def _masked_stage(
    contents: Mapping[int, RecordDict], fwd: Mapping[int, tuple[list[int], list[bytes]]]
) -> dict[int, RecordDict]:
    """Each node's ``train`` content with the shares meant for it, for the masked stage."""
    masked_stage: dict[int, RecordDict] = {}
    for n in sorted(fwd):
        content = contents[n]
        content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
            {
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.SOURCE_LIST: fwd[n][0],
                Key.CIPHERTEXT_LIST: fwd[n][1],
            }
        )
        masked_stage[n] = content
    return masked_stage


def _unmasked(
    total: list[np.ndarray],
    shares: Mapping[int, list[bytes]],
    sent: set[int],
    u2: Sequence[int],
    keys: Mapping[int, list[bytes]],
    M: int,
) -> list[np.ndarray]:
    """The masked sum without its masks, each owner's secret rebuilt from its shares: a
    sender's own mask (from its seed), a dropped node's pairwise masks with every sender."""
    shapes = get_parameters_shape(total)
    for n, node_shares in shares.items():
        secret = combine_shares(node_shares)
        if n in sent:  # its own mask, from its seed
            total = parameters_subtraction(total, pseudo_rand_gen(secret, M, shapes))
            continue
        for other in u2:  # a node that dropped after sharing: its pairwise masks
            key = generate_shared_key(
                bytes_to_private_key(secret), bytes_to_public_key(keys[other][0])
            )
            mask = pseudo_rand_gen(key, M, shapes)
            total = (
                parameters_addition(total, mask)
                if n > other
                else parameters_subtraction(total, mask)
            )
    return total


def _dequantized(total: list[np.ndarray], n: int, settings: SecAggSettings) -> list[np.ndarray]:
    """Σ_n Q(u_n) in float64 from the unmasked sum of `n` quantized vectors, checking that
    the weight factor SecAgg+ carries is n times the quantization range."""
    c, T, M = settings.clipping_range, settings.quantization_range, settings.modulus_range
    factor, vector = factor_extract(parameters_mod(total, M))
    if int(factor) != n * T:
        raise RuntimeError(f"SecAgg+: the unmasked weight is {factor}, expected {n * T}")
    offset = -(n - 1) * c  # each dequantized entry carries one -c of its own
    return [np.asarray(x, dtype=np.float64) + offset for x in dequantize(vector, c, T)]


def _record(values: Mapping[str, Any]) -> RecordDict:
    return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(values))})
