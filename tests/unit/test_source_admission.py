"""Admission per source address (orchestrator/admission.py): the unproven keys' share (first
come), and beyond it the reserve where each address is sure of one lease, by hand at the shipped
sizes (leases of 8, 32 outstanding: a share of 16, one lease per address, a reserve of 4 leases)."""

from __future__ import annotations

import sqlite3

import pytest

from swarmrl.config import OrchestratorConfig
from swarmrl.orchestrator.admission import UnprovenLimits, unproven_lease
from swarmrl.orchestrator.store import Store

SHIPPED = UnprovenLimits.of(OrchestratorConfig(), outstanding=32, lease_prompts=8)
FIVE = {f"10.0.0.{i}": 8 for i in range(5)}


def test_the_shipped_limits():
    assert SHIPPED == UnprovenLimits(share=16, per_source=8, reserve=32)
    # The share is never below one lease; the per-address part and the reserve count full leases.
    o = OrchestratorConfig(unproven_leases_per_source=2, unproven_reserve_leases=0)
    assert UnprovenLimits.of(o, outstanding=4, lease_prompts=4) == UnprovenLimits(share=4, per_source=8, reserve=0)


@pytest.mark.parametrize(
    "held, source, expect",
    [
        ({}, "a", 8),
        ({"a": 8}, "a", 8),  # within the share, first come: one address may fill it (8 + 8 = 16)
        ({"a": 16}, "a", 0),  # beyond it, an address holding its lease's worth gets nothing more
        ({"a": 16}, "b", 8),  # ...and another address gets its lease from the reserve (24 <= 48)
        ({"a": 8, "b": 8}, "c", 8),
        ({**FIVE, "z": 0}, "z", 8),  # five addresses hoard 40: room for one more (48 <= 48)
        ({**FIVE, "10.0.0.5": 8}, "z", 0),  # six: the reserve is full too
        ({"a": 16, "b": 3}, "b", 5),  # 3 held of its 8: a smaller lease, back sooner
        ({"a": 16, "b": 8, "c": 8, "d": 8, "e": 5}, "f", 3),  # 3 left in the reserve
    ],
)
def test_a_newcomer_from_another_address_gets_room(held, source, expect):
    n, why = unproven_lease(8, source, held, 0, SHIPPED)
    assert n == expect
    assert (why is None) == (expect > 0)


def test_the_refusal_says_what_is_held():
    n, why = unproven_lease(8, "10.0.0.9", {**FIVE, "10.0.0.5": 8}, 0, SHIPPED)
    assert n == 0 and why == (
        "new workers hold 48 of the 16 prompts they may hold together, and beyond that each address 8 "
        "of a reserve of 32: those from 10.0.0.9 hold 0"
    )


def test_prompts_an_address_let_expire_count_against_its_reserve_lease():
    # A hoarder's key lost its allowance; its fresh key from the same address finds no reserve.
    n, why = unproven_lease(8, "a", {"b": 16}, 8, SHIPPED)
    assert n == 0 and why.endswith("those from a hold 0 and let 8 expire lately")
    assert unproven_lease(8, "a", {"b": 16}, 3, SHIPPED) == (5, None)  # a smaller lease, back sooner
    assert unproven_lease(8, "c", {"b": 16}, 0, SHIPPED) == (8, None)  # other addresses are not charged
    # Within the share it is first come: the key's own allowance has already paid for its expiry.
    assert unproven_lease(8, "a", {}, 8, SHIPPED) == (8, None)
    assert unproven_lease(2, "c", {"b": 16}, 0, SHIPPED) == (2, None)  # never more than its own allowance


def test_a_run_directory_of_an_earlier_version_gains_the_source_columns(tmp_path):
    """Leases and penalties stored before sources were recorded: the store adds the columns, and
    an old open lease counts as source '' until it ends."""
    db = sqlite3.connect(tmp_path / "orchestrator.sqlite")
    db.executescript(
        """
        CREATE TABLE workers (key TEXT PRIMARY KEY, name TEXT NOT NULL, registered REAL NOT NULL,
            last_seen REAL NOT NULL, accepted INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0,
            banned INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE leases (id TEXT PRIMARY KEY, worker TEXT NOT NULL, created REAL NOT NULL,
            expires REAL NOT NULL, min_version INTEGER NOT NULL, max_version INTEGER NOT NULL,
            slots INTEGER NOT NULL, state TEXT NOT NULL);
        CREATE TABLE penalties (worker TEXT NOT NULL, slots INTEGER NOT NULL, at REAL NOT NULL);
        INSERT INTO workers (key, name, registered, last_seen) VALUES ('k', 'old', 0, 0);
        INSERT INTO leases VALUES ('l', 'k', 0, 1e12, 0, 0, 1, 'open');
        """
    )
    db.close()
    store = Store(tmp_path / "orchestrator.sqlite")
    try:
        with store.tx() as tx:
            store.add_slot(tx, "l", 0, 3, None, "[1]")
            assert store.unproven_held(tx, proven_after=4) == [("", "k", 1, 0, 0)]
            store.create_lease(tx, "m", "k", 0, 1e12, 0, 0, 1, "10.0.0.1")
            store.add_slot(tx, "m", 0, 4, None, "[1]")
            store.penalise(tx, "k", 2, 100.0, "10.0.0.1")
            assert sorted(store.unproven_held(tx, proven_after=4)) == [("", "k", 1, 0, 0), ("10.0.0.1", "k", 1, 0, 0)]
            assert store.source_expired(tx, "10.0.0.1", since=50.0) == 2
            assert store.source_expired(tx, "10.0.0.1", since=150.0) == 0
    finally:
        store.close()


def test_an_unproven_keys_groups_awaiting_the_validator_are_counted_apart(tmp_path):
    """Groups an unproven key submitted that wait for the validator are its own column, which
    leasing takes out of the back-pressure count (garbage from free keys queued for the
    validator must not hold proven workers' leases back); once validated and queued for the
    trainer they count as any group does."""
    from swarmrl.orchestrator.errors import WAITING

    store = Store(tmp_path / "orchestrator.sqlite")
    try:
        store.register("k", "new")
        with store.tx() as tx:
            store.create_lease(tx, "m", "k", 0, 1e12, 0, 0, 5, "10.0.0.1")
            for slot in range(5):
                store.add_slot(tx, "m", slot, slot, None, "[1]")
            for slot, state in enumerate(["pending", "pending", "validating", "queued"]):
                store.add_group(tx, "m", slot, "k", 0, 0.0, "{}", True, state, "[]")
            assert store.unproven_held(tx, proven_after=4) == [("10.0.0.1", "k", 5, 0, 3)]
            assert store.count_groups(tx, WAITING) - 3 == 1  # the validated one still counts
            assert store.unproven_held(tx, proven_after=0) == []  # a proven key's count as any
    finally:
        store.close()
