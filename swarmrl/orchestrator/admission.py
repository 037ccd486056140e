"""Admission: what a worker key may hold and use is earned by validated work.

A key costs nothing to make, so nothing a key can do before it has done useful work may cost the
run much (docs/security.md). Three rules, all here as pure functions or small objects:

  * a key's lease allowance (prompts it may hold leased at once) starts small, grows with its
    accepted groups and shrinks, for `penalty_window_s`, by every slot it let expire and every
    fraudulent group: a key that hoards leases and never submits soon holds nothing;
  * unproven keys (fewer than `proven_after` groups passed by the validator) together hold at most a share of
    the outstanding work, so a flood of fresh keys cannot take the slots proven workers need; and
    the unproven keys of one source address (an IPv6 /64) hold at most `unproven_leases_per_source`
    leases, less the prompts that source's unproven keys let expire lately, with a reserve beyond
    the share for sources holding nothing: strangers crowd out only each other, and a newcomer
    from another address gets a lease while free keys from a few addresses hoard;
  * grading (the expensive step a submission can trigger for free) runs in a few lanes, at most
    one submission per key at a time, and unproven keys share one lane: their garbage waits
    behind each other, never in front of a proven worker's groups.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from swarmrl.config import OrchestratorConfig


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

    share: int  # all of them together (unproven_share)
    per_source: int  # the keys of one source together
    reserve: int  # beyond `share`, for sources whose unproven keys hold nothing

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

    Per source first: its keys together hold at most `per_source`, less `expired` (fresh keys
    cost nothing, so the penalty a hoarder's key gets must also reach its address), and a source
    with less room than `n` gets a smaller lease, like a key with a small allowance. Then all
    sources: within `share`, or within `share + reserve` for a source that holds nothing, so a
    newcomer finds room while other addresses' keys hoard (until they hold the reserve too)."""
    mine, total = held.get(source, 0), sum(held.values())
    room = limits.per_source - expired - mine
    if room <= 0:
        return 0, (
            f"new workers from {source} hold {mine} of the {limits.per_source} prompts they may hold together"
            + (f", less {expired} they let expire lately" if expired else "")
        )
    n = min(n, room)
    if total + n <= limits.share or (mine == 0 and total + n <= limits.share + limits.reserve):
        return n, None
    return 0, (
        f"new workers hold {total} of the {limits.share} prompts they may hold together "
        f"({limits.reserve} more are kept for addresses holding none)"
    )


def lease_timeout(base_s: float, prompts: int, lease_prompts: int) -> float:
    """A lease's time scales with its work (a quarter of the full-lease time at the least), so a
    small lease held by a key that never submits comes back sooner."""
    return base_s * max(0.25, prompts / max(1, lease_prompts))


class Busy(Exception):
    """No grading lane came free in time."""


class GradingLanes:
    """`lanes` objects (e.g. verifier pools) handed out one caller at a time, at most one per key
    at once, and at most one at a time to unproven keys."""

    def __init__(self, lanes: list, wait_s: float):
        self.free: queue.Queue = queue.Queue()
        for lane in lanes:
            self.free.put(lane)
        self.all = list(lanes)
        self.wait_s = wait_s
        self.unproven = threading.Semaphore(1)
        self.keys: set[str] = set()
        self.lock = threading.Lock()

    @contextmanager
    def lane(self, key: str, proven: bool) -> Iterator:
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
                    yield lane
                finally:
                    self.free.put(lane)
            finally:
                if not proven:
                    self.unproven.release()
        finally:
            with self.lock:
                self.keys.discard(key)

    def close(self) -> None:
        for lane in self.all:
            lane.close()
