"""Admission: what a worker key may hold and use is earned by validated work.

A key costs nothing to make, so nothing a key can do before it has done useful work may cost the
run much (docs/security.md). Three rules, all here as pure functions or small objects:

  * a key's lease allowance (prompts it may hold leased at once) starts small, grows with its
    accepted groups and shrinks, for `penalty_window_s`, by every slot it let expire and every
    fraudulent group: a key that hoards leases and never submits soon holds nothing;
  * unproven keys (fewer than `proven_after` groups passed by the validator) together hold at most a share of
    the outstanding work, so a flood of fresh keys cannot take the slots proven workers need; and
    once that share is full, each source address (an IPv6 /64) is still sure of its own share,
    `unproven_leases_per_source` leases from a reserve, unless its unproven keys hold that much
    or let that much expire lately: keys from one address crowd out only each other, and a
    newcomer from another address gets a lease while free keys from a few addresses hoard;
  * grading (the expensive step a submission can trigger for free) runs in a few lanes, at most
    one submission per key at a time, and unproven keys share one lane: their garbage waits
    behind each other, never in front of a proven worker's groups. The time an unproven key's
    submissions hold that lane is charged to the key and to the address it leased from
    (`GradingMeter`): a submission stops being graded once they have used their grading seconds,
    and the next waits until they are back, so one key's expensive answers slow only that key;
    a key refused only because the lane was busy keeps its lease (`extended_expiry`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from swarmrl.config import OrchestratorConfig
from swarmrl.rewards.pool import Outcome


@dataclass(frozen=True)
class Standing:
    """What the orchestrator knows about a key when it asks for work."""

    accepted: int  # groups that passed every check they were given
    expired_recent: int  # slots it let expire within the penalty window
    fraud_recent: int  # fraudulent groups within the penalty window
    leased: int  # slots it holds now (open or being scored)
    waiting: int = 0  # its groups awaiting the validator
    validated: int = 0  # groups the validator passed: only these make a key proven

    def held(self, o: OrchestratorConfig) -> int:
        """What counts against the allowance now. An unproven key's groups awaiting validation
        count: until the validator passed them they prove nothing (and a flood of free keys'
        garbage must not fill the queue the batches come from). A proven key's do not, so a
        validator busy with someone else's garbage never holds up proven workers."""
        return self.leased + (0 if is_proven(self.validated, o) else self.waiting)


def allowance(standing: Standing, o: OrchestratorConfig, lease_prompts: int) -> int:
    """Prompts a key may hold leased at once: `new_key_slots` plus what its accepted groups earned,
    capped at `max_open_leases` full leases, less its recent penalties (each expired slot and each
    fraudulent group costs one prompt)."""
    earned = o.new_key_slots + int(standing.accepted * o.slots_per_accepted)
    cap = o.max_open_leases * lease_prompts
    return max(0, min(cap, earned) - standing.expired_recent - standing.fraud_recent)


def is_proven(validated: int, o: OrchestratorConfig) -> bool:
    """Proven: `proven_after` of its groups passed the validator. Groups that got only the cheap
    checks (validator.rate < 1) do not count: nobody checked that they are real."""
    return validated >= o.proven_after


def lease_size(free_slots: int, lease_prompts: int, allowed: int) -> int:
    """Prompts in the next lease: a full lease (`lease_prompts`) once there is room for one, so a
    worker is not fed a trickle of small leases it batches badly; a key whose whole allowance is
    less than a lease gets leases of its allowance. 0: wait."""
    size = min(lease_prompts, allowed)
    return size if size > 0 and free_slots >= size else 0


def unproven_share(o: OrchestratorConfig, outstanding: int, lease_prompts: int) -> int:
    """Prompts all unproven keys may hold together: `unproven_share` of the outstanding work, and
    never less than one lease, or no new key could ever start (and become proven)."""
    return max(lease_prompts, int(o.unproven_share * outstanding))


@dataclass(frozen=True)
class UnprovenLimits:
    """Prompts unproven keys may hold (leased, being scored or awaiting the validator)."""

    share: int  # all of them together, first come (unproven_share)
    per_source: int  # what each address is sure of beyond the share
    reserve: int  # beyond `share`, for addresses holding less than `per_source`

    @classmethod
    def of(cls, o: OrchestratorConfig, outstanding: int, lease_prompts: int) -> UnprovenLimits:
        return cls(
            share=unproven_share(o, outstanding, lease_prompts),
            per_source=o.unproven_leases_per_source * lease_prompts,
            reserve=o.unproven_reserve_leases * lease_prompts,
        )


def unproven_lease(
    n: int, source: str, held: Mapping[str, int], expired: int, limits: UnprovenLimits
) -> tuple[int, str | None]:
    """Prompts an unproven key from `source` may lease now (at most `n`, what its own allowance
    gives), or (0, why not). `held`: what unproven keys hold, by source; `expired`: prompts the
    unproven keys of `source` let expire within the penalty window.

    Within `share`, first come, whatever the address (one address's keys may fill it: a run
    whose own workers share an address starts as fast as before). Beyond it, up to `share +
    reserve`, an address gets what its keys hold plus what they let expire short of
    `per_source`: one lease at the shipped sizes, so a newcomer from another address gets in
    while keys from one address, or from a few, hoard the share. Expired prompts count there
    because fresh keys cost nothing: a hoarder's address, not only its key, pays for a lease it
    let run out."""
    mine, total = held.get(source, 0), sum(held.values())
    if total + n <= limits.share:
        return n, None
    room = min(limits.per_source - mine - expired, limits.share + limits.reserve - total)
    if room > 0:  # a smaller lease when that is all there is room for (it comes back sooner)
        return min(n, room), None
    return 0, (
        f"new workers hold {total} of the {limits.share} prompts they may hold together, and beyond that "
        f"each address {limits.per_source} of a reserve of {limits.reserve}: those from {source} hold {mine}"
        + (f" and let {expired} expire lately" if expired else "")
    )


def lease_timeout(base_s: float, prompts: int, lease_prompts: int) -> float:
    """A lease's time scales with its work (a quarter of the full-lease time at the least), so a
    small lease held by a key that never submits comes back sooner."""
    return base_s * max(0.25, prompts / max(1, lease_prompts))


def extended_expiry(expires: float, created: float, now: float, grace_s: float, longest_s: float) -> float:
    """A lease's deadline while its submission waits for a grading lane busy with others' work:
    at least `grace_s` from `now` (time to come back after a 429), never past `created +
    longest_s`, never earlier than it was. The work of a key that submitted in time is never lost
    to someone else's grading; a key cannot keep a lease alive by it for more than `longest_s`."""
    return max(expires, min(now + grace_s, created + longest_s))


class Busy(Exception):
    """No grading lane came free in time."""


class Spent(Exception):
    """An unproven key, or the address it leased from, has used its grading seconds: it may grade
    again in `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class GradingMeter:
    """Seconds of grading charged to names (an unproven key, and the address it leased from): a
    token bucket per name of `capacity_s`, refilled at `capacity_s` per `window_s`. A submission
    starts only while every one of its names has a tenth of the capacity left, and may use what
    the poorest has left. Its own lock; a name whose bucket is full again is forgotten, so memory
    holds only the names charged within about a window."""

    def __init__(self, capacity_s: float, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.capacity_s, self.window_s, self.clock = capacity_s, window_s, clock
        self.rate = capacity_s / window_s  # seconds of grading regained per second
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (balance, when)
        self._lock = threading.Lock()

    def _balance(self, name: str, now: float) -> float:
        balance, at = self._buckets.get(name, (self.capacity_s, now))
        return min(self.capacity_s, balance + (now - at) * self.rate)

    def left_s(self, names: Sequence[str]) -> float:
        """Grading seconds the poorest of `names` has left (negative: in debt)."""
        now = self.clock()
        with self._lock:
            return min((self._balance(n, now) for n in names), default=self.capacity_s)

    def wait_s(self, names: Sequence[str]) -> tuple[float, str | None]:
        """Seconds until `names` may start grading again (0 and None: now), and which name waits."""
        now, floor = self.clock(), self.capacity_s / 10
        with self._lock:
            poorest = min(names, key=lambda n: self._balance(n, now), default=None)
            left = self.capacity_s if poorest is None else self._balance(poorest, now)
        return (0.0, None) if left >= floor else ((floor - left) / self.rate, poorest)

    def charge(self, names: Sequence[str], seconds: float) -> None:
        now = self.clock()
        with self._lock:
            for name in names:
                self._buckets[name] = (self._balance(name, now) - seconds, now)
            if len(self._buckets) > 1024:
                self._buckets = {n: b for n, b in self._buckets.items() if self._balance(n, now) < self.capacity_s}


class Metered:
    """A grading lane as one unproven submission uses it: `map` runs on the lane's pool a slice of
    the pool's size at a time, and once `allowed_s` have passed the calls not started are not run:
    each gets `reason` as its error (its answer scores 0, as one that ran out of time does)."""

    def __init__(self, pool, allowed_s: float, reason: str, clock: Callable[[], float] = time.monotonic):
        self.pool, self.reason, self.clock = pool, reason, clock
        self.deadline = clock() + allowed_s
        self.size = max(1, int(getattr(pool, "num_workers", 1)))
        self.skipped = 0

    def map(self, fn: Callable, calls: Sequence[tuple]) -> list[Outcome]:
        out: list[Outcome] = []
        for i in range(0, len(calls), self.size):
            part = list(calls[i : i + self.size])
            if self.clock() >= self.deadline:
                self.skipped += len(part)
                out += [Outcome(None, self.reason, 0.0)] * len(part)
            else:
                out += self.pool.map(fn, part)
        return out


def out_of_time(pool) -> str | None:
    """A metered lane's reason once its seconds are spent (an unproven key's), None otherwise (a
    proven key's lane, or time left): checked between calls that run in the caller's process."""
    if isinstance(pool, Metered) and pool.clock() >= pool.deadline:
        return pool.reason
    return None


class GradingLanes:
    """`lanes` objects (e.g. verifier pools) handed out one caller at a time, at most one per key
    at once, and at most one at a time to unproven keys, whose time in it `meter` charges (to the
    key and to the address its lease came from)."""

    def __init__(self, lanes: list, wait_s: float, meter: GradingMeter | None = None):
        self.free: queue.Queue = queue.Queue()
        for lane in lanes:
            self.free.put(lane)
        self.all = list(lanes)
        self.wait_s = wait_s
        self.meter = meter
        self.unproven = threading.Semaphore(1)
        self.keys: set[str] = set()
        self.lock = threading.Lock()

    @staticmethod
    def names(key: str, source: str) -> list[str]:
        """What an unproven key's grading is charged to: the key, and its lease's address (fresh
        keys cost nothing, so a budget per key alone would be one per key an address makes)."""
        return [f"key {key}"] + ([f"address {source}"] if source else [])

    def check(self, key: str, source: str, proven: bool) -> None:
        """Spent, saying why and for how long, when an unproven key or its address may not start
        grading now."""
        if proven or self.meter is None:
            return
        wait, poorest = self.meter.wait_s(self.names(key, source))
        if poorest is not None:
            who = "this key" if poorest.startswith("key ") else f"new workers from {source}"
            m = self.meter
            raise Spent(
                f"{who} used the {m.capacity_s:g} s of grading new workers get per {m.window_s:g} s "
                "(orchestrator.unproven_grading_s): expensive answers cost their sender's time, not others'",
                wait,
            )

    @contextmanager
    def lane(self, key: str, proven: bool, source: str = "") -> Iterator:
        self.check(key, source, proven)
        with self.lock:
            if key in self.keys:
                raise Busy("this key already has a submission being graded; send one at a time")
            self.keys.add(key)
        try:
            if not proven and not self.unproven.acquire(timeout=self.wait_s):
                raise Busy("grading for new workers is busy")
            try:
                try:
                    lane = self.free.get(timeout=self.wait_s)
                except queue.Empty:
                    raise Busy("every grading lane is busy") from None
                try:
                    if proven or self.meter is None:
                        yield lane
                    else:
                        with self._charged(lane, self.names(key, source)) as metered:
                            yield metered
                finally:
                    self.free.put(lane)
            finally:
                if not proven:
                    self.unproven.release()
        finally:
            with self.lock:
                self.keys.discard(key)

    @contextmanager
    def _charged(self, lane, names: list[str]) -> Iterator[Metered]:
        assert self.meter is not None
        m, started = self.meter, self.meter.clock()
        reason = (
            f"not graded: this submission used the grading seconds its key had left (new workers get "
            f"{m.capacity_s:g} s per {m.window_s:g} s, orchestrator.unproven_grading_s)"
        )
        try:
            yield Metered(lane, m.left_s(names), reason, clock=m.clock)
        finally:
            m.charge(names, m.clock() - started)

    def close(self) -> None:
        for lane in self.all:
            lane.close()
