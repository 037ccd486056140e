"""A running orchestrator reads `validator.limits_file` again when it changes on disk.

A policy that learns drifts away from the version its limits were measured on, and the drift
watch (validation.py) says when the file stops describing the run's honest work. The operator
then measures the limits again near the current version and writes them over the run's file:

    swarmrl calibrate --model RUN_DIR/policies/v000030 ... --out LIMITS_FILE

This module notices the new file (its size and modification time, looked at every few seconds:
a stat, nothing read while it is unchanged), checks it as the start of a run does
(`proofs/limits.py`, `run_limits`: the dtype, the sampling settings, the model, which may now be
one of the run's own versions) and, when it passes, hands it to the validation queue. A file
that does not pass is logged with what is wrong and the run keeps judging by the limits it had:
a half-written or mistaken file never leaves a run without limits.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

from swarmrl.orchestrator.store import Store
from swarmrl.proofs.limits import LimitsError, run_limits

# How often the file's size and modification time are looked at (a stat: nothing is read while
# they are unchanged).
POLL_S = 5.0


class LimitsReload:
    """`validator.limits_file` for one run: `check()` takes it again when it changed."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        model_folder: str | Path,
        validation,
        log: Callable[[str], None],
        stamp: tuple | None = None,
    ):
        """`stamp`: `stamp_of` the file as it was before the run's limits were read from it (a file
        written while the orchestrator started is then taken at the first look)."""
        self.cfg, self.run_dir, self.model_folder = cfg, Path(run_dir), model_folder
        self.validation, self.log = validation, log
        self.path = Path(cfg.validator.limits_file)
        self.stamp = stamp if stamp is not None else stamp_of(self.path)

    def check(self) -> bool:
        """Take the file again if it changed since it was last looked at; True when the run now
        judges by it. Never raises for the file's content: a refused file is logged."""
        stamp = stamp_of(self.path)
        if stamp == self.stamp:
            return False
        self.stamp = stamp
        if stamp is None:
            self.log(f"validator limits: {self.path} is gone; the run keeps judging by the limits it has")
            return False
        try:
            limits = run_limits(self.cfg, self.model_folder, self.run_dir, published_by(self.run_dir))
            dropped = sorted(
                set(self.validation.accepted) - {n for n, e in limits["engines"].items() if not e.get("refused")}
            )
            if dropped:
                # Groups of that engine may wait for the validator: judged by another engine's limits
                # they would count as fraud against honest keys. Dropping an engine is a restart.
                raise LimitsError(
                    f"it does not accept {', '.join(dropped)}, which this run accepts and whose groups may be "
                    f"waiting: measure it too (--engines), or restart the run to drop it"
                )
            restarted = self.validation.replace_limits(limits)
        except (LimitsError, KeyError, TypeError, ValueError) as e:
            self.log(f"validator limits: {self.path} changed but is not taken, the run keeps its limits: {e}")
            return False
        model = limits.get("model") or {}
        measured_on = f"policy version {model['version']}" if "version" in model else "the starting model"
        accepted = ", ".join(n for n, e in limits["engines"].items() if not e.get("refused")) or "none"
        self.log(
            f"validator limits: now {self.path} (measured on {measured_on}, {limits['dtype']}, CPU kind "
            f"{(limits.get('cpu') or {}).get('kind')}; engines accepted: {accepted}); "
            + (
                "its evidence tests are the same, so each key's evidence score carries on"
                if restarted is None
                else f"its evidence tests differ, so {restarted} keys' evidence scores start again at 0"
            )
        )
        return True

    def run(self, stop: threading.Event, every_s: float = POLL_S) -> None:
        """Look at the file every `every_s` until `stop` is set (the server's thread)."""
        while not stop.wait(every_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - a reading error must not end the run's watch
                self.stamp = None  # looked at again next time, not only once the file changes
                self.log(f"validator limits: could not check {self.path}: {type(e).__name__}: {e}")


def published_by(run_dir: str | Path) -> Callable[[int], dict | None]:
    """`published(version)` for `run_limits`: the signed manifest this run's store keeps of a
    version it published (a version the trainer has pruned is known by it), read through a
    read-only store as an operator's script reads it; None when the store or the version is not
    there. A store that cannot be read raises OSError naming it."""
    path = Path(run_dir) / "orchestrator.sqlite"

    def published(version: int) -> dict | None:
        if not path.exists():
            return None
        try:
            store = Store.read_only(path)
            try:
                with store.read() as db:
                    row = store.policy(db, version)
            finally:
                store.close()
        except sqlite3.Error as e:
            raise OSError(f"{path}: {e}") from None
        return json.loads(row["manifest"]) if row else None

    return published


def stamp_of(path: Path) -> tuple | None:
    """What tells a rewritten file from the one read: its inode (`swarmrl calibrate` renames a new
    file into place), modification and change times and size; None when it is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size


def start(reload: LimitsReload, every_s: float = POLL_S) -> tuple[threading.Thread, threading.Event]:
    """The watch on a daemon thread: (thread, the event that stops it)."""
    stop = threading.Event()
    thread = threading.Thread(target=reload.run, args=(stop, every_s), name="limits-reload", daemon=True)
    thread.start()
    return thread, stop
