"""Every client's privacy history of one run (docs/privacy.md): what each round released, at
which settings, and every client's ε(δ) composed from the rounds as they actually ran.

Two records, both plain data (checkpointed in the run's progress, so a resumed run goes on
from them):

    segments   the rounds' settings, runs of consecutive rounds with the same mode, noise
               multiplier σ (the accounting's), clip bound C and sampling:
               ``{"rounds": [first, last], "mode", "noise_multiplier", "clip_norm",
               "sampling"}``; a round released without noise (``privacy.mode = "none"``
               before a resume into DP) has mode "none"
    clients    per client, how many rounds exposed it at each (kind, rate q, σ): the events
               `fedlora.system.privacy.history_epsilon` composes, each at its own σ

so a run resumed with another σ composes the old rounds at the old σ and the new at the new,
and a run that released un-noised adapters reports ε = inf. Pure Python; no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlora.system.privacy import RATE_DIGITS, UNPROTECTED, history_epsilon

Key = tuple[str, float, float]  # (kind, rate, σ)


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
        self.clients: list[dict[Key, int]] = [{} for _ in range(self.n)]
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
            clients = saved["clients"]
        else:
            ledger.rounds = int(legacy_rounds)
            clients = [[[k, r, legacy_sigma, c] for k, r, c in events] for events in saved]
        for i, events in enumerate(clients):
            for kind, rate, sigma, count in events:
                ledger.clients[i][(str(kind), float(rate), float(sigma))] = int(count)
        return ledger

    def copy(self) -> PrivacyLedger:
        return copy.deepcopy(self)

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
        rates = np.broadcast_to(np.asarray(rates, dtype=float), (self.n,))
        sigma = float(setting.noise_multiplier)
        for i in range(self.n):
            if mask is None or mask[i]:
                key = (kind, round(float(rates[i]), RATE_DIGITS), sigma)
                self.clients[i][key] = self.clients[i].get(key, 0) + 1

    def record_unprotected(self, rounds: int) -> None:
        """`rounds` rounds that released the adapter without noise: every client exposed
        with no guarantee (its ε is inf from here on)."""
        if rounds <= 0:
            return
        self.rounds += rounds
        self._add_segment(NO_PRIVACY, rounds)
        key = (UNPROTECTED, 1.0, 0.0)
        for events in self.clients:
            events[key] = events.get(key, 0) + rounds

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

    def epsilons(self, delta: float) -> list[float]:
        """Every client's ε(δ) so far, each round at its own σ."""
        return [
            history_epsilon([(k, r, s, c) for (k, r, s), c in events.items()], delta, self.n)
            for events in self.clients
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "segments": [dict(s) for s in self.segments],
            "clients": [
                [[k, r, s, c] for (k, r, s), c in sorted(events.items())] for events in self.clients
            ],
        }


def _same(segment: dict[str, Any], fields: dict[str, Any]) -> bool:
    return all(segment[k] == v for k, v in fields.items())
