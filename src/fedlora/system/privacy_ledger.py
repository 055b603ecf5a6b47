"""Every client's privacy history of one run (docs/privacy.md): what each round released, at
which settings, and every client's ε(δ) composed from the rounds as they actually ran.

Two records, both plain data (checkpointed in the run's progress, so a resumed run goes on
from them):

    segments   the rounds' settings, runs of consecutive rounds with the same mode, noise
               multiplier σ (the accounting's), clip bound C and sampling:
               ``{"rounds": [first, last], "mode", "noise_multiplier", "clip_norm",
               "sampling"}``; a round released without noise (``privacy.mode = "none"``
               before a resume into DP) has mode "none"
    columns    every client's events, as columns over the clients: (kind, σ) with each
               client's rate q_n and count of rounds; a round at the rates of an earlier
               column adds to its counts (constant q: one column; a new plan: a new one)

so a run resumed with another σ composes the old rounds at the old σ and the new at the new,
and a run that released un-noised adapters reports ε = inf.

A round updates the columns with numpy, and every client's ε is one sum of cached RDP vectors
and one conversion, both numpy over the clients (`fedlora.system.privacy.columns_epsilons`):
with N clients at N different rates, no Python work per client and round
(bench/cohort_scaling.py --accounting). Pure Python and numpy; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlora.system.privacy import RATE_DIGITS, UNPROTECTED, columns_epsilons, columns_rdp


@dataclass(frozen=True)
class RoundSetting:
    """What one round released under: `mode` ("central", "local", "none"), the accounting's
    noise multiplier, the clip bound it used and the sampling ("poisson", "uniform",
    "local", "none")."""

    mode: str
    noise_multiplier: float
    clip_norm: float | None
    sampling: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "sampling": self.sampling,
        }


NO_PRIVACY = RoundSetting("none", 0.0, None, "none")


class PrivacyLedger:
    """Every client's events and the rounds' settings (the module docstring)."""

    def __init__(self, n_clients: int) -> None:
        self.n = int(n_clients)
        # event columns: {"kind", "sigma", "rates" (N,), "counts" (N,)}, one per (kind, σ,
        # rate vector) in the order they were first used
        self.columns: list[dict[str, Any]] = []
        self.segments: list[dict[str, Any]] = []
        self.rounds = 0  # rounds accounted (with or without noise)

    @classmethod
    def restore(
        cls, n_clients: int, saved: Any, *, legacy_sigma: float, legacy_rounds: int
    ) -> PrivacyLedger:
        """The ledger of a checkpoint's ``privacy_ledger``: this module's dict, None (no round
        accounted yet), or the list an older fedlora wrote (per client ``[kind, rate,
        count]``, without σ or rounds: those are taken as `legacy_sigma` and
        `legacy_rounds`, what that version assumed)."""
        ledger = cls(n_clients)
        if saved is None:
            return ledger
        if isinstance(saved, dict):
            ledger.rounds = int(saved["rounds"])
            ledger.segments = [dict(s) for s in saved["segments"]]
            ledger.columns = [
                {
                    "kind": str(c["kind"]),
                    "sigma": float(c["sigma"]),
                    "rates": np.asarray(c["rates"], dtype=float),
                    "counts": np.asarray(c["counts"], dtype=np.int64),
                }
                for c in saved["columns"]
            ]
            return ledger
        ledger.rounds = int(legacy_rounds)
        for i, events in enumerate(saved):
            for kind, rate, count in events:
                rates = np.zeros(ledger.n)
                rates[i] = float(rate)
                counts = np.zeros(ledger.n, dtype=np.int64)
                counts[i] = int(count)
                ledger._add_column(str(kind), float(legacy_sigma), rates, counts)
        return ledger

    def copy(self) -> PrivacyLedger:
        other = PrivacyLedger(self.n)
        other.columns = [
            {**c, "rates": c["rates"].copy(), "counts": c["counts"].copy()} for c in self.columns
        ]
        other.segments = [dict(s) for s in self.segments]
        other.rounds = self.rounds
        return other

    def record(
        self,
        setting: RoundSetting,
        kind: str,
        rates: Sequence[float] | np.ndarray,
        mask: Sequence[bool] | np.ndarray | None = None,
    ) -> None:
        """One round released under `setting`: client n exposed as `kind` at `rates[n]`
        (where `mask` is true, or all)."""
        self.rounds += 1
        self._add_segment(setting, 1)
        rates = np.round(np.broadcast_to(np.asarray(rates, dtype=float), (self.n,)), RATE_DIGITS)
        exposed = np.ones(self.n, bool) if mask is None else np.asarray(mask, dtype=bool)
        self._add_column(kind, float(setting.noise_multiplier), rates, exposed.astype(np.int64))

    def record_unprotected(self, rounds: int) -> None:
        """`rounds` rounds that released the adapter without noise: every client exposed
        with no guarantee (its ε is inf from here on)."""
        if rounds <= 0:
            return
        self.rounds += rounds
        self._add_segment(NO_PRIVACY, rounds)
        self._add_column(UNPROTECTED, 0.0, np.ones(self.n), np.full(self.n, rounds, np.int64))

    def _add_column(self, kind: str, sigma: float, rates: np.ndarray, counts: np.ndarray) -> None:
        """Add `counts` to the column of (kind, σ) whose rates agree where they count (a round
        at the rates of an earlier one: the same event again), or start a new column."""
        for c in self.columns:
            if c["kind"] != kind or c["sigma"] != sigma:
                continue
            both = (c["counts"] > 0) & (counts > 0)
            if np.array_equal(c["rates"][both], rates[both]):
                c["rates"] = np.where(counts > 0, rates, c["rates"])
                c["counts"] = c["counts"] + counts
                return
        self.columns.append({"kind": kind, "sigma": sigma, "rates": rates, "counts": counts})

    def _add_segment(self, setting: RoundSetting, rounds: int) -> None:
        first = self.rounds - rounds + 1
        last = self.segments[-1] if self.segments else None
        fields = setting.as_dict()
        if last is not None and last["rounds"][1] == first - 1 and _same(last, fields):
            last["rounds"] = [last["rounds"][0], self.rounds]
        else:
            self.segments.append({"rounds": [first, self.rounds], **fields})

    @property
    def unprotected_rounds(self) -> int:
        """Rounds released without noise."""
        return sum(
            s["rounds"][1] - s["rounds"][0] + 1 for s in self.segments if s["mode"] == "none"
        )

    def history(self, client: int) -> list[tuple[str, float, float, int]]:
        """Client `client`'s events (kind, rate, σ, count)."""
        return [
            (c["kind"], float(c["rates"][client]), c["sigma"], int(c["counts"][client]))
            for c in self.columns
            if c["counts"][client]
        ]

    def epsilons(self, delta: float) -> list[float]:
        """Every client's ε(δ) so far, each round at its own σ (`columns_epsilons`: numpy over
        the clients, each distinct (kind, rate, σ) accounted once)."""
        return columns_epsilons(self.columns, delta, self.n).tolist()

    def rdp(self) -> np.ndarray:
        """(N, orders) every client's Rényi DP so far (`columns_rdp`; inf for a client exposed
        without noise): what a plan made now composes its rounds after."""
        return columns_rdp(self.columns, self.n)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "segments": [dict(s) for s in self.segments],
            "columns": [
                {
                    "kind": c["kind"],
                    "sigma": c["sigma"],
                    "rates": c["rates"].tolist(),
                    "counts": c["counts"].tolist(),
                }
                for c in self.columns
            ],
        }


def _same(segment: dict[str, Any], fields: dict[str, Any]) -> bool:
    return all(segment[k] == v for k, v in fields.items())
