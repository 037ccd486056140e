"""What the store keeps of a group once it has been trained on (issue 53, bounded storage).

A group's payload (its tokens, logprobs, masks) and proofs are most of the store: about 39 bytes
per completion token, 210 MB a step at the seed run's sizes. Once the group's batch can no
longer be asked for again they are replaced by an audit summary (who sent it, for which problem
and version, its rewards and lengths, and a digest of the payload it replaces), so the store grows
with the run's steps, not its tokens. `prune_through` and `audit_summary` are the policy (pure
functions); `prune_payloads`, `release_free_pages` and `footprint` its SQL, called by the batch
builder (batches.py) and the dashboard.

When a batch can be asked for again: a trainer resumed from a checkpoint asks for the batches
after it (batch s is the one step s+1 trains on), and the trainer keeps its two newest
checkpoints (trainer/checkpoint.py, `keep=2`), written every `trainer.checkpoint_every` steps, so
batches from the second-newest checkpoint on are kept. `orchestrator.keep_payload_steps` keeps
that many more recent steps besides, for an operator reading recent groups.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

SUMMARY_KEYS = ("problem_id", "task_type", "policy_version", "worker", "engine", "engine_dtype", "temperature")


def prune_through(done: int, checkpoint_every: int, keep_steps: int) -> int | None:
    """The newest batch step whose payloads may go, when the trainer has done `done` steps (it is
    asking for batch `done`), or None when none may. Batches from the trainer's second-newest
    checkpoint on (a resume replays them) and the last `keep_steps` are kept.

    >>> prune_through(20, 5, 0)  # checkpoints at 20 and 15: batches 15.. are kept
    14
    >>> prune_through(20, 5, 8)  # and the 8 newest (12..19)
    11
    >>> prune_through(9, 5, 0) is None  # second-newest checkpoint is the start (step 0)
    True
    """
    if checkpoint_every < 1 or keep_steps < 0:
        raise ValueError("checkpoint_every must be >= 1 and keep_steps >= 0")
    second_newest = (done // checkpoint_every - 1) * checkpoint_every
    through = min(second_newest, done - keep_steps) - 1
    return through if through >= 0 else None


def audit_summary(payload: str) -> str:
    """What stays of a stored group (Group.to_json()) once its payload goes: its identity, its
    sender and version, the trusted rewards, each completion's length, finish reason and seed,
    and the SHA-256 of the payload it replaces (so a copy kept elsewhere can be matched)."""
    group = json.loads(payload)
    samples = group.get("samples") or []
    summary = {
        "pruned": True,
        "payload_sha256": hashlib.sha256(payload.encode()).hexdigest(),
        "payload_bytes": len(payload.encode()),
        **{k: group[k] for k in SUMMARY_KEYS if k in group},
        "rewards": group.get("rewards"),
        "task_rewards": group.get("task_rewards"),
        "prompt_tokens": len(group.get("prompt_ids") or []),
        "lengths": [len(s.get("token_ids") or []) for s in samples],
        "finish_reasons": [s.get("finish_reason") for s in samples],
        "seeds": [s.get("seed") for s in samples],
    }
    return json.dumps(summary, separators=(",", ":"))


def is_summary(payload: str) -> bool:
    """Whether a stored payload is an audit summary (its group's tokens are gone)."""
    return payload.startswith('{"pruned":true')


def prune_payloads(db, through_step: int, summarize: Callable[[str], str] = audit_summary) -> tuple[int, int]:
    """Replace the payload of every settled group (consumed, stale or uninformative) counted
    in a batch up to `through_step` by `summarize(payload)` and drop its proofs: (groups,
    bytes freed). Groups still waiting, and rejected ones (evidence), keep theirs."""
    rows = db.execute(
        "SELECT * FROM groups WHERE pruned = 0 AND resolved_step <= ? "
        "AND state IN ('consumed', 'stale', 'uninformative')",
        (through_step,),
    ).fetchall()
    freed = 0
    for r in rows:
        row = dict(r) | {"payload": summarize(r["payload"]), "proofs": None, "pruned": 1}
        freed += len(r["payload"]) + len(r["proofs"] or "") - len(row["payload"])
        # Delete and insert again rather than update: SQLite merges a page that a delete
        # leaves underfull with its neighbours, but not one an update shrinks, and a group's
        # row fills most of a page before it is pruned (the payload's first few KB are inline).
        db.execute("DELETE FROM groups WHERE id = ?", (r["id"],))
        db.execute(f"INSERT INTO groups ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))
    return len(rows), freed


def release_free_pages(store, pages: int = 0) -> None:
    """Give pages freed by pruning back to the file system (all of them with 0), outside any
    transaction; a store made before auto_vacuum was set reuses them instead."""
    with store.lock:
        store.db.execute(f"PRAGMA incremental_vacuum({int(pages)})").fetchall()


def footprint(store, db) -> dict:
    """What the store holds: its file size, free pages, and groups with and without payloads."""
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    free = db.execute("PRAGMA freelist_count").fetchone()[0]
    held = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload) + COALESCE(LENGTH(proofs), 0)), 0) FROM groups WHERE pruned = 0"
    ).fetchone()
    pruned = db.execute("SELECT COUNT(*) FROM groups WHERE pruned = 1").fetchone()[0]
    wal = store.path.with_name(store.path.name + "-wal")
    return {
        "bytes": pages * page_size,
        "wal_bytes": wal.stat().st_size if wal.exists() else 0,
        "free_bytes": free * page_size,
        "groups_with_payload": held[0],
        "payload_bytes": held[1],
        "groups_pruned": pruned,
    }
