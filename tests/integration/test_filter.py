"""`swarmrl tasks filter`: a model's own pass rate per problem decides which rows are kept
(tests/unit/test_difficulty.py checks the arithmetic of the report)."""

from __future__ import annotations

import json

from swarmrl.data.loading import load_tasks

from runs import swarmrl


def test_filter_keeps_the_rows_in_the_band_with_their_rates_and_reports_the_signal(easy_base, tmp_path):
    rows, kept = tmp_path / "rows.jsonl", tmp_path / "kept.jsonl"
    swarmrl("tasks", "--output", str(rows), "--n", "16", "--digits", "1")
    args = ["tasks", "filter", "--input", str(rows), "--model", str(easy_base), "--k", "4", "--band", "0.25,0.75"]
    proc = swarmrl(*args, "--max-tokens", "32", "--output", str(kept), "--streams", "1")
    report = json.loads(proc.stdout)
    written = [json.loads(line) for line in kept.read_text().splitlines()]
    assert report["problems"] == 16 and report["kept"] == len(written)
    # Each kept row is an input row plus its rate, which is a multiple of 1/k inside the band.
    inputs = {r["problem_id"]: r for r in map(json.loads, rows.read_text().splitlines())}
    for row in written:
        rate = row.pop("solve_rate")
        assert row == inputs[row["problem_id"]] and 0.25 <= rate <= 0.75 and rate * 4 == int(rate * 4)
    # Every kept problem had signal (1 to 3 right of 4); the counts by right samples add up.
    assert report["signal_share_kept"] == 1.0 or not written
    by_right = {int(k): v for k, v in report["problems_by_right_samples"].items()}
    assert sum(by_right.values()) == 16 and by_right.get(1, 0) + by_right.get(2, 0) + by_right.get(3, 0) == len(written)
    assert report["signal_share"] == len(written) / 16
    # A run reads the rate back as its solve-rate column.
    assert len(load_tasks(str(kept), solve_rate_column="solve_rate", solve_rate_range=(0.0, 1.0)).rows) == len(written)
