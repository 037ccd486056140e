"""relay_window (swarmrl/transport/broadcast/install.py): when a worker believes a relay's
"incoming" list. Pure: polls in, (figures, until) out."""

from __future__ import annotations

from swarmrl.transport.broadcast.install import relay_window

KW = {"version": 5, "stall_s": 10.0, "delivered": False}


def test_a_listing_without_a_figure_from_a_relay_that_never_delivered_is_not_waited_for():
    assert relay_window(None, 0.0, {5: None}, now=100.0, **KW) == ({}, 100.0)
    # having delivered before, it gets one window, which nothing can extend
    figures, until = relay_window(None, 0.0, {5: None}, now=100.0, **{**KW, "delivered": True})
    assert until == 110.0
    assert relay_window(figures, until, {5: None}, now=105.0, **KW) == ({}, 110.0)


def test_only_growth_extends_the_window_and_only_versions_up_to_the_one_wanted_count():
    figures, until = relay_window(None, 0.0, {4: 0, 5: 0}, now=100.0, **KW)
    assert until == 110.0  # a figure opens one window, even 0
    assert relay_window(figures, until, {4: 0, 5: 0}, now=105.0, **KW)[1] == 110.0  # no growth
    assert relay_window(figures, until, {5: 1, 6: 0}, now=105.0, **KW)[1] == 115.0  # v5 grew
    assert relay_window(figures, until, {6: 1 << 30}, now=105.0, **KW)[1] == 110.0  # v6 is not wanted
    assert relay_window(figures, until, {}, now=105.0, **KW)[1] == 110.0  # unlisted: the clock runs on
    # a figure that shrinks (a liar, or a restart) is no growth
    grown, later = relay_window({5: 1000}, 110.0, {5: 10}, now=105.0, **KW)
    assert (grown, later) == ({5: 1000}, 110.0)


def test_a_relay_listing_nothing_wanted_has_no_window():
    assert relay_window(None, 0.0, {}, now=100.0, **KW) is None
    assert relay_window(None, 0.0, {6: 1 << 20}, now=100.0, **KW) is None


def test_a_penalized_relay_gets_no_window_and_one_that_had_one_is_closed():
    """The review's F3: a relay that made this worker wait for nothing before (or failed it) is
    penalized in SourceScores; it is not waited for, whatever it lists."""
    assert relay_window(None, 0.0, {5: 0}, now=100.0, penalized=True, **KW) == ({}, 100.0)
    assert relay_window(None, 0.0, {5: None}, now=100.0, penalized=True, **{**KW, "delivered": True})[1] == 100.0
    assert relay_window({5: 10}, 110.0, {5: 20}, now=105.0, penalized=True, **KW) == ({5: 10}, 105.0)
    assert relay_window(None, 0.0, {}, now=100.0, penalized=True, **KW) is None  # nothing listed


def test_a_figure_above_the_versions_signed_size_is_a_lie_and_closes_the_window():
    """F3: progress above the manifest's total_size cannot be a copy coming in."""
    assert relay_window(None, 0.0, {5: 1001}, now=100.0, total_size=1000, **KW) == ({}, 100.0)
    figures, until = relay_window(None, 0.0, {5: 10}, now=100.0, total_size=1000, **KW)
    assert until == 110.0
    assert relay_window(figures, until, {5: 1000}, now=105.0, total_size=1000, **KW) == ({5: 1000}, 115.0)
    assert relay_window(figures, until, {5: 1 << 40}, now=105.0, total_size=1000, **KW) == ({5: 10}, 105.0)
    # an older version's figure is not bounded by this version's size (a LoRA base is larger)
    assert relay_window(figures, until, {4: 1 << 20}, now=105.0, total_size=1000, **KW)[1] == 115.0
