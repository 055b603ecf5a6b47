"""The partition of the training examples over the clients: Dirichlet(α) over a key (the
task, the answer label, or a field of the records), or one client per value of the key; and
the aggregation weights a_n = |D_n| / |D| of a partition.

The Dirichlet split follows flwr-datasets' `DirichletPartitioner`: for each key value, a
share vector p ~ Dir(α·1_N) splits that key's examples over the clients. Minimum-size policy:
*redistribute* (never resample): while a client holds fewer than ``min_size`` examples it
takes random examples from the currently largest client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedlora.errors import DataError
from fedlora.llm.tasks import Example

__all__ = [
    "dirichlet_partition",
    "client_weights",
    "partition_keys",
    "per_value_partition",
]


def dirichlet_partition(
    keys: Sequence[str],
    n_clients: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Split example indices over `n_clients` by Dirichlet(α) over `keys`.

    For each distinct key, p ~ Dir(α·1_N) and that key's (shuffled) examples are cut into N
    consecutive pieces of sizes ⌊cumsum(p)·m⌋. Then, while a client has fewer than `min_size`
    examples, it takes random examples from the currently largest client (redistribution,
    so it always terminates and keeps each client's dominant key). Returns sorted int64
    index arrays, one per client, that together cover every index exactly once.
    """
    n = len(keys)
    if n_clients < 1:
        raise DataError(f"n_clients = {n_clients!r} is invalid: must be >= 1")
    if not alpha > 0:
        raise DataError(f"alpha = {alpha!r} is invalid: must be > 0")
    if min_size < 0:
        raise DataError(f"min_size = {min_size!r} is invalid: must be >= 0")
    if n < n_clients * min_size:
        raise DataError(
            f"n_clients = {n_clients} with min_size = {min_size} needs >= {n_clients * min_size} "
            f"examples, the data has {n}"
        )
    key_arr = np.asarray(keys, dtype=object)
    parts: list[list[int]] = [[] for _ in range(n_clients)]
    for k in sorted(set(keys)):
        idx = np.flatnonzero(key_arr == k)
        idx = idx[rng.permutation(len(idx))]
        p = rng.dirichlet(np.full(n_clients, float(alpha)))
        cuts = np.floor(np.cumsum(p)[:-1] * len(idx)).astype(int)
        for c, piece in enumerate(np.split(idx, cuts)):
            parts[c].extend(piece.tolist())
    # minimum-size policy: redistribute from the largest client. The sizes are kept as one
    # array updated in place (recounting the N lists every move made a 10,000-client split
    # O(N²): 30 s; bench/cohort_scaling.py)
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    while True:
        small = int(np.argmin(sizes))
        if sizes[small] >= min_size:
            break
        big = int(np.argmax(sizes))
        move = int(min(min_size - sizes[small], sizes[big] - min_size))
        donor = parts[big]
        take = set(rng.choice(len(donor), size=move, replace=False).tolist())
        parts[small].extend(donor[j] for j in take)
        parts[big] = [x for j, x in enumerate(donor) if j not in take]
        sizes[small] += move
        sizes[big] -= move
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def client_weights(client_indices: Sequence[np.ndarray]) -> np.ndarray:
    """a_n = |D_n| / |D| (paper §II-A); sums to 1."""
    sizes = np.array([len(c) for c in client_indices], dtype=np.float64)
    return sizes / sizes.sum()


def _label(e: Any) -> str:
    if not isinstance(e, Example):
        raise DataError(
            f"data.partition_key = 'label': the instruction records of task {e.task!r} have no "
            "answer label: partition by task or by a field of the records"
        )
    return e.answer


def partition_keys(examples: Sequence[Any], key: str) -> list[str]:
    """The partition key of each example: its task, its answer label, or the value of a field
    of its record (`Example.fields`: your own data's columns). A record without the field
    raises `DataError` naming it and the fields it has."""
    getters: dict[str, Callable[[Any], str]] = {
        "task": lambda e: e.task,
        "label": _label,
    }
    if key in getters:
        return [getters[key](e) for e in examples]
    out = []
    for i, e in enumerate(examples):
        fields = dict(getattr(e, "fields", ()))
        other = dict(getattr(e, "non_scalar", ()))
        if key in other:  # a list, an object or null: no value to group by
            where = getattr(e, "source", "") or f"training example {i} (task {e.task!r})"
            raise DataError(
                f"data.partition_key = {key!r}: {where}: field {key!r} is not scalar "
                f"({other[key]}): a partition key needs a string, number or boolean"
            )
        if key not in fields:
            have = ", ".join(["task", "label", *fields])
            raise DataError(
                f"data.partition_key = {key!r}: training example {i} (task {e.task!r}) has no "
                f"such field; it has: {have}"
            )
        out.append(fields[key])
    return out


def per_value_partition(keys: Sequence[str], n_clients: int) -> list[np.ndarray]:
    """One client per distinct key value (sorted): client i holds every example of the i-th
    value. `n_clients` must equal the number of values."""
    values = sorted(set(keys))
    if len(values) != n_clients:
        raise DataError(
            f"data.partition_mode = 'per_value' gives one client per value: the key has "
            f"{len(values)} values ({', '.join(values[:5])}{', ...' if len(values) > 5 else ''}), "
            f"so data.n_clients must be {len(values)}, not {n_clients}"
        )
    arr = np.asarray(keys, dtype=object)
    return [np.flatnonzero(arr == v).astype(np.int64) for v in values]
