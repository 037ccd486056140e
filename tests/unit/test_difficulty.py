"""The pass-rate arithmetic of `swarmrl tasks filter` (swarmrl/eval/difficulty.py), by hand."""

from __future__ import annotations

import pytest

from swarmrl.eval.difficulty import has_signal, in_band, parse_band, pass_rate, summary


def result(rewards):
    return {"rewards": rewards, "correct": sum(1 for r in rewards if r >= 1.0)}


def test_rates_band_and_signal_by_hand():
    rs = [
        result([1, 1, 1, 1]),
        result([0, 0, 0, 0]),
        result([1, 0, 0, 0]),
        result([1, 1, 0, 0]),
        result([0.5, 0, 0, 0]),
    ]
    assert [pass_rate(r) for r in rs] == [1.0, 0.0, 0.25, 0.5, 0.0]
    # A partial reward counts as not right, but its rewards differ: signal without a pass.
    assert [has_signal(r) for r in rs] == [False, False, True, True, True]
    assert in_band(0.25, (0.25, 0.75)) and not in_band(0.0, (0.01, 1.0))
    s = summary(rs, (0.25, 0.75))
    assert s["problems"] == 5 and s["kept"] == 2 and s["signal_share"] == 3 / 5 and s["signal_share_kept"] == 1.0
    assert s["mean_pass_rate"] == (1 + 0 + 0.25 + 0.5 + 0) / 5
    assert s["problems_by_right_samples"] == {0: 2, 1: 1, 2: 1, 4: 1}


@pytest.mark.parametrize(("text", "needle"), [("0.8,0.1", "LO <= HI"), ("x", "give LO,HI"), ("0,1.5", "HI <= 1")])
def test_a_bad_band_is_refused(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_band(text)
    assert parse_band("0.1,0.8") == (0.1, 0.8)
