"""Per-client privacy accounting of client-level differential privacy (docs/privacy.md):
every client's ε(δ) from the rounds it was exposed to, each round a Gaussian mechanism on the
sum of clipped updates, amplified by the round's sampling.

A client's history is a list of events ``(kind, rate, count)``:

    "poisson"  the round sampled the client independently with probability `rate` (q_n):
               the Poisson-subsampled Gaussian, add-or-remove-one adjacency, noise
               multiplier σ (sensitivity C)
    "uniform"  m of N clients without replacement, `rate` = m/N: the sampled-without-
               replacement Gaussian, replace-one adjacency, noise multiplier σ/2 (replacing a
               client's data moves its clipped contribution by up to 2C); with m = N (every
               client every round) the plain Gaussian, add-or-remove-one, multiplier σ
    "local"    the client added the noise to its own update and sent it (`rate` = 1): the
               Gaussian with multiplier σ/2 (any two of its data sets, 2C), once per round it
               took part; the server chose who takes part, so no amplification

composed with Rényi DP by dp-accounting's `RdpAccountant` (its default orders), so a uniform
rate gives exactly the library's ε. dp-accounting is imported where an ε is computed, with a
ConfigError naming the extra when it is missing. Pure numpy otherwise: no torch, no I/O.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import numpy as np

from fedlora.errors import ConfigError

EVENT_KINDS = ("poisson", "uniform", "local")
RATE_DIGITS = 12  # rates are rounded to this many digits before they key an event

Event = tuple[str, float, int]  # (kind, rate, count)


def _accounting():  # -> the dp_accounting module
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError(
            "privacy accounting needs the dp-accounting package: pip install 'fedlora[privacy]' "
            "(or set privacy.mode = 'none')"
        ) from None
    return dp_accounting


def _dp_event(kind: str, rate: float, sigma: float, n_clients: int):  # -> a DpEvent
    dpa = _accounting()
    if kind == "poisson":
        return dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(sigma))
    if kind == "uniform":
        m = int(round(rate * n_clients))
        if m >= n_clients:  # everyone every round: no sampling, add-or-remove (C)
            return dpa.GaussianDpEvent(sigma)
        return dpa.SampledWithoutReplacementDpEvent(n_clients, m, dpa.GaussianDpEvent(sigma / 2))
    if kind == "local":
        return dpa.GaussianDpEvent(sigma / 2)
    raise ValueError(f"unknown privacy event kind {kind!r} (allowed: {', '.join(EVENT_KINDS)})")


@functools.lru_cache(maxsize=4096)
def _epsilon_cached(events: tuple[Event, ...], sigma: float, delta: float, n_clients: int) -> float:
    if not events or all(count == 0 for _, _, count in events):
        return 0.0
    if sigma <= 0:
        return math.inf
    dpa = _accounting()
    uniform = any(kind == "uniform" for kind, _, _ in events)
    relation = dpa.NeighboringRelation
    accountant = dpa.rdp.RdpAccountant(
        neighboring_relation=relation.REPLACE_ONE if uniform else relation.ADD_OR_REMOVE_ONE
    )
    absl = logging.getLogger("absl")  # orders whose series does not converge are dropped
    level = absl.level  # by the library with a warning per order: keep them off the terminal
    absl.setLevel(logging.ERROR)
    try:
        for kind, rate, count in events:
            if count:
                accountant.compose(_dp_event(kind, rate, sigma, n_clients), count)
        return float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)


def epsilon(events: Sequence[Event], sigma: float, delta: float, n_clients: int = 0) -> float:
    """ε(δ) of one client's history `events` at noise multiplier σ (inf when σ = 0 and the
    client was exposed; 0 before any round). `n_clients` N: for the "uniform" events."""
    key = tuple(sorted((str(k), round(float(r), RATE_DIGITS), int(c)) for k, r, c in events))
    return _epsilon_cached(key, float(sigma), float(delta), int(n_clients))


def poisson_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    """ε(δ) of `rounds` rounds of the Poisson-subsampled Gaussian at rate q."""
    return epsilon([("poisson", q, int(rounds))], sigma, delta)


def max_poisson_rate(
    budget: float, sigma: float, rounds: int, delta: float, *, q_min: float = 1e-6
) -> float:
    """The largest q in (0, 1] whose `rounds` rounds keep ε(δ) <= `budget` (ε grows with q):
    1 when q = 1 does, 0 when not even `q_min` does; else the root of ε(q) = budget in log q
    (Brent, to 1e-4), stepped down until it keeps the budget."""
    from scipy.optimize import brentq

    if rounds <= 0 or poisson_epsilon(1.0, sigma, rounds, delta) <= budget:
        return 1.0
    if poisson_epsilon(q_min, sigma, rounds, delta) > budget:
        return 0.0
    root = brentq(
        lambda t: poisson_epsilon(math.exp(t), sigma, rounds, delta) - budget,
        math.log(q_min),
        0.0,
        xtol=1e-4,
    )
    t = root
    while t > math.log(q_min) and poisson_epsilon(math.exp(t), sigma, rounds, delta) > budget:
        t -= 1e-4
    return math.exp(t)


class PrivacyLedger:
    """Every client's history of privacy events (plain data: checkpointed as a list)."""

    def __init__(self, n_clients: int, history: Sequence[Sequence[Sequence]] | None = None):
        self.n = int(n_clients)
        self.history: list[dict[tuple[str, float], int]] = [{} for _ in range(self.n)]
        for i, events in enumerate(history or []):
            for kind, rate, count in events:
                self.history[i][(str(kind), float(rate))] = int(count)

    def record(self, kind: str, rates: np.ndarray, mask: np.ndarray | None = None) -> None:
        """One round: client n exposed at `rates[n]` (where `mask` is true, or all)."""
        rates = np.broadcast_to(np.asarray(rates, dtype=float), (self.n,))
        for i in range(self.n):
            if mask is None or mask[i]:
                key = (kind, round(float(rates[i]), RATE_DIGITS))
                self.history[i][key] = self.history[i].get(key, 0) + 1

    def epsilons(self, sigma: float, delta: float) -> list[float]:
        """Every client's ε(δ) so far."""
        return [
            epsilon([(k, r, c) for (k, r), c in h.items()], sigma, delta, self.n)
            for h in self.history
        ]

    def to_list(self) -> list[list[list]]:
        return [[[k, r, c] for (k, r), c in sorted(h.items())] for h in self.history]
