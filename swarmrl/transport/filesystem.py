"""The run directory: the trusted side's files (trainer and orchestrator on one machine).

Layout under the run dir:
    config.toml           the resolved config every trusted role reads
    policies/v000003/     complete HF folders, one per policy version, renamed into place whole
    orchestrator.sqlite   the orchestrator's durable state (leases, groups, batches)
    orchestrator.json     where the orchestrator listens ({"url": ...})
    trainer.token         the trainer's bearer token for the orchestrator (mode 0600)
    consumed.jsonl        the group ids the trainer trained on, per step
    logs/, checkpoints/, metrics.jsonl, summary.json, plots/
    stop                  present once the run is over

Everything is written with write-to-temp-then-rename, so a reader never sees a partial file and
a killed process leaves nothing half-written behind. Workers never read this directory: they
talk to the orchestrator and fetch weights over HTTP.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

_VERSION_DIR = re.compile(r"^v(\d{6})$")


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.policies = self.root / "policies"
        self.logs = self.root / "logs"
        for d in (self.policies, self.logs):
            d.mkdir(parents=True, exist_ok=True)

    # ---- policy versions -------------------------------------------------------------------
    def version_path(self, version: int) -> Path:
        return self.policies / f"v{version:06d}"

    def versions(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.policies.iterdir() if (m := _VERSION_DIR.match(p.name)))

    def prune_versions(self, keep_from: int) -> None:
        """Delete versions older than `keep_from` (no worker may use them any more). Version 0,
        the starting policy, stays: it is the KL reference and what a resumed run loads first."""
        for v in self.versions():
            if 0 < v < keep_from:
                shutil.rmtree(self.version_path(v), ignore_errors=True)

    def request_stop(self) -> None:
        (self.root / "stop").touch()

    def stop_requested(self) -> bool:
        return (self.root / "stop").exists()
