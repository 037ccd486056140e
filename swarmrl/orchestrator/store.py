"""The orchestrator's durable state: one SQLite file in WAL mode.

Everything the run cannot afford to lose or double-count lives here: registered workers, seen
nonces, leases and their slots (one slot = one prompt = one group), accepted groups with their
trusted rewards, and the frozen content of every batch. All of the orchestrator's SQL is here
(and in retention.py: what leaves the store once a group is trained on); its
logic (service.py and its components) calls the named methods below. One logical operation is one
transaction: a method without a `db` argument is one by itself, and the methods taking `db` run
inside their caller's `with store.tx() as db:`, which groups them. So a `kill -9` at any instant
leaves either the state before an operation or the state after it:

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from swarmrl.protocol.signing import new_run_id

_FLAG = "INTEGER NOT NULL DEFAULT 0"

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
    state TEXT NOT NULL,                        -- open | done | expired
    source TEXT);                               -- the address it was leased from (connlimit.source_of)
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
CREATE TABLE IF NOT EXISTS penalties (worker TEXT NOT NULL, slots INTEGER NOT NULL, at REAL NOT NULL,
    source TEXT);                               -- set when an unproven key's lease ran out: counts against its address
CREATE INDEX IF NOT EXISTS penalties_worker ON penalties (worker, at);
-- The sequential test per key and declared engine (proofs/evidence.py), in calibrated runs.
CREATE TABLE IF NOT EXISTS evidence (worker TEXT NOT NULL, engine TEXT NOT NULL,
    test TEXT NOT NULL,                         -- EvidenceModel.name: its statistic and the cheat it aims at
    groups INTEGER NOT NULL DEFAULT 0,          -- fully checked groups that passed the hard limits
    score REAL NOT NULL DEFAULT 0,              -- the CUSUM now
    peak REAL NOT NULL DEFAULT 0,               -- its highest so far
    stat_sum REAL NOT NULL DEFAULT 0, stat_max REAL NOT NULL DEFAULT 0,  -- the statistic it reads
    PRIMARY KEY (worker, engine, test)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rejections (id INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT NOT NULL,
    lease_id TEXT, slot INTEGER, reason TEXT NOT NULL, detail TEXT NOT NULL, at REAL NOT NULL);
"""


Db = sqlite3.Connection


def _marks(n: int) -> str:
    return ",".join("?" * n)


class Store:
    """Thread-safe (one connection behind a lock). Methods without a `db` argument are one
    transaction each; methods taking `db` run inside the caller's `tx()` (or `read()`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self.db.row_factory = sqlite3.Row
        if not self.db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone():
            # A new store: pages freed by pruning go back to the file system (retention.py).
            self.db.execute("PRAGMA auto_vacuum = INCREMENTAL")
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

    @classmethod
    def read_only(cls, path: str | Path) -> Store:
        """A reader of a run's store beside the orchestrator that owns it (an operator's script, a
        test): opened read-only, with no schema, migration or recovery of interrupted work (those
        are the owner's to do, and would change a live run's state). Every writing method fails."""
        store = cls.__new__(cls)
        store.path = Path(path)
        if not store.path.exists():
            raise FileNotFoundError(f"no store at {store.path}: has the orchestrator of this run started?")
        store.lock = threading.RLock()
        uri = f"file:{store.path.resolve()}?mode=ro"
        store.db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None, timeout=30)
        store.db.row_factory = sqlite3.Row
        return store

    def _migrate(self) -> None:
        """Columns added after a run directory may have been created (run directories of
        earlier swarmrl versions keep working)."""
        added = {
            "workers": [
                *[(name, _FLAG) for name in ("fraud", "expired", "validated")],
                # Groups passed by the full check since the key's last fraud rejection: what earns
                # sampled validation (validator.sample_after), reset by any failure.
                ("clean_streak", _FLAG),
            ],
            # pruned: 1 once the payload is an audit summary (retention.py) and the proofs are gone.
            "groups": [("proofs", "TEXT"), ("claimed", "REAL"), ("verdict", "TEXT"), ("pruned", _FLAG)],
            # Leases of earlier versions have no source: they count as source '' until they end.
            "leases": [("source", "TEXT")],
            "penalties": [("source", "TEXT")],
        }
        for table, cols in added.items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, decl in cols:
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
        self.db.execute("CREATE INDEX IF NOT EXISTS penalties_source ON penalties (source, at)")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # ---- transactions ------------------------------------------------------------------------
    class _Tx:
        def __init__(self, store: Store):
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

    def tx(self) -> Store._Tx:
        return Store._Tx(self)

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """The connection under the lock, for a few reads that belong together (no transaction:
        anything that writes uses tx())."""
        with self.lock:
            yield self.db

    def query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self.db.execute(sql, args).fetchall()

    # ---- meta --------------------------------------------------------------------------------
    @staticmethod
    def get_meta(db: Db, key: str, default=None):
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    @staticmethod
    def set_meta(db: Db, key: str, value) -> None:
        db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )

    @staticmethod
    def progress(db: Db) -> tuple[int, int | None, bool]:
        """The run's position: (next step, newest published version or None, finished)."""
        return (
            Store.get_meta(db, "next_step", 0),
            Store.get_meta(db, "latest_version"),
            Store.get_meta(db, "finished", False),
        )

    def run_id(self) -> str:
        """This run's id, made on first use and kept: every signed request is bound to it."""
        with self.tx() as db:
            run = self.get_meta(db, "run_id")
            if run is None:
                run = new_run_id()
                self.set_meta(db, "run_id", run)
            return run

    # ---- workers and nonces ------------------------------------------------------------------
    def register(self, key: str, name: str) -> dict:
        now = time.time()
        with self.tx() as db:
            db.execute(
                "INSERT INTO workers (key, name, registered, last_seen) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET name = excluded.name, last_seen = excluded.last_seen",
                (key, name, now, now),
            )
            return dict(db.execute("SELECT * FROM workers WHERE key = ?", (key,)).fetchone())

    def worker(self, key: str) -> dict | None:
        rows = self.query("SELECT * FROM workers WHERE key = ?", (key,))
        return dict(rows[0]) if rows else None

    def worker_name(self, db: Db, key: str) -> str | None:
        row = db.execute("SELECT name FROM workers WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

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

    def count_rejection(
        self,
        db: Db,
        worker: str,
        lease_id: str | None,
        slot: int | None,
        reason: str,
        detail: str,
        *,
        fraud: bool = False,
    ) -> int:
        """Record a rejection against a worker; returns its fraud count afterwards."""
        db.execute(
            "INSERT INTO rejections (worker, lease_id, slot, reason, detail, at) VALUES (?, ?, ?, ?, ?, ?)",
            (worker, lease_id, slot, reason, detail[:500], time.time()),
        )
        db.execute(
            "UPDATE workers SET rejected = rejected + 1, fraud = fraud + ?, "
            "clean_streak = CASE WHEN ? THEN 0 ELSE clean_streak END WHERE key = ?",
            (int(fraud), int(fraud), worker),
        )
        row = db.execute("SELECT fraud FROM workers WHERE key = ?", (worker,)).fetchone()
        return row[0] if row else 0

    def add_accepted(self, db: Db, key: str, n: int = 1, *, validated: bool = False) -> None:
        """Add `n` to the worker's count of accepted groups (negative: take them back); groups
        the validator passed also count as validated (what makes a key proven) and lengthen its
        clean streak (what earns sampled validation)."""
        db.execute(
            "UPDATE workers SET accepted = accepted + ?, validated = validated + ?, "
            "clean_streak = MAX(0, clean_streak + ?) WHERE key = ?",
            (n, n if validated else 0, n if validated else 0, key),
        )

    @staticmethod
    def clean_streak(db: Db, key: str) -> int:
        """Groups of `key` the full check passed since its last fraud rejection."""
        row = db.execute("SELECT clean_streak FROM workers WHERE key = ?", (key,)).fetchone()
        return row[0] if row else 0

    def penalise(self, db: Db, worker: str, slots: int, at: float, source: str | None = None) -> None:
        """Slots a worker let expire: they count against its lease allowance for a while (and,
        with `source`, against what unproven keys from that address may hold)."""
        db.execute("INSERT INTO penalties (worker, slots, at, source) VALUES (?, ?, ?, ?)", (worker, slots, at, source))
        db.execute("UPDATE workers SET expired = expired + ? WHERE key = ?", (slots, worker))

    def standing(
        self, db: Db, worker: str, since: float, fraud_reasons: Sequence[str]
    ) -> tuple[int, int, int, int, int, int]:
        """(accepted groups, slots expired since `since`, fraud rejections since `since`, slots
        leased and open or being scored now, groups awaiting the validator, groups the validator
        passed) of one worker."""
        row = db.execute("SELECT accepted, validated FROM workers WHERE key = ?", (worker,)).fetchone()
        expired = db.execute(
            "SELECT COALESCE(SUM(slots), 0) FROM penalties WHERE worker = ? AND at >= ?", (worker, since)
        ).fetchone()[0]
        fraud = db.execute(
            f"SELECT COUNT(*) FROM rejections WHERE worker = ? AND at >= ? AND reason IN "
            f"({_marks(len(fraud_reasons))})",
            (worker, since, *fraud_reasons),
        ).fetchone()[0]
        leased = db.execute(
            "SELECT COUNT(*) FROM slots JOIN leases ON slots.lease_id = leases.id "
            "WHERE leases.worker = ? AND leases.state = 'open' AND slots.state IN ('open', 'scoring')",
            (worker,),
        ).fetchone()[0]
        waiting = db.execute(
            "SELECT COUNT(*) FROM groups WHERE worker = ? AND state IN ('pending', 'validating')", (worker,)
        ).fetchone()[0]
        return (row[0] if row else 0), expired, fraud, leased, waiting, (row[1] if row else 0)

    def unproven_held(self, db: Db, proven_after: int) -> list[tuple[str, str, int, int, int]]:
        """Work held by keys with fewer than `proven_after` validated groups, per lease source and
        key: (source, key, slots open in open leases, slots being scored, groups awaiting the
        validator). Leases from before sources were recorded count as source ''."""
        out: dict[tuple[str, str], list[int]] = {}
        for column, sql in (
            (
                0,
                "SELECT COALESCE(l.source, ''), l.worker, COUNT(*) FROM slots s JOIN leases l ON s.lease_id = l.id "
                "JOIN workers w ON l.worker = w.key WHERE l.state = 'open' AND s.state = 'open' "
                "AND w.validated < ? GROUP BY 1, 2",
            ),
            (
                1,
                "SELECT COALESCE(l.source, ''), l.worker, COUNT(*) FROM slots s JOIN leases l ON s.lease_id = l.id "
                "JOIN workers w ON l.worker = w.key WHERE l.state = 'open' AND s.state = 'scoring' "
                "AND w.validated < ? GROUP BY 1, 2",
            ),
            (
                2,
                "SELECT COALESCE(l.source, ''), g.worker, COUNT(*) FROM groups g JOIN leases l ON g.lease_id = l.id "
                "JOIN workers w ON g.worker = w.key WHERE g.state IN ('pending', 'validating') "
                "AND w.validated < ? GROUP BY 1, 2",
            ),
        ):
            for source, worker, n in db.execute(sql, (proven_after,)).fetchall():
                out.setdefault((source, worker), [0, 0, 0])[column] += n
        return [(source, worker, *held) for (source, worker), held in out.items()]

    def source_expired(self, db: Db, source: str, since: float) -> int:
        """Slots unproven keys leased from `source` let expire since `since`."""
        return db.execute(
            "SELECT COALESCE(SUM(slots), 0) FROM penalties WHERE source = ? AND at >= ?", (source, since)
        ).fetchone()[0]

    def unproven_slots(self, db: Db, proven_after: int, *, leased_only: bool = False) -> int:
        """Work held by keys with fewer than `proven_after` accepted groups: slots open in open
        leases, and (unless `leased_only`) groups awaiting the validator."""
        state = "('open')" if leased_only else "('open', 'scoring')"
        leased = db.execute(
            "SELECT COUNT(*) FROM slots JOIN leases ON slots.lease_id = leases.id JOIN workers ON "
            f"leases.worker = workers.key WHERE slots.state IN {state} AND "
            "leases.state = 'open' AND workers.validated < ?",
            (proven_after,),
        ).fetchone()[0]
        if leased_only:
            return leased
        waiting = db.execute(
            "SELECT COUNT(*) FROM groups JOIN workers ON groups.worker = workers.key WHERE "
            "groups.state IN ('pending', 'validating') AND workers.validated < ?",
            (proven_after,),
        ).fetchone()[0]
        return leased + waiting

    def is_banned(self, db: Db, key: str) -> bool:
        row = db.execute("SELECT banned FROM workers WHERE key = ?", (key,)).fetchone()
        return bool(row and row["banned"])

    def ban(self, db: Db, key: str) -> bool:
        """Mark the worker banned; False if it already was (or is unknown)."""
        return db.execute("UPDATE workers SET banned = 1 WHERE key = ? AND banned = 0", (key,)).rowcount > 0

    # ---- leases and slots --------------------------------------------------------------------
    def lease_row(self, db: Db, lease_id: str) -> sqlite3.Row | None:
        return db.execute("SELECT * FROM leases WHERE id = ?", (lease_id,)).fetchone()

    def create_lease(
        self,
        db: Db,
        lease_id: str,
        worker: str,
        created: float,
        expires: float,
        min_version: int,
        max_version: int,
        slots: int,
        source: str | None = None,
    ) -> None:
        db.execute(
            "INSERT INTO leases (id, worker, created, expires, min_version, max_version, slots, state, source) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'open', ?)",
            (lease_id, worker, created, expires, min_version, max_version, slots, source),
        )

    def add_slot(self, db: Db, lease_id: str, slot: int, problem: int, target_length: int | None, seeds: str) -> None:
        """An open slot; `seeds` is the JSON list of its completions' sampling seeds."""
        db.execute(
            "INSERT INTO slots (lease_id, slot, problem, target_length, seeds, state) VALUES (?, ?, ?, ?, ?, 'open')",
            (lease_id, slot, problem, target_length, seeds),
        )

    def lease_slots(self, db: Db, lease_id: str) -> dict[int, sqlite3.Row]:
        """The lease's slot rows by slot number."""
        return {r["slot"]: r for r in db.execute("SELECT * FROM slots WHERE lease_id = ?", (lease_id,))}

    def open_lease_count(self, db: Db, worker: str | None = None) -> int:
        """Open leases: all of them, or those of one worker."""
        if worker is None:
            return db.execute("SELECT COUNT(*) FROM leases WHERE state = 'open'").fetchone()[0]
        return db.execute("SELECT COUNT(*) FROM leases WHERE worker = ? AND state = 'open'", (worker,)).fetchone()[0]

    def open_slot_count(self, db: Db) -> int:
        """Slots still open in open leases: work out with the workers."""
        return db.execute(
            "SELECT COUNT(*) FROM slots JOIN leases ON slots.lease_id = leases.id "
            "WHERE slots.state = 'open' AND leases.state = 'open'"
        ).fetchone()[0]

    def extend_lease(self, db: Db, lease_id: str, expires: float) -> None:
        """Move an open lease's deadline to `expires` if that is later (a submission waiting for a
        grading lane keeps its lease: admission.extended_expiry)."""
        db.execute(
            "UPDATE leases SET expires = ? WHERE id = ? AND state = 'open' AND expires < ?",
            (expires, lease_id, expires),
        )

    def mark_slot(self, db: Db, lease_id: str, slot: int, state: str, *, only_if: str | None = None) -> bool:
        """Set a slot's state (only if it is in state `only_if`, when given); whether it changed."""
        if only_if is None:
            cur = db.execute("UPDATE slots SET state = ? WHERE lease_id = ? AND slot = ?", (state, lease_id, slot))
        else:
            cur = db.execute(
                "UPDATE slots SET state = ? WHERE lease_id = ? AND slot = ? AND state = ?",
                (state, lease_id, slot, only_if),
            )
        return cur.rowcount > 0

    def reissue_slot(self, db: Db, lease_id: str, slot: int) -> None:
        """Put the slot's problem (with its target length) back in the pool for another lease."""
        db.execute(
            "INSERT INTO reissue (problem, target_length) SELECT problem, target_length "
            "FROM slots WHERE lease_id = ? AND slot = ?",
            (lease_id, slot),
        )

    def take_reissued(self, db: Db, n: int) -> list[tuple[int, int | None]]:
        """Up to `n` problems given back to the pool, oldest first, as (problem, target_length);
        they leave the pool."""
        rows = db.execute("SELECT * FROM reissue ORDER BY id LIMIT ?", (n,)).fetchall()
        if rows:
            db.execute("DELETE FROM reissue WHERE id IN (SELECT id FROM reissue ORDER BY id LIMIT ?)", (len(rows),))
        return [(r["problem"], r["target_length"]) for r in rows]

    def expire_leases(self, db: Db, now: float) -> list[tuple[str, str, int, bool, str | None]]:
        """Expire the open leases past their expiry: their open slots' problems go back to the
        pool. Returns (lease id, worker, slots it left open, whether it ran out of time rather
        than being ended by the orchestrator: a ban or a trainer going back, the source it was
        leased from) per expired lease."""
        expired = db.execute(
            "SELECT id, worker, expires, source FROM leases WHERE state = 'open' AND expires < ?", (now,)
        ).fetchall()
        out = []
        for lease_id, worker, expires, source in expired:
            rows = db.execute("SELECT * FROM slots WHERE lease_id = ? AND state = 'open'", (lease_id,)).fetchall()
            for row in rows:
                db.execute(
                    "INSERT INTO reissue (problem, target_length) VALUES (?, ?)", (row["problem"], row["target_length"])
                )
            db.execute("UPDATE slots SET state = 'expired' WHERE lease_id = ? AND state = 'open'", (lease_id,))
            db.execute("UPDATE leases SET state = 'expired' WHERE id = ?", (lease_id,))
            out.append((lease_id, worker, len(rows), expires > 0, source))
        return out

    def end_worker_leases(self, db: Db, worker: str) -> None:
        """Make the worker's open leases due now (expire_leases then takes them back)."""
        db.execute("UPDATE leases SET expires = 0 WHERE worker = ? AND state = 'open'", (worker,))

    def end_leases_above(self, db: Db, version: int) -> None:
        """Make open leases that allow a policy newer than `version` due now (expire_leases then
        takes them back)."""
        db.execute("UPDATE leases SET expires = ? WHERE state = 'open' AND max_version > ?", (0.0, version))

    def close_lease_if_settled(self, db: Db, lease_id: str) -> None:
        """An open lease with no slot left open or being scored is done."""
        if not db.execute(
            "SELECT 1 FROM slots WHERE lease_id = ? AND state IN ('open', 'scoring')", (lease_id,)
        ).fetchone():
            db.execute("UPDATE leases SET state = 'done' WHERE id = ? AND state = 'open'", (lease_id,))

    # ---- groups ------------------------------------------------------------------------------
    def add_group(
        self,
        db: Db,
        lease_id: str,
        slot: int,
        worker: str,
        policy_version: int,
        accepted: float,
        payload: str,
        informative: bool,
        state: str,
        proofs: str,
    ) -> None:
        """An accepted group (`payload`: Group.to_json(); `proofs`: JSON, per completion)."""
        db.execute(
            "INSERT INTO groups (lease_id, slot, worker, policy_version, accepted, payload, "
            "informative, state, proofs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (lease_id, slot, worker, policy_version, accepted, payload, int(informative), state, proofs),
        )

    def stored_group(self, db: Db, lease_id: str, slot: int) -> sqlite3.Row | None:
        """The group accepted for a slot: (payload, informative)."""
        return db.execute(
            "SELECT payload, informative FROM groups WHERE lease_id = ? AND slot = ?", (lease_id, slot)
        ).fetchone()

    def count_groups(self, db: Db, states: Sequence[str], *, worker: str | None = None) -> int:
        """Groups in any of `states` (of one worker, when given)."""
        marks = _marks(len(states))
        if worker is None:
            return db.execute(f"SELECT COUNT(*) FROM groups WHERE state IN ({marks})", tuple(states)).fetchone()[0]
        return db.execute(
            f"SELECT COUNT(*) FROM groups WHERE worker = ? AND state IN ({marks})", (worker, *states)
        ).fetchone()[0]

    def recent_informative(self, db: Db, window: int) -> tuple[float | None, int]:
        """Over the last `window` accepted groups: (fraction informative, how many there are)."""
        row = db.execute(
            "SELECT AVG(informative), COUNT(*) FROM (SELECT informative FROM groups ORDER BY id DESC LIMIT ?)",
            (window,),
        ).fetchone()
        return row[0], row[1]

    def payloads(self, db: Db, ids: Sequence[int]) -> list[str]:
        """The groups' payloads, by id (ascending)."""
        return [
            p
            for (p,) in db.execute(
                f"SELECT payload FROM groups WHERE id IN ({_marks(len(ids))}) ORDER BY id", tuple(ids)
            ).fetchall()
        ]

    def recheck_worker_groups(self, db: Db, worker: str, *, unchecked_only: bool = False) -> int:
        """Send the worker's groups back to the validator (pending): everything not yet trained or
        counted in a batch's metrics (`unchecked_only`: of those, the ones that got only the cheap
        checks). Returns how many."""
        return db.execute(
            "UPDATE groups SET state = 'pending', claimed = NULL WHERE worker = ? AND "
            "(state = 'queued' OR (state = 'uninformative' AND resolved_step IS NULL))"
            + (" AND verdict IS NULL" if unchecked_only else ""),
            (worker,),
        ).rowcount

    def reject_worker_groups(self, db: Db, worker: str, verdict: str) -> int:
        """Refuse every group of the worker not yet trained or counted in a batch's metrics (an
        evidence ban: none of them may be trained on). Returns how many."""
        return db.execute(
            "UPDATE groups SET state = 'rejected', claimed = NULL, verdict = COALESCE(verdict, ?) WHERE worker = ? "
            "AND (state IN ('pending', 'validating', 'queued') OR (state = 'uninformative' AND resolved_step IS NULL))",
            (verdict, worker),
        ).rowcount

    def add_evidence(self, db: Db, worker: str, engine: str, test: str, llr: float, value: float) -> float:
        """One more group's evidence for (worker, engine, test): returns the CUSUM after it."""
        row = db.execute(
            "SELECT score FROM evidence WHERE worker = ? AND engine = ? AND test = ?", (worker, engine, test)
        ).fetchone()
        score = max(0.0, (row["score"] if row else 0.0) + llr)
        db.execute(
            "INSERT INTO evidence (worker, engine, test, groups, score, peak, stat_sum, stat_max) "
            "VALUES (?, ?, ?, 1, ?, ?, ?, ?) ON CONFLICT (worker, engine, test) DO UPDATE SET "
            "groups = groups + 1, score = excluded.score, peak = MAX(peak, excluded.score), "
            "stat_sum = stat_sum + excluded.stat_sum, stat_max = MAX(stat_max, excluded.stat_max)",
            (worker, engine, test, score, score, value, value),
        )
        return score

    def restart_evidence(self, db: Db, engines: Sequence[str]) -> int:
        """Every key's CUSUM of these declared engines back to 0 (groups, peak and the statistic's
        sums kept); returns how many keys had a score above 0 there."""
        marks = ",".join("?" * len(engines))
        n = db.execute(
            f"SELECT COUNT(DISTINCT worker) FROM evidence WHERE score > 0 AND engine IN ({marks})", tuple(engines)
        ).fetchone()[0]
        db.execute(f"UPDATE evidence SET score = 0 WHERE engine IN ({marks})", tuple(engines))
        return int(n)

    def evidence_scores(self, db: Db, worker: str) -> list[tuple[str, str, float]]:
        """(engine, test, score) of each of the worker's evidence tests."""
        return [tuple(r) for r in db.execute("SELECT engine, test, score FROM evidence WHERE worker = ?", (worker,))]

    def evidence(self, db: Db) -> dict[str, list[dict]]:
        """Every key's evidence rows, by key."""
        out: dict[str, list[dict]] = {}
        for r in db.execute("SELECT * FROM evidence ORDER BY worker, engine, test"):
            out.setdefault(r["worker"], []).append(
                {
                    "engine": r["engine"],
                    "test": r["test"],
                    "groups": r["groups"],
                    "score": r["score"],
                    "peak": r["peak"],
                    "mean": r["stat_sum"] / r["groups"] if r["groups"] else 0.0,
                    "max": r["stat_max"],
                }
            )
        return out

    def drop_older(self, db: Db, states: Sequence[str], version: int, step: int) -> int:
        """Groups in `states` sampled with a policy older than `version` become stale, counted in
        batch `step`'s metrics; returns how many."""
        return self._mark_stale(db, states, "<", version, step)

    def drop_newer(self, db: Db, states: Sequence[str], version: int, step: int) -> int:
        """Groups in `states` sampled with a policy newer than `version` become stale, counted in
        batch `step`'s metrics; returns how many."""
        return self._mark_stale(db, states, ">", version, step)

    @staticmethod
    def _mark_stale(db: Db, states: Sequence[str], cmp: str, version: int, step: int) -> int:
        return db.execute(
            f"UPDATE groups SET state = 'stale', resolved_step = ? "
            f"WHERE state IN ({_marks(len(states))}) AND policy_version {cmp} ?",
            (step, *states, version),
        ).rowcount

    # ---- validation --------------------------------------------------------------------------
    def release_claims(self, db: Db, claimed_before: float) -> None:
        """Claims older than `claimed_before` (their validator died) go back to pending."""
        db.execute(
            "UPDATE groups SET state = 'pending', claimed = NULL WHERE state = 'validating' AND claimed < ?",
            (claimed_before,),
        )

    def claim_pending(self, db: Db, max_groups: int, now: float, proven_after: int = 0) -> list[sqlite3.Row]:
        """Up to `max_groups` pending groups, now `validating` (claimed at `now`): rows of (id,
        worker, policy_version, payload, proofs). Oldest first within two queues: groups of
        proven workers (`proven_after` accepted groups or more) take three quarters of the places
        and groups of unproven keys at least one, so a flood of new keys' garbage cannot delay
        proven work, and new honest workers still get checked (and proven)."""
        select = (
            "SELECT g.id, g.worker, g.policy_version, g.payload, g.proofs FROM groups g JOIN workers w "
            "ON g.worker = w.key WHERE g.state = 'pending' AND w.validated {} ? ORDER BY g.id LIMIT ?"
        )
        new_share = max(1, max_groups // 4)
        proven = db.execute(select.format(">="), (proven_after, max_groups)).fetchall()
        unproven = db.execute(select.format("<"), (proven_after, max_groups)).fetchall()
        take_new = min(len(unproven), max(new_share, max_groups - len(proven)))
        rows = sorted(proven[: max_groups - take_new] + unproven[:take_new], key=lambda r: r["id"])
        if rows:
            db.execute(
                f"UPDATE groups SET state = 'validating', claimed = ? WHERE id IN ({_marks(len(rows))})",
                (now, *[r["id"] for r in rows]),
            )
        return rows

    def group_for_verdict(self, db: Db, group_id: int) -> sqlite3.Row | None:
        """(worker, lease_id, slot, informative, state, engine) of a group (engine: what its worker
        declared, "builtin" when the payload names none)."""
        return db.execute(
            "SELECT worker, lease_id, slot, informative, state, "
            "COALESCE(json_extract(payload, '$.engine'), 'builtin') AS engine FROM groups WHERE id = ?",
            (group_id,),
        ).fetchone()

    def set_verdict(self, db: Db, group_id: int, state: str, verdict: str) -> None:
        """Settle a group: its new state and the validator's verdict (JSON)."""
        db.execute("UPDATE groups SET state = ?, verdict = ? WHERE id = ?", (state, verdict, group_id))

    def unclaim(self, db: Db, group_id: int) -> None:
        """A group being validated goes back to pending."""
        db.execute(
            "UPDATE groups SET state = 'pending', claimed = NULL WHERE id = ? AND state = 'validating'", (group_id,)
        )

    # ---- batches -----------------------------------------------------------------------------
    def batch(self, db: Db, step: int) -> sqlite3.Row | None:
        """The frozen batch `step`: (step, group_ids, metrics, created); group_ids and metrics are JSON."""
        return db.execute("SELECT * FROM batches WHERE step = ?", (step,)).fetchone()

    def save_batch(self, db: Db, step: int, group_ids: str, metrics: str, created: float) -> None:
        db.execute(
            "INSERT INTO batches (step, group_ids, metrics, created) VALUES (?, ?, ?, ?)",
            (step, group_ids, metrics, created),
        )

    def latest_uninformative_payloads(self, db: Db, n: int) -> list[str]:
        """The payloads of the last `n` uninformative groups, newest first."""
        return [
            p
            for (p,) in db.execute(
                "SELECT payload FROM groups WHERE state = 'uninformative' AND pruned = 0 ORDER BY id DESC LIMIT ?", (n,)
            ).fetchall()
        ]

    def queued_ids(self, db: Db, n: int) -> list[int]:
        """Up to `n` queued groups' ids, first in first out."""
        return [
            r[0]
            for r in db.execute("SELECT id FROM groups WHERE state = 'queued' ORDER BY id LIMIT ?", (n,)).fetchall()
        ]

    def consume(self, db: Db, ids: Sequence[int], step: int) -> None:
        """The groups feed batch `step` (and count in its metrics)."""
        marks = _marks(len(ids))
        db.execute(
            f"UPDATE groups SET state = 'consumed', step = ?, resolved_step = ? WHERE id IN ({marks})",
            (step, step, *ids),
        )

    def resolve_uninformative(self, db: Db, step: int) -> None:
        """Uninformative groups not yet counted in a batch's metrics count in batch `step`'s."""
        db.execute(
            "UPDATE groups SET resolved_step = ? WHERE state = 'uninformative' AND resolved_step IS NULL", (step,)
        )

    def resolved_payloads(self, db: Db, step: int) -> list[str]:
        """Payloads of the groups batch `step` settled, stale ones excepted."""
        return [
            p
            for (p,) in db.execute(
                "SELECT payload FROM groups WHERE resolved_step = ? AND state != 'stale'", (step,)
            ).fetchall()
        ]

    def resolved_stale_count(self, db: Db, step: int) -> int:
        """Groups dropped as stale and counted in batch `step`'s metrics."""
        return db.execute(
            "SELECT COUNT(*) FROM groups WHERE resolved_step = ? AND state = 'stale'", (step,)
        ).fetchone()[0]

    # ---- policies ----------------------------------------------------------------------------
    def save_policy(self, db: Db, version: int, url: str, manifest: str, published: float) -> None:
        """Store (or replace) a published policy version; `manifest` is JSON. The origin serves
        every version it still holds at the URL it announced last: a trainer restarted on another
        port (`trainer.weights_port` 0) moves the older versions with it, or validators and workers
        would keep asking a dead address for them (a chaos test's validator did, for ever)."""
        db.execute(
            "INSERT INTO policies (version, url, manifest, published) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(version) DO UPDATE SET url = excluded.url, manifest = excluded.manifest, "
            "published = excluded.published",
            (version, url, manifest, published),
        )
        db.execute("UPDATE policies SET url = ? WHERE url != ?", (url, url))

    def policy(self, db: Db, version: int) -> sqlite3.Row | None:
        """(url, manifest) of a policy version, manifest as JSON."""
        return db.execute("SELECT url, manifest FROM policies WHERE version = ?", (version,)).fetchone()

    def forget_policies(self, db: Db, below: int) -> None:
        """Forget policy versions older than `below`."""
        db.execute("DELETE FROM policies WHERE version < ?", (below,))

    # ---- metrics -----------------------------------------------------------------------------
    def group_state_counts(self, db: Db) -> dict[str, int]:
        return dict(db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())

    def rejection_counts(self, db: Db, worker: str | None = None) -> dict[str, int]:
        """Rejections by reason: of all workers, or of one."""
        if worker is None:
            return dict(db.execute("SELECT reason, COUNT(*) FROM rejections GROUP BY reason").fetchall())
        return dict(
            db.execute("SELECT reason, COUNT(*) FROM rejections WHERE worker = ? GROUP BY reason", (worker,)).fetchall()
        )

    def worker_count(self, db: Db, *, banned: bool = False) -> int:
        """Registered workers (only the banned ones, if `banned`)."""
        if banned:
            return db.execute("SELECT COUNT(*) FROM workers WHERE banned = 1").fetchone()[0]
        return db.execute("SELECT COUNT(*) FROM workers").fetchone()[0]
