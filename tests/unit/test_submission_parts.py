"""A lease's submission split into requests under a byte budget (protocol/messages.py
`submission_parts`): groups in order, each exactly once, one oversized group alone."""

from __future__ import annotations

import json

from swarmrl.protocol.messages import submission_parts


def body(sizes: list[int]) -> dict:
    return {"lease_id": "L", "groups": [{"slot": i, "samples": "x" * n} for i, n in enumerate(sizes)]}


def size(part: dict) -> int:
    return len(json.dumps(part))


def test_groups_are_packed_in_order_under_the_budget_and_each_is_sent_once():
    sub = body([100, 100, 100, 500, 100])
    parts = submission_parts(sub, 300)
    assert [[g["slot"] for g in p["groups"]] for p in parts] == [[0, 1], [2], [3], [4]]
    assert all(p["lease_id"] == "L" for p in parts)
    assert [g for p in parts for g in p["groups"]] == sub["groups"]
    assert all(size(p) <= 300 for p in parts if len(p["groups"]) > 1)  # only a lone group may be over
    assert size(parts[2]) > 300  # the 500-byte group alone


def test_a_budget_above_the_whole_submission_sends_it_in_one_part_and_none_gives_none():
    sub = body([50, 60, 70])
    assert submission_parts(sub, size(sub)) == [sub]
    assert submission_parts(sub, size(sub) - 1) != [sub]
    assert submission_parts(body([]), 100) == []
