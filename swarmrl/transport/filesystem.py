"""Rollouts and policy versions exchanged through a run directory (trusted single machine).

Layout under the run dir:
    policies/v000003/     complete HF folders, one per policy version, renamed into place whole
    rollouts/pending/     one JSON file per group, written to a temp name and renamed
    state.json            the trainer's progress (next batch step, newest version), atomic
    stop                  present once the run is over: workers exit

Everything is written with write-to-temp-then-rename, so a reader never sees a partial file and
a killed process leaves nothing half-written behind. The orchestrator issue replaces this with
HTTP; the interface (put/take groups, publish/fetch versions, read progress) stays.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from swarmrl.rl.rollouts import Group

_VERSION_DIR = re.compile(r"^v(\d{6})$")


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.policies = self.root / "policies"
        self.pending = self.root / "rollouts" / "pending"
        self.logs = self.root / "logs"
        for d in (self.policies, self.pending, self.logs):
            d.mkdir(parents=True, exist_ok=True)

    # ---- policy versions -------------------------------------------------------------------
    def version_path(self, version: int) -> Path:
        return self.policies / f"v{version:06d}"

    def versions(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.policies.iterdir() if (m := _VERSION_DIR.match(p.name)))

    def latest_version(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def prune_versions(self, keep_from: int) -> None:
        """Delete versions older than `keep_from` (no worker may use them any more). Version 0,
        the starting policy, stays: it is the KL reference and what a resumed run loads first."""
        for v in self.versions():
            if 0 < v < keep_from:
                shutil.rmtree(self.version_path(v), ignore_errors=True)

    # ---- rollout groups --------------------------------------------------------------------
    def put_group(self, group: Group) -> Path:
        # Names sort by creation time, so the trainer consumes groups first in, first out.
        name = f"{time.time_ns():020d}-v{group.policy_version:06d}-{group.worker}.json"
        path = self.pending / name
        atomic_write_text(path, group.to_json())
        return path

    def pending_groups(self) -> list[Path]:
        return sorted(p for p in self.pending.iterdir() if p.suffix == ".json" and not p.name.startswith("."))

    def pending_count(self) -> int:
        return len(self.pending_groups())

    @staticmethod
    def read_group(path: Path) -> Group:
        return Group.from_json(path.read_text())

    # ---- trainer progress ------------------------------------------------------------------
    def write_state(self, **state) -> None:
        atomic_write_text(self.root / "state.json", json.dumps(state))

    def read_state(self) -> dict:
        try:
            return json.loads((self.root / "state.json").read_text())
        except FileNotFoundError:
            return {}

    def request_stop(self) -> None:
        (self.root / "stop").touch()

    def stop_requested(self) -> bool:
        return (self.root / "stop").exists()
