"""The orchestrator's durable state: one SQLite file in WAL mode.

Everything the run cannot afford to lose or double-count lives here: registered workers, seen
nonces, leases and their slots (one slot = one prompt = one group), accepted groups with their
trusted rewards, and the frozen content of every batch. Each public method is one transaction,
so a `kill -9` at any instant leaves either the state before a call or the state after it:

  * a group is accepted by the same transaction that marks its slot submitted, so a worker that
    never saw the reply resubmits and is told "already submitted", and nothing is stored twice;
  * batch n is built by one transaction that marks its groups consumed by step n and stores
    their ids; asking for batch n again returns the same groups, so no group feeds two steps
    and a restarted trainer resumes on exactly the data it was given.

`synchronous=NORMAL` in WAL mode survives a killed process (the OS still holds every committed
page); only a power cut may lose the last transactions. Set SWARMRL_SQLITE_SYNC=FULL to fsync
every commit.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    key TEXT PRIMARY KEY, name TEXT NOT NULL, registered REAL NOT NULL, last_seen REAL NOT NULL,
    accepted INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0, banned INTEGER NOT NULL DEFAULT 0,
    fraud INTEGER NOT NULL DEFAULT 0);         -- rejections no honest worker can get
CREATE TABLE IF NOT EXISTS nonces (key TEXT NOT NULL, nonce TEXT NOT NULL, ts REAL NOT NULL,
    PRIMARY KEY (key, nonce)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS nonces_ts ON nonces (ts);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY, worker TEXT NOT NULL, created REAL NOT NULL, expires REAL NOT NULL,
    min_version INTEGER NOT NULL, max_version INTEGER NOT NULL, slots INTEGER NOT NULL,
    state TEXT NOT NULL);                       -- open | done | expired
CREATE INDEX IF NOT EXISTS leases_open ON leases (state, expires);
CREATE TABLE IF NOT EXISTS slots (
    lease_id TEXT NOT NULL, slot INTEGER NOT NULL, problem INTEGER NOT NULL, target_length INTEGER,
    seeds TEXT NOT NULL, state TEXT NOT NULL,   -- open | scoring | submitted | rejected | expired
    PRIMARY KEY (lease_id, slot));
CREATE TABLE IF NOT EXISTS reissue (id INTEGER PRIMARY KEY AUTOINCREMENT, problem INTEGER NOT NULL,
    target_length INTEGER);
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT, lease_id TEXT NOT NULL, slot INTEGER NOT NULL,
    worker TEXT NOT NULL, policy_version INTEGER NOT NULL, accepted REAL NOT NULL,
    payload TEXT NOT NULL, informative INTEGER NOT NULL,
    -- pending (awaiting the validator) | validating (claimed by one) | queued | uninformative
    -- | consumed | stale | rejected (failed validation)
    state TEXT NOT NULL,
    step INTEGER,                               -- the batch that consumed it
    resolved_step INTEGER,                      -- the batch whose metrics count it
    proofs TEXT,                                -- JSON: per completion, its TOPLOC proofs (base64)
    claimed REAL,                               -- when a validator claimed it
    verdict TEXT,                               -- JSON: the validator's reason and statistics
    UNIQUE (lease_id, slot));
CREATE INDEX IF NOT EXISTS groups_state ON groups (state, id);
CREATE TABLE IF NOT EXISTS batches (step INTEGER PRIMARY KEY, group_ids TEXT NOT NULL,
    metrics TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS policies (version INTEGER PRIMARY KEY, url TEXT NOT NULL,
    manifest TEXT NOT NULL, published REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rejections (id INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT NOT NULL,
    lease_id TEXT, slot INTEGER, reason TEXT NOT NULL, detail TEXT NOT NULL, at REAL NOT NULL);
"""


class Store:
    """Thread-safe (one connection behind a lock); every method is one transaction."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={os.environ.get('SWARMRL_SQLITE_SYNC', 'NORMAL')}")
        self.db.executescript(SCHEMA)
        self._migrate()
        # Slots being scored when the previous process died go back to open: their submission was
        # never accepted, so the worker's retry (or another worker after expiry) may deliver them.
        self.db.execute("UPDATE slots SET state = 'open' WHERE state = 'scoring'")
        # Groups a validator was checking go back to the queue: an in-process validator died with
        # the previous process (an external one's late verdict is still accepted for a pending group).
        self.db.execute("UPDATE groups SET state = 'pending', claimed = NULL WHERE state = 'validating'")

    def _migrate(self) -> None:
        """Columns added after a run directory may have been created (run directories of
        earlier swarmrl versions keep working)."""
        added = {"workers": [("fraud", "INTEGER NOT NULL DEFAULT 0")],
                 "groups": [("proofs", "TEXT"), ("claimed", "REAL"), ("verdict", "TEXT")]}
        for table, cols in added.items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, decl in cols:
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # ---- transactions ------------------------------------------------------------------------
    class _Tx:
        def __init__(self, store: "Store"):
            self.store = store

        def __enter__(self) -> sqlite3.Connection:
            self.store.lock.acquire()
            try:
                self.store.db.execute("BEGIN IMMEDIATE")
            except BaseException:
                self.store.lock.release()  # never leave the lock held: every later call would hang
                raise
            return self.store.db

        def __exit__(self, exc_type, exc, tb) -> None:
            try:
                if exc_type is None:
                    try:
                        self.store.db.execute("COMMIT")
                    except BaseException:
                        if self.store.db.in_transaction:
                            self.store.db.execute("ROLLBACK")
                        raise
                elif self.store.db.in_transaction:
                    self.store.db.execute("ROLLBACK")
            finally:
                self.store.lock.release()

    def tx(self) -> "Store._Tx":
        return Store._Tx(self)

    def query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self.db.execute(sql, args).fetchall()

    # ---- meta --------------------------------------------------------------------------------
    @staticmethod
    def get_meta(db: sqlite3.Connection, key: str, default=None):
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    @staticmethod
    def set_meta(db: sqlite3.Connection, key: str, value) -> None:
        db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                   (key, json.dumps(value)))

    # ---- workers and nonces ------------------------------------------------------------------
    def register(self, key: str, name: str) -> dict:
        now = time.time()
        with self.tx() as db:
            db.execute("INSERT INTO workers (key, name, registered, last_seen) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT(key) DO UPDATE SET name = excluded.name, last_seen = excluded.last_seen",
                       (key, name, now, now))
            return dict(db.execute("SELECT * FROM workers WHERE key = ?", (key,)).fetchone())

    def worker(self, key: str) -> dict | None:
        rows = self.query("SELECT * FROM workers WHERE key = ?", (key,))
        return dict(rows[0]) if rows else None

    def use_nonce(self, key: str, nonce: str, ts: float, *, forget_before: float) -> bool:
        """Record a nonce; False if this key already used it (a replay)."""
        with self.tx() as db:
            db.execute("DELETE FROM nonces WHERE ts < ?", (forget_before,))
            try:
                db.execute("INSERT INTO nonces (key, nonce, ts) VALUES (?, ?, ?)", (key, nonce, ts))
            except sqlite3.IntegrityError:
                return False
            db.execute("UPDATE workers SET last_seen = ? WHERE key = ?", (time.time(), key))
            return True

    def count_rejection(self, db: sqlite3.Connection, worker: str, lease_id: str | None, slot: int | None,
                        reason: str, detail: str, *, fraud: bool = False) -> int:
        """Record a rejection against a worker; returns its fraud count afterwards."""
        db.execute("INSERT INTO rejections (worker, lease_id, slot, reason, detail, at) VALUES (?, ?, ?, ?, ?, ?)",
                   (worker, lease_id, slot, reason, detail[:500], time.time()))
        db.execute("UPDATE workers SET rejected = rejected + 1, fraud = fraud + ? WHERE key = ?", (int(fraud), worker))
        row = db.execute("SELECT fraud FROM workers WHERE key = ?", (worker,)).fetchone()
        return row[0] if row else 0
