"""Retiring problems without signal during a run (`tasks.retire_after`): the online half of
difficulty filtering (`swarmrl tasks filter` is the offline half).

GRPO learns nothing from a group whose rewards are all equal: every completion right (the
problem is solved) or every one wrong (out of reach). Once a training problem has given
`retire_after` such groups in a row, it is retired: leases skip it from then on, so the workers'
time goes to problems that still teach. An informative group resets the problem's streak. At
most `retire_max_share` of the problems are ever retired, so a run never runs dry.

Who can retire a problem: only groups from proven or trusted keys count (admission.py), so a
free key cannot retire the task set by sending wrong answers. The counts live in the run's store
(table `problems`), so an orchestrator restart or a resumed run keeps them.
"""

from __future__ import annotations

import math

SCHEMA = """CREATE TABLE IF NOT EXISTS problems (problem INTEGER PRIMARY KEY,
    groups INTEGER NOT NULL,                    -- groups of proven keys counted
    streak INTEGER NOT NULL,                    -- of those, the last ones in a row without signal
    retired INTEGER NOT NULL DEFAULT 0)"""


def next_streak(streak: int, informative: bool) -> int:
    return 0 if informative else streak + 1


def max_retired(problems: int, share: float) -> int:
    """How many of `problems` may be retired: `share` of them, rounded down, leaving at least one."""
    return min(problems - 1, math.floor(problems * share))


def ensure_table(store) -> None:
    with store.tx() as db:
        db.execute(SCHEMA)


def record(db, problem: int, informative: bool, *, after: int, limit: int) -> bool:
    """Count one group of `problem`; True when this group retired it."""
    row = db.execute("SELECT groups, streak, retired FROM problems WHERE problem = ?", (problem,)).fetchone()
    groups, streak, retired = (row[0], row[1], row[2]) if row else (0, 0, 0)
    streak = next_streak(streak, informative)
    retire = not retired and streak >= after and retired_count(db) < limit
    db.execute(
        "INSERT INTO problems (problem, groups, streak, retired) VALUES (?, ?, ?, ?) ON CONFLICT(problem) "
        "DO UPDATE SET groups = excluded.groups, streak = excluded.streak, retired = excluded.retired",
        (problem, groups + 1, streak, int(retired or retire)),
    )
    return retire


def retired_count(db) -> int:
    return db.execute("SELECT COUNT(*) FROM problems WHERE retired = 1").fetchone()[0]


def retired(db) -> set[int]:
    return {p for (p,) in db.execute("SELECT problem FROM problems WHERE retired = 1")}
