"""Difficulty from a model's own samples: pass rates per problem, the band kept, what has signal.

A problem's pass rate is the share of its k samples graded fully right (reward 1, no error), the
INTELLECT-2 seed's offline "solve rate" measured with the run's own model. GRPO learns only from
a group whose rewards differ; for a 0/1 reward that is a problem whose rate lies strictly between
0 and 1, so `signal_share` is the share of problems whose group would have signal, estimated
from the same k samples. Pure functions: `swarmrl filter` (entrypoints/filter.py) does the I/O.
"""

from __future__ import annotations

from collections import Counter


def pass_rate(result: dict) -> float:
    """The share of a problem's samples graded fully right (an eval runner result)."""
    return result["correct"] / len(result["rewards"]) if result["rewards"] else 0.0


def in_band(rate: float, band: tuple[float, float]) -> bool:
    lo, hi = band
    return lo <= rate <= hi


def has_signal(result: dict) -> bool:
    """Whether the problem's k rewards differ (a GRPO group of them would have an advantage)."""
    return len(set(result["rewards"])) > 1


def summary(results: list[dict], band: tuple[float, float]) -> dict:
    """Counts for the report: problems, kept, the share with signal before and among the kept, and
    how many problems had each number of right samples."""
    kept = [r for r in results if in_band(pass_rate(r), band)]
    return {
        "problems": len(results),
        "kept": len(kept),
        "band": list(band),
        "signal_share": sum(map(has_signal, results)) / len(results) if results else 0.0,
        "signal_share_kept": sum(map(has_signal, kept)) / len(kept) if kept else 0.0,
        "mean_pass_rate": sum(map(pass_rate, results)) / len(results) if results else 0.0,
        "problems_by_right_samples": dict(sorted(Counter(r["correct"] for r in results).items())),
    }


def parse_band(text: str) -> tuple[float, float]:
    """ "LO,HI" with 0 <= LO <= HI <= 1; ValueError naming the problem."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--band {text!r}: give LO,HI, two pass rates such as 0.1,0.8") from None
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"--band {text!r}: need 0 <= LO <= HI <= 1")
    return lo, hi
