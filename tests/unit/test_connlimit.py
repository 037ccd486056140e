"""Connection slots per source address (transport/connlimit.py), by hand."""

from __future__ import annotations

import pytest

from swarmrl.transport.connlimit import SourceSlots, refusal_response, source_of


def test_a_source_is_an_ipv4_address_or_an_ipv6_64():
    assert source_of("127.0.0.3") == "127.0.0.3"
    assert source_of("::ffff:10.1.2.3") == "10.1.2.3"  # IPv4-mapped: the same host as 10.1.2.3
    # One host is handed a whole /64: its addresses are one source.
    assert source_of("2001:db8:1:2::1") == source_of("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    assert source_of("2001:db8:1:3::1") != source_of("2001:db8:1:2::1")
    assert source_of("fe80::1%eth0") == "fe80::/64"
    assert source_of(None) == "unknown" and source_of("not-an-ip") == "not-an-ip"


def test_a_source_stops_at_its_cap_while_another_is_admitted():
    slots = SourceSlots(total=10, per_source=3, reserve=0, share=1)
    assert [slots.admit("a") for _ in range(4)] == [None, None, None, "per_source"]
    assert slots.admit("b") is None
    assert slots.count == 4 and slots.open == {"a": 3, "b": 1}
    slots.release("a")
    assert slots.admit("a") is None  # a released slot can be taken again
    assert slots.refused == {"per_source": 1}


def test_the_reserve_goes_only_to_sources_holding_few():
    # total 8, the last 3 only for sources holding fewer than 2.
    slots = SourceSlots(total=8, per_source=4, reserve=3, share=2)
    assert [slots.admit("a") for _ in range(4)] == [None] * 4
    assert slots.admit("b") is None  # 5 open: the reserve starts at 5
    assert slots.admit("b") is None  # b held 1 < share: it may take reserved room
    assert slots.admit("b") == "reserve"  # b holds 2 now
    assert slots.admit("a") == "per_source"
    assert slots.admit("c") is None and slots.admit("d") is None  # newcomers still get in
    assert slots.count == 8
    assert slots.admit("e") == "total"
    assert slots.refused == {"reserve": 1, "per_source": 1, "total": 1}


def test_sized_defaults_keep_a_quarter_for_newcomers():
    slots = SourceSlots.sized(1000, 64)
    assert (slots.reserve, slots.share) == (250, 16)
    hogs = [f"10.0.0.{i}" for i in range(12)]
    for h in hogs:  # 12 sources at their cap reach 768, past the reserve (750)
        while slots.admit(h) is None:
            pass
    assert slots.count == 750  # the 12th source stopped at the reserve line
    assert all(slots.admit(f"10.0.1.{i}") is None for i in range(200))  # 200 newcomers, 1 each


def test_release_of_a_source_never_admitted_changes_nothing():
    slots = SourceSlots(total=4, per_source=2)
    slots.release("nobody")
    assert slots.count == 0 and slots.open == {}


@pytest.mark.parametrize(
    "kwargs",
    [{"total": 0}, {"per_source": 0}, {"total": 4, "reserve": 4}, {"per_source": True}, {"share": 1.5}],
)
def test_bad_limits_are_refused(kwargs):
    with pytest.raises(ValueError, match="connection"):
        SourceSlots(**kwargs)


def test_the_refusal_is_a_complete_503_naming_the_cause():
    raw = refusal_response("per_source")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head and b"Connection: close" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert b"your address" in body
