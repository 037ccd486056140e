"""A run without GRPO signal stops by itself: the trainer's side (it stops instead of waiting, and
says while it waits how many groups had all-equal rewards) and the launcher's (the role's message,
once, not a log tail). The orchestrator's rule and message: test_orchestrator_components.py; over
HTTP: tests/integration/test_orchestrator.py."""

from __future__ import annotations

import pytest

from swarmrl.entrypoints import trainer as trainer_entry
from swarmrl.launch import fatal
from swarmrl.launch.launcher import ChildDied, Children
from swarmrl.protocol.client import Refused
from swarmrl.protocol.messages import Batch
from swarmrl.trainer import loop
from swarmrl.transport.filesystem import RunDir

NO_SIGNAL = "no GRPO signal: the last 64 groups in a row had all-equal rewards\nFixes, one or more: ..."


class FakeClient:
    """Answers `batch` with the replies given, then refuses with no_signal."""

    def __init__(self, replies: list[dict], detail: str = NO_SIGNAL):
        self.replies, self.detail = list(replies), detail

    def batch(self, step: int) -> dict:
        if self.replies:
            return self.replies.pop(0)
        raise Refused(409, "no_signal", self.detail)


def link_with(client, accuracy_before: float | None) -> loop._Link:
    link = object.__new__(loop._Link)  # only what pull() reads: no key, no files, no server
    link.client, link.check, link.unreachable_s, link.accuracy_before = client, lambda: None, 1.0, accuracy_before
    return link


WAITING = {
    "ready": False,
    "step": 0,
    "queued": 0,
    "needed": 2,
    "groups_seen": 40,
    "groups_all_equal": 40,
    "all_equal_streak": 40,
    "all_equal_limit": 51,
}


def test_the_trainer_says_while_it_waits_how_many_groups_had_no_signal():
    note = loop.waiting_note(Batch(**WAITING))
    assert note == (
        "0/2 informative groups; 40 of the 40 groups sampled so far had all-equal rewards (no signal), "
        "the last 40 in a row: the run stops with no_signal at 51 in a row"
    )
    # An orchestrator that does not count them (or nothing sampled yet): the plain count.
    assert loop.waiting_note(Batch(ready=False, step=0, queued=1, needed=2)) == "1/2 informative groups"
    assert loop.waiting_note(Batch(**{**WAITING, "groups_seen": 0})) == "0/2 informative groups"


def test_the_trainer_stops_on_no_signal_with_the_message_and_its_held_out_accuracy(capsys):
    link = link_with(FakeClient([Batch(**WAITING), Batch(**WAITING)]), accuracy_before=0.0)
    with pytest.raises(loop.RunStopped) as e:
        link.pull(0, poll_s=0.0, report_s=0.0)
    assert str(e.value).startswith(NO_SIGNAL)
    assert str(e.value).endswith("Held-out accuracy before RL: 0.000 (measured by this trainer).")
    assert "40 of the 40 groups sampled so far had all-equal rewards" in capsys.readouterr().out
    # The orchestrator named it already (the trainer reported it): not twice.
    named = NO_SIGNAL + "\nHeld-out accuracy before RL: 0.000 (eval/accuracy at step 0)."
    with pytest.raises(loop.RunStopped) as e:
        link_with(FakeClient([], named), accuracy_before=0.0).pull(0)
    assert str(e.value) == named
    # Any other refusal is still an error of its own kind.
    other = link_with(FakeClient([]), None)
    other.client.batch = lambda step: (_ for _ in ()).throw(Refused(409, "wrong_step", "the next batch is 3"))
    with pytest.raises(RuntimeError, match="the next batch is 3") as e:
        other.pull(0)
    assert not isinstance(e.value, loop.RunStopped)


def test_the_trainer_role_records_the_message_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.toml").write_text("")  # one trainer rank: this process trains
    monkeypatch.setattr(loop, "run_trainer", lambda *a, **k: (_ for _ in ()).throw(loop.RunStopped(NO_SIGNAL)))
    with pytest.raises(SystemExit) as e:
        trainer_entry.main(trainer_entry.Settings(run_dir=str(tmp_path)), None)
    assert e.value.code == 2
    assert fatal.read(tmp_path) == ("trainer", NO_SIGNAL)
    err = capsys.readouterr().err
    assert err.startswith("swarmrl: error: no GRPO signal") and "Traceback" not in err
    assert "--resume" not in err  # resuming the same config would stop again


class FakeProc:
    def __init__(self, code: int | None):
        self.code, self.pid = code, 0

    def poll(self) -> int | None:
        return self.code


def test_the_launcher_shows_a_role_s_fatal_message_once_instead_of_its_log_tail(tmp_path):
    rd = RunDir(tmp_path)
    log = rd.logs / "trainer.log"
    log.write_text("Traceback (most recent call last):\n  ...\nswarmrl: error: " + NO_SIGNAL + "\n")
    children = Children(rd, log=lambda *_: None)
    children.procs = {"orchestrator": (FakeProc(None), rd.logs / "orchestrator.log"), "trainer": (FakeProc(2), log)}
    with pytest.raises(ChildDied) as e:  # a crash: the log's tail, as before
        children.check()
    assert "trainer exited with code 2" in str(e.value) and "Traceback" in str(e.value)
    fatal.record(tmp_path, "trainer", NO_SIGNAL)
    with pytest.raises(ChildDied) as e:
        children.check()
    shown = str(e.value)
    assert shown == f"the trainer stopped the run: {NO_SIGNAL}\n(logs: {rd.logs})"
    assert shown.count("no GRPO signal") == 1 and "Traceback" not in shown
    fatal.clear(tmp_path)  # what a new start of the run does
    assert fatal.read(tmp_path) is None
