"""Eval metrics: unbiased pass@k and how well completions keep to a length target.

pass@k is estimated from n >= k samples per problem rather than by drawing
exactly k, because the naive "fraction of problems solved in the first k
samples" is high-variance and, averaged over many problems, biased. The
estimator and its numerically stable product form are from Chen et al. 2021,
"Evaluating Large Language Models Trained on Code" (the Codex paper).
"""

from __future__ import annotations


def _check_int(value: object, name: str) -> None:
    # bool is an int subclass; True as a sample count is a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement
    from n samples of which c are correct, is correct: 1 - C(n-c, k) / C(n, k).

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which equals the ratio of
    binomials but never forms them, so it neither overflows nor loses
    precision for large n. When fewer than k samples are wrong every k-subset
    holds a correct one, so the answer is exactly 1.0.
    """
    for value, name in ((n, "n"), (c, "c"), (k, "k")):
        _check_int(value, name)
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n (correct samples out of all), got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n (cannot draw k of n samples), got n={n}, k={k}")
    if n - c < k:
        return 1.0
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def ks_for(n: int) -> list[int]:
    """The k values worth reporting for n samples per problem: 1, 2, 4, ... below n, and n.

    ``ks_for(6) == [1, 2, 4, 6]``: powers of two keep the table short while
    showing the trend, and k = n is the best the samples can show.
    """
    _check_int(n, "n")
    if n < 1:
        raise ValueError(f"n (samples per problem) must be at least 1, got {n}")
    ks = []
    k = 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks


def length_adherence(lengths: list[int], target: int) -> dict[str, float]:
    """How close completion lengths (in tokens) came to a length target.

    Returns ``abs_error_mean`` (mean ``|length - target|`` in tokens),
    ``rel_error_mean`` (that divided by ``target``, so runs with different
    targets compare) and ``within_10pct`` (share of lengths no further than
    10% of ``target`` from it, boundary included).
    """
    _check_int(target, "target")
    if target < 1:
        raise ValueError(f"target must be at least 1 token, got {target}")
    if len(lengths) == 0:
        raise ValueError("lengths is empty; pass the token length of at least one completion")
    for index, length in enumerate(lengths):
        _check_int(length, f"lengths[{index}]")
        if length < 0:
            raise ValueError(f"lengths[{index}] is {length}; a token count cannot be negative")
    errors = [abs(length - target) for length in lengths]
    abs_error_mean = sum(errors) / len(errors)
    # Compare in integers (10 * error <= target) so 0.1 * target's rounding
    # cannot move a length that sits exactly on the boundary.
    within = sum(1 for error in errors if 10 * error <= target)
    return {
        "abs_error_mean": abs_error_mean,
        "rel_error_mean": abs_error_mean / target,
        "within_10pct": within / len(errors),
    }
