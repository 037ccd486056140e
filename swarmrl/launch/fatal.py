"""A role's fatal error, for `swarmrl rl` to show as the role wrote it.

A role that stops the run for a reason the user must act on (the trainer on no_signal: no group
has any GRPO signal) is not a crash: a log tail with a traceback buries the one thing to read.
Such a role writes its message to <run-dir>/fatal.txt before it exits non-zero, and the launcher
prints that message, once, in place of the role's log tail. A new start of the run removes it.
"""

from __future__ import annotations

from pathlib import Path

from swarmrl.transport.filesystem import atomic_write_text

FILE = "fatal.txt"


def record(run_dir: str | Path, role: str, message: str) -> None:
    """Role `role` stops the run with `message` (what is wrong and what to do)."""
    atomic_write_text(Path(run_dir) / FILE, f"{role}\n{message}\n")


def read(run_dir: str | Path) -> tuple[str, str] | None:
    """(role, message) of the role that stopped the run, or None."""
    path = Path(run_dir) / FILE
    try:
        role, _, message = path.read_text(errors="replace").partition("\n")
    except FileNotFoundError:
        return None
    return role, message.strip()


def clear(run_dir: str | Path) -> None:
    """Forget an earlier start's fatal error (a resumed run starts clean)."""
    (Path(run_dir) / FILE).unlink(missing_ok=True)
