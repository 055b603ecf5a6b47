"""The run's random streams: every draw of round r comes from a generator derived from
(seed, stream, r, ...), so a resumed run replays exactly the draws of an uninterrupted one
and a Flower node can rebuild its own batches.

Streams: partition, profiles, strategy, sampling, sketch, data, fading, torch, init, privacy,
privacy_count (adaptive clipping's noise on the count of unclipped updates).
"""

from __future__ import annotations

import numpy as np

STREAMS = {
    "partition": 1,
    "profiles": 2,
    "strategy": 3,
    "sampling": 4,
    "sketch": 5,
    "data": 6,
    "fading": 7,
    "torch": 8,
    "init": 9,
    "privacy": 10,
    "privacy_count": 11,
}


def derive_rng(seed: int, stream: str, *ids: int) -> np.random.Generator:
    """An independent generator for (seed, stream, ids...), e.g. ('sampling', round)."""
    return np.random.default_rng([seed, STREAMS[stream], *ids])


def derive_seed(seed: int, stream: str, *ids: int) -> int:
    """An integer seed (torch's, the LoRA init's) from the generator of (seed, stream, ids...)."""
    return int(derive_rng(seed, stream, *ids).integers(2**62))
