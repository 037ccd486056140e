"""Tests for swarmrl.eval.metrics: pass@k against hand-computed values and brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from swarmrl.eval.metrics import ks_for, length_adherence, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        # n=5, c=2: 3 wrong samples.
        (5, 2, 1, 0.4),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # only 3 wrong: every 4-subset holds a right one
        (5, 2, 5, 1.0),
        (10, 0, 1, 0.0),  # nothing right: C(10,k)/C(10,k) = 1
        (10, 0, 10, 0.0),
        (7, 7, 1, 1.0),  # c = n
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (100, 1, 1, 0.01),  # 1 - C(99,1)/C(100,1) = 1 - 99/100
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (6, 3, 2, 0.8),  # 1 - C(3,2)/C(6,2) = 1 - 3/15
    ],
)
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_brute_force_enumeration() -> None:
    """Share of k-subsets of n samples (the first c correct) that hold a correct one."""
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n() -> None:
    # Binomials of this size overflow floats; the product form must not.
    value = pass_at_k(10_000, 1, 1)
    assert value == pytest.approx(1e-4, rel=1e-9)
    assert math.isfinite(pass_at_k(10_000, 5_000, 5_000))


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (5, 6, 1, "0 <= c <= n"),
        (5, -1, 1, "0 <= c <= n"),
        (5, 2, 0, "1 <= k <= n"),
        (5, 2, 6, "1 <= k <= n"),
        (0, 0, 1, "1 <= k <= n"),
        (5.0, 2, 1, "n must be an int"),
        (5, True, 1, "c must be an int"),
    ],
)
def test_pass_at_k_errors(n, c, k, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 3]),
        (4, [1, 2, 4]),
        (6, [1, 2, 4, 6]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 9]),
        (16, [1, 2, 4, 8, 16]),
    ],
)
def test_ks_for(n: int, expected: list[int]) -> None:
    assert ks_for(n) == expected


def test_ks_for_rejects_no_samples() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ks_for(0)


def test_length_adherence_hand_checked() -> None:
    # target 100: errors |90-100|=10, |100-100|=0, |111-100|=11, |150-100|=50.
    # abs mean = (10+0+11+50)/4 = 71/4 = 17.75; rel = 17.75/100 = 0.1775;
    # within 10% (error <= 10): 90 (exactly on the boundary) and 100 -> 2/4.
    result = length_adherence([90, 100, 111, 150], 100)
    assert result == pytest.approx({"abs_error_mean": 17.75, "rel_error_mean": 0.1775, "within_10pct": 0.5})


def test_length_adherence_boundary_with_non_round_target() -> None:
    # target 30: 10% is 3 tokens; 33 and 27 are on the boundary, 34 is not.
    # errors 3, 3, 4 -> mean 10/3; within = 2/3.
    result = length_adherence([33, 27, 34], 30)
    assert result["abs_error_mean"] == pytest.approx(10 / 3)
    assert result["rel_error_mean"] == pytest.approx(10 / 90)
    assert result["within_10pct"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("lengths", "target", "message"),
    [
        ([], 100, "lengths is empty"),
        ([10], 0, "target must be at least 1"),
        ([10], -5, "target must be at least 1"),
        ([10, -1], 100, r"lengths\[1\] is -1"),
        ([10.5], 100, r"lengths\[0\] must be an int"),
    ],
)
def test_length_adherence_errors(lengths, target, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        length_adherence(lengths, target)
