"""In-process totals for /metrics (leases issued, groups accepted, rejections by reason, ...):
every component counts into one `Counters`; a restart starts them from zero, the durable state
is in the store."""

from __future__ import annotations

import threading


class Counters:
    """Named running totals. Owns `_totals`, guarded by `_lock` (components count from every
    request thread)."""

    def __init__(self):
        self._totals: dict[str, float] = {}
        self._lock = threading.Lock()

    def count(self, name: str, by: float = 1.0) -> None:
        with self._lock:
            self._totals[name] = self._totals.get(name, 0.0) + by

    def totals(self) -> dict[str, float]:
        """A copy of every total."""
        with self._lock:
            return dict(self._totals)
