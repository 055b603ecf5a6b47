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

    "none"     the round released the adapter without noise (a run resumed into DP from
               ``privacy.mode = "none"``): no guarantee, ε = inf

composed with Rényi DP by dp-accounting's `RdpAccountant` (its default orders), each event at
the noise multiplier σ in force in its round (`history_epsilon`; a resumed run may change σ),
so a uniform rate gives exactly the library's ε. dp-accounting is imported where an ε is computed, with a
ConfigError naming the extra when it is missing. Pure numpy otherwise: no torch, no I/O.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Sequence

import numpy as np

from fedlora.errors import ConfigError

EVENT_KINDS = ("poisson", "uniform", "local")
UNPROTECTED = "none"  # the kind of a round released without noise
RATE_DIGITS = 12  # rates are rounded to this many digits before they key an event

# The range of σ the accountant computes (0 = no noise, ε = inf): below 0.01 every ε is in
# the thousands or more (and dp-accounting divides by zero near 1e-200); above 1e4 it is 0 to
# the accountant's precision (and overflows near 1e308).
SIGMA_RANGE = (0.01, 1e4)

Event = tuple[str, float, int]  # (kind, rate, count)
SigmaEvent = tuple[str, float, float, int]  # (kind, rate, σ, count)


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


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting drops the orders whose series does not converge with a warning per
    order: keep them off the terminal."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


@functools.lru_cache(maxsize=65536)
def _event_rdp(kind: str, rate: float, sigma: float, n_clients: int) -> np.ndarray:
    """One round's RDP at dp-accounting's default orders of one event, from its accountant
    (read-only; cached: a client's rate repeats over rounds, so each (kind, rate, σ) is
    computed once, not once per client and round)."""
    dpa = _accounting()
    relation = dpa.NeighboringRelation
    replace_one = kind == "uniform" and int(round(rate * n_clients)) < n_clients
    accountant = dpa.rdp.RdpAccountant(
        neighboring_relation=relation.REPLACE_ONE if replace_one else relation.ADD_OR_REMOVE_ONE
    )
    with _quiet_absl():
        accountant.compose(_dp_event(kind, rate, sigma, n_clients), 1)
    rdp = accountant.rdp
    rdp.setflags(write=False)
    return rdp


@functools.lru_cache(maxsize=4096)
def _epsilon_cached(events: tuple[SigmaEvent, ...], delta: float, n_clients: int) -> float:
    return float(histories_epsilons([events], delta, n_clients)[0])


def histories_epsilons(
    histories: Sequence[Sequence[SigmaEvent]], delta: float, n_clients: int = 0
) -> np.ndarray:
    """ε(δ) of many histories at once: each history's RDP composed as dp-accounting's
    `RdpAccountant` composes it (count times each event's RDP, added in order), and the
    conversion of its `compute_epsilon` applied to all of them with numpy (`_to_epsilon`), so
    a round with N clients at N different rates costs N sums of cached vectors, not N
    accountants. Empty history: 0; an event with σ = 0 or released without noise: inf."""
    orders = _orders()
    rdp = np.zeros((len(histories), len(orders)))
    empty = np.zeros(len(histories), dtype=bool)
    for i, events in enumerate(histories):
        events = [e for e in events if e[3]]
        empty[i] = not events
        if any(kind == UNPROTECTED or sigma <= 0 for kind, _, sigma, _ in events):
            rdp[i] = math.inf
            continue
        for kind, rate, sigma, count in events:
            rdp[i] += count * _event_rdp(kind, rate, sigma, n_clients)
    eps = _to_epsilon(rdp, delta)
    eps[empty] = 0.0
    return eps


def columns_epsilons(columns: Sequence[dict], delta: float, n_clients: int) -> np.ndarray:
    """Every client's ε(δ) from a ledger's event columns (`fedlora.system.privacy_ledger`:
    each {"kind", "sigma", "rates" (N,), "counts" (N,)}): `columns_rdp`, then `_to_epsilon`;
    numpy over the clients. No event: 0; an event with σ = 0 or released without noise: inf."""
    rdp, exposed, unbounded = _columns_rdp(columns, n_clients)
    eps = _to_epsilon(rdp, delta)
    eps[unbounded] = math.inf
    eps[~exposed] = 0.0
    return eps


def columns_rdp(columns: Sequence[dict], n_clients: int) -> np.ndarray:
    """(N, orders) every client's Rényi DP so far at dp-accounting's default orders
    (`rdp_orders`), from a ledger's event columns: client n's row is the sum over the columns
    of counts[n] times the event's RDP at rates[n], one cached vector per distinct rate; inf
    for a client exposed to a round with σ = 0 or released without noise. What a privacy
    budget has left: composing T more rounds adds T·RDP of each (`rdp_to_epsilon`)."""
    rdp, _, unbounded = _columns_rdp(columns, n_clients)
    rdp[unbounded] = math.inf
    return rdp


def _columns_rdp(
    columns: Sequence[dict], n_clients: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rdp = np.zeros((n_clients, len(_orders())))
    exposed = np.zeros(n_clients, dtype=bool)
    unbounded = np.zeros(n_clients, dtype=bool)
    for c in columns:
        on = np.asarray(c["counts"]) > 0
        if not on.any():
            continue
        exposed |= on
        if c["kind"] == UNPROTECTED or c["sigma"] <= 0:
            unbounded |= on
            continue
        values, back = np.unique(np.asarray(c["rates"])[on], return_inverse=True)
        table = np.stack([_event_rdp(c["kind"], float(v), c["sigma"], n_clients) for v in values])
        rdp[on] += np.asarray(c["counts"])[on][:, None] * table[back]
    return rdp, exposed, unbounded


def rdp_to_epsilon(rdp: np.ndarray, delta: float) -> np.ndarray:
    """ε(δ) of every row of `rdp` (clients × `rdp_orders()`), as dp-accounting converts it."""
    return _to_epsilon(np.atleast_2d(np.asarray(rdp, dtype=float)), delta)


def rdp_orders() -> np.ndarray:
    """dp-accounting's default RDP orders (the columns of `columns_rdp`)."""
    return _orders()


def poisson_round_rdp(q: float, sigma: float) -> np.ndarray:
    """One round's RDP of the Poisson-subsampled Gaussian at rate q (rounded to `RATE_DIGITS`
    as the ledger and `history_epsilon` round it; cached, read-only)."""
    return _event_rdp("poisson", round(float(q), RATE_DIGITS), float(sigma), 0)


def _to_epsilon(rdp: np.ndarray, delta: float) -> np.ndarray:
    """dp-accounting's `compute_epsilon` on every row of `rdp` (histories × orders): per
    order, r + log(1 − 1/α) − log(δα)/(α − 1) (Canonne, Kamath & Steinke 2020, Prop. 12);
    0 where the KL bound gives it (δ² + e^{−r} − 1 > 0) or r < 0; inf for α <= 1.01; the
    order of the first smallest value, at least 0. The terms of the orders are computed with
    `math` as the library does, so the values are the library's, bit for bit (tested)."""
    orders = _orders()
    gain = np.array([math.log1p(-1 / a) for a in orders])
    cost = np.array([math.log(delta * a) / (a - 1) if a > 1.01 else 0.0 for a in orders])
    with np.errstate(invalid="ignore", over="ignore"):
        eps = rdp + gain - cost
        eps = np.where(orders > 1.01, eps, math.inf)
        eps = np.where((delta**2 + np.expm1(-rdp) > 0) | (rdp < 0), 0.0, eps)
    best = eps[np.arange(len(eps)), np.argmin(eps, axis=1)] if eps.size else eps[:, 0]
    return np.maximum(0.0, best)


@functools.lru_cache(maxsize=1)
def _orders() -> np.ndarray:
    return _accounting().rdp.RdpAccountant().orders


def history_epsilon(events: Sequence[SigmaEvent], delta: float, n_clients: int = 0) -> float:
    """ε(δ) of one client's history `events`, each ``(kind, rate, σ, count)`` at its own σ
    (inf when an exposed round had σ = 0 or was released without noise; 0 before any
    round). `n_clients` N: for the "uniform" events."""
    key = tuple(
        sorted((str(k), round(float(r), RATE_DIGITS), float(s), int(c)) for k, r, s, c in events)
    )
    return _epsilon_cached(key, float(delta), int(n_clients))


def epsilon(events: Sequence[Event], sigma: float, delta: float, n_clients: int = 0) -> float:
    """ε(δ) of one client's history `events` at one noise multiplier σ (inf when σ = 0 and
    the client was exposed; 0 before any round). `n_clients` N: for the "uniform" events."""
    return history_epsilon([(k, r, sigma, c) for k, r, c in events], delta, n_clients)


def poisson_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    """ε(δ) of `rounds` rounds of the Poisson-subsampled Gaussian at rate q."""
    return epsilon([("poisson", q, int(rounds))], sigma, delta)


def max_poisson_rate(
    budget: float,
    sigma: float,
    rounds: int,
    delta: float,
    *,
    q_min: float = 1e-6,
    spent_rdp: np.ndarray | None = None,
) -> float:
    """The largest q in (0, 1] whose `rounds` rounds keep ε(δ) <= `budget` (ε grows with q):
    1 when q = 1 does, 0 when not even `q_min` does; else the root of ε(q) = budget in log q
    (Brent, to 1e-4), stepped down until it keeps the budget. `spent_rdp` (orders,): the
    RDP the client has already spent (`columns_rdp`'s row), composed before the rounds."""
    from scipy.optimize import brentq

    if spent_rdp is None:

        def eps(q: float) -> float:
            return poisson_epsilon(q, sigma, rounds, delta)
    else:
        spent = np.asarray(spent_rdp, dtype=float)

        def eps(q: float) -> float:
            rdp = spent + max(rounds, 0) * poisson_round_rdp(q, sigma)
            return float(rdp_to_epsilon(rdp, delta)[0])

    if (rounds <= 0 and spent_rdp is None) or eps(1.0) <= budget:
        return 1.0
    if eps(q_min) > budget:
        return 0.0
    root = brentq(lambda t: eps(math.exp(t)) - budget, math.log(q_min), 0.0, xtol=1e-4)
    t = root
    while t > math.log(q_min) and eps(math.exp(t)) > budget:
        t -= 1e-4
    return math.exp(t)


def noise_multiplier_for_epsilon(
    target_epsilon: float,
    events_kind: str,
    rate: float,
    rounds: int,
    delta: float,
    n_clients: int = 0,
    decimals: int = 3,
) -> float:
    """The smallest σ on the grid of 10^-`decimals` (so rounded up) whose ε(δ) after `rounds`
    rounds of one `events_kind` event at `rate` (`epsilon`; "uniform": m/N of `n_clients`)
    is <= `target_epsilon`: ε falls as σ grows, so σ − 10^-decimals exceeds the target.
    An upper end by doubling, the root of ε(σ) = target in log σ (Brent), then the grid's
    neighbours of the root checked one by one."""
    from scipy.optimize import brentq

    _check_target(target_epsilon, events_kind, rate, rounds, delta, n_clients, decimals)
    step = 10.0**-decimals
    events = [(events_kind, float(rate), int(rounds))]

    def eps(sigma: float) -> float:
        return epsilon(events, sigma, delta, n_clients)

    def keeps(units: int) -> bool:  # ε at σ = units·step within the target
        return units > 0 and eps(round(units * step, decimals)) <= target_epsilon

    lo, hi = 0.5, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            raise ConfigError(f"no noise multiplier up to 1e6 keeps ε <= {target_epsilon}")
    if eps(lo) <= target_epsilon:  # a root below 0.5: bisect on the grid's integers instead
        units_lo, units = 0, math.ceil(lo / step)
        while units - units_lo > 1:
            mid = (units_lo + units) // 2
            units_lo, units = (units_lo, mid) if keeps(mid) else (mid, units)
        return round(units * step, decimals)
    root = brentq(
        lambda t: math.log(eps(math.exp(t)) / target_epsilon),
        math.log(lo),
        math.log(hi),
        xtol=step / (8 * hi),
    )
    units = math.ceil(math.exp(root) / step - 1e-9)
    while keeps(units - 1):
        units -= 1
    while not keeps(units):
        units += 1
    return round(units * step, decimals)


def _check_target(
    target: float, kind: str, rate: float, rounds: int, delta: float, n: int, decimals: int
) -> None:
    def bad(name: str, value: object, allowed: str) -> ConfigError:
        return ConfigError(f"{name} = {value!r}: must be {allowed}")

    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise bad("target_epsilon", target, "a finite number > 0")
    if kind not in EVENT_KINDS:
        raise bad("events_kind", kind, f"one of {', '.join(EVENT_KINDS)}")
    if not (isinstance(rate, (int, float)) and 0 < rate <= 1):
        raise bad("rate", rate, "in (0, 1]")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise bad("rounds", rounds, "an integer >= 1")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise bad("delta", delta, "in (0, 1)")
    if kind == "uniform" and (not isinstance(n_clients := n, int) or n_clients < 1):
        raise bad("n_clients", n, "an integer >= 1 for 'uniform' (m of N sampling)")
    if isinstance(decimals, bool) or not isinstance(decimals, int) or not 0 <= decimals <= 9:
        raise bad("decimals", decimals, "an integer in 0..9")


def sum_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """Adaptive clipping's noise multiplier σ_Δ of the clipped sum, for a total z
    (``privacy.noise_multiplier``, what the accounting uses) and the standard deviation σ_b
    of the noise on the count of unclipped updates (``privacy.clip_count_noise``).

    Andrew et al. 2021 (Theorem 1): the sum with noise σ_Δ·C (sensitivity C) and the count
    of the shifted bits b_n − 1/2 with noise σ_b (sensitivity 1/2) released together are one
    Gaussian mechanism with z^-2 = σ_Δ^-2 + (2σ_b)^-2, so σ_Δ = (z^-2 − (2σ_b)^-2)^(-1/2);
    under replace-one both sensitivities double and the pair is the Gaussian at z/2, as the
    sum alone at z. z = 0: no noise (0). 2σ_b <= z leaves no budget for the sum."""
    if noise_multiplier == 0:
        return 0.0
    rest = noise_multiplier**-2 - (2.0 * count_noise) ** -2
    if not rest > 0:
        raise ConfigError(
            f"privacy.clip_count_noise = {count_noise!r}: must be > privacy.noise_multiplier "
            f"/ 2 = {noise_multiplier / 2:g}: the count's noise σ_b spends (2σ_b)^-2 of the "
            f"round's budget z^-2 and leaves none for the sum (σ_sum = (z^-2 - (2σ_b)^-2)^-1/2)"
        )
    return rest**-0.5


def next_clip(
    clip_norm: float, unclipped_fraction: float, target_quantile: float, learning_rate: float
) -> float:
    """The geometric update of adaptive clipping (Andrew et al. 2021): C·exp(−η(b̃ − γ)),
    with b̃ the noised share of unclipped updates and γ the target quantile: C shrinks while
    more than γ of the updates fit within it and grows while fewer do."""
    return clip_norm * math.exp(-learning_rate * (unclipped_fraction - target_quantile))


def noise_over_signal(
    noise_multiplier: float, noised_entries: int, expected_participants: float
) -> float:
    """z·√d/m: the norm of central DP's noise on the round's sum, σ·C·√d over d noised
    entries, relative to the most the clipped updates can add up to, m·C with m the expected
    participants (all pointing the same way). Above 1 the noise outweighs the whole signal a
    round can carry; z/m alone misses the √d (docs/privacy.md, "Which cohort"). m = 0: inf."""
    if noise_multiplier == 0:
        return 0.0
    if expected_participants <= 0:
        return math.inf
    return noise_multiplier * math.sqrt(noised_entries) / expected_participants
