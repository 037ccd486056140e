"""tests/support/harness.py's waiting, which every test of real processes leans on: a failed wait
says what it waited for with the log's end, and a dead process fails it at once."""

from __future__ import annotations

import time

import pytest

from harness import read_jsonl, tail, wait_for


class Exited:
    """A process (as wait_for polls it) that has exited with `code`."""

    def __init__(self, code: int):
        self.returncode = code

    def poll(self) -> int:
        return self.returncode


def test_a_wait_returns_what_the_condition_returned():
    calls = iter([None, 0, "", {"url": "http://x"}])
    assert wait_for(lambda: next(calls), 5, "the URL", every=0) == {"url": "http://x"}


def test_a_timed_out_wait_names_what_it_awaited_and_shows_the_logs_end(tmp_path):
    log = tmp_path / "role.log"
    log.write_text("x" * 5000 + "the last words")
    with pytest.raises(AssertionError, match="waiting for orchestrator.json: not within 0.1 s") as e:
        wait_for(lambda: False, 0.1, "orchestrator.json", log=log)
    assert str(e.value).endswith("the last words") and "x" * 3001 not in str(e.value)


def test_a_process_that_died_fails_the_wait_at_once_with_its_code():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="the process exited with code 3\nboom"):
        wait_for(lambda: False, 60, "metrics", proc=Exited(3), log=lambda: "boom")
    assert time.monotonic() - t0 < 5  # not the 60 s timeout


def test_what_a_dying_process_did_on_its_way_out_still_counts():
    seen = iter([False, True])
    assert wait_for(lambda: next(seen), 60, "the summary", proc=Exited(0)) is True


def test_logs_and_records_that_are_not_there_yet(tmp_path):
    assert tail(tmp_path / "absent.log") == f"({tmp_path / 'absent.log'} does not exist)"
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}]
