"""Admission per source address (orchestrator/admission.py): what the unproven keys of one address
may hold, and the reserve that keeps a newcomer from another address in, by hand at the shipped
sizes (leases of 8, 32 outstanding: a share of 16, one lease per source, a reserve of 4 leases)."""

from __future__ import annotations

import sqlite3

import pytest

from swarmrl.config import OrchestratorConfig
from swarmrl.orchestrator.admission import UnprovenLimits, unproven_lease
from swarmrl.orchestrator.store import Store

SHIPPED = UnprovenLimits.of(OrchestratorConfig(), outstanding=32, lease_prompts=8)


def test_the_shipped_limits():
    assert SHIPPED == UnprovenLimits(share=16, per_source=8, reserve=32)
    # The share is never below one lease; the per-source cap and the reserve count full leases.
    o = OrchestratorConfig(unproven_leases_per_source=2, unproven_reserve_leases=0)
    assert UnprovenLimits.of(o, outstanding=4, lease_prompts=4) == UnprovenLimits(share=4, per_source=8, reserve=0)


@pytest.mark.parametrize(
    "hoarders, source, expect",
    [
        ({}, "10.0.0.9", 8),  # nothing held: a full lease
        ({"10.0.0.1": 8}, "10.0.0.1", 0),  # N keys of one address hold one lease together
        ({"10.0.0.1": 8}, "10.0.0.9", 8),  # 8 + 8 fits the share
        ({"10.0.0.1": 8, "10.0.0.2": 8}, "10.0.0.9", 8),  # 24 > 16, but 24 <= 16 + 32 and it holds none
        ({f"10.0.0.{i}": 8 for i in range(5)}, "10.0.0.9", 8),  # five addresses hoard: 48 <= 48
        ({f"10.0.0.{i}": 8 for i in range(6)}, "10.0.0.9", 0),  # six: the reserve is full too
        ({"10.0.0.1": 3}, "10.0.0.1", 5),  # room for 5 at its address: a smaller lease
    ],
)
def test_a_newcomer_from_another_address_gets_room(hoarders, source, expect):
    n, why = unproven_lease(8, source, hoarders, 0, SHIPPED)
    assert n == expect
    assert (why is None) == (expect > 0)


def test_the_refusals_say_which_cap():
    n, why = unproven_lease(8, "10.0.0.1", {"10.0.0.1": 8}, 0, SHIPPED)
    assert n == 0 and why == "new workers from 10.0.0.1 hold 8 of the 8 prompts they may hold together"
    n, why = unproven_lease(8, "10.0.0.9", {f"10.0.0.{i}": 8 for i in range(6)}, 0, SHIPPED)
    assert n == 0 and why == (
        "new workers hold 48 of the 16 prompts they may hold together (32 more are kept for addresses holding none)"
    )


def test_the_reserve_is_for_addresses_holding_nothing():
    # Two leases per address: an address holding one may add the second within the share...
    limits = UnprovenLimits(share=16, per_source=16, reserve=32)
    assert unproven_lease(8, "a", {"a": 8}, 0, limits) == (8, None)
    # ...but not from the reserve: beyond the share only an address holding none gets in.
    assert unproven_lease(8, "a", {"a": 8, "b": 8}, 0, limits)[0] == 0
    assert unproven_lease(8, "c", {"a": 8, "b": 8}, 0, limits) == (8, None)


def test_prompts_an_address_let_expire_count_against_it():
    # A hoarder's key lost its allowance; its fresh key from the same address finds none either.
    n, why = unproven_lease(8, "10.0.0.1", {}, 8, SHIPPED)
    assert n == 0 and why == (
        "new workers from 10.0.0.1 hold 0 of the 8 prompts they may hold together, less 8 they let expire lately"
    )
    assert unproven_lease(8, "10.0.0.1", {}, 3, SHIPPED) == (5, None)  # a smaller lease, sooner back
    assert unproven_lease(8, "10.0.0.2", {}, 0, SHIPPED) == (8, None)  # other addresses are not charged
    assert unproven_lease(2, "10.0.0.2", {}, 0, SHIPPED) == (2, None)  # never more than its own allowance


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
            assert store.unproven_held(tx, proven_after=4) == [("", "k", 1, 0)]
            store.create_lease(tx, "m", "k", 0, 1e12, 0, 0, 1, "10.0.0.1")
            store.add_slot(tx, "m", 0, 4, None, "[1]")
            store.penalise(tx, "k", 2, 100.0, "10.0.0.1")
            assert sorted(store.unproven_held(tx, proven_after=4)) == [("", "k", 1, 0), ("10.0.0.1", "k", 1, 0)]
            assert store.source_expired(tx, "10.0.0.1", since=50.0) == 2
            assert store.source_expired(tx, "10.0.0.1", since=150.0) == 0
    finally:
        store.close()
