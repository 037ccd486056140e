"""Evidence per key: a sequential test over all the groups a key sends, not a verdict per group.

In bfloat16 on a deep model one honest group and one group of a cheaper model (int8 weights) can
give the same statistics: a single group is too little evidence to ban anyone. A key's groups
together are not: an int8 worker's groups sit above the honest ones *on average*. So every
statistic a verdict reports (the group's typical TOPLOC chunk, its logprob error, its sampling
gap) is binned, each bin carries a log-likelihood ratio log(q_i / u_i) of a cheat against honest
work, and a key's ratios are summed in a CUSUM (`cusum`): S_n = max(0, S_{n-1} + llr_n). The key
is banned when S reaches `bound`. Several tests (one per cheat of the calibration that needs
one, each on the statistic that separates that cheat best) run side by side, each its own CUSUM;
the bound pays for the number of them.

Why this bound holds a stated false-ban rate (the guarantee is what `swarmrl calibrate` writes
into a limits file, pure arithmetic here):
  * q is a distribution over the bins (the nearest cheat's frequencies, smoothed: sums to 1), and
    u_i is an upper confidence bound on the probability of bin i under honest work, so for the
    true honest probabilities p_i <= u_i: E[exp(llr)] = sum_i p_i q_i / u_i <= sum_i q_i = 1.
    exp(partial sums) from any starting group is then a non-negative supermartingale, and by
    Ville's inequality it reaches exp(h) with probability at most exp(-h).
  * The CUSUM restarts at most once per group, so over a key's first N groups it reaches h with
    probability at most N exp(-h): h = log(N / alpha) bans an honest key with probability at
    most alpha over N groups (`ban_bound`).
The bound holds only where the honest bin probabilities really are below u: on the model, dtype,
engine and CPU kind the calibration measured. A run outside them is told so (validator/core.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EvidenceModel:
    """How one statistic of a verdict turns into evidence."""

    statistic: str
    """The verdict statistic it reads (a key of `Verdict.stats`, e.g. "mant_err_group")."""
    edges: tuple[float, ...]
    """Ascending bin edges: bin 0 holds values <= edges[0], bin i values in (edges[i-1], edges[i]],
    the last bin values above edges[-1]."""
    llr: tuple[float, ...]
    """log(q_i / u_i) per bin (len(edges) + 1 entries): positive where cheats are more likely."""
    bound: float
    """The CUSUM level at which a key is banned (`ban_bound`)."""
    target: str = ""
    """The cheat it was fitted to (a limits file has one test per cheat that needs one)."""

    def step(self, score: float, stats: dict) -> float:
        """A key's score after one more group with these verdict statistics (`cusum`)."""
        return cusum(score, group_llr(float(stats.get(self.statistic, 0.0)), self))

    @property
    def name(self) -> str:
        """The test's name: its statistic, and the cheat it aims at."""
        return f"{self.statistic} vs {self.target}" if self.target else self.statistic

    def to_dict(self) -> dict:
        return {
            "statistic": self.statistic,
            "target": self.target,
            "edges": list(self.edges),
            "llr": list(self.llr),
            "bound": self.bound,
        }

    @classmethod
    def from_dict(cls, d: dict) -> EvidenceModel:
        edges, llr = tuple(float(x) for x in d["edges"]), tuple(float(x) for x in d["llr"])
        if len(llr) != len(edges) + 1 or list(edges) != sorted(edges):
            raise ValueError("an evidence model needs ascending edges and one llr per bin (len(edges) + 1)")
        return cls(str(d["statistic"]), edges, llr, float(d["bound"]), str(d.get("target", "")))


def bin_of(value: float, edges: tuple[float, ...] | list[float]) -> int:
    """The bin of `value`: values equal to an edge fall in the bin below it."""
    return bisect.bisect_left(edges, value)


def group_llr(value: float, model: EvidenceModel) -> float:
    """The evidence one group's statistic adds (a NaN or missing value: none)."""
    if value is None or math.isnan(value):
        return 0.0
    return model.llr[bin_of(value, model.edges)]


def cusum(score: float, llr: float) -> float:
    """The key's score after one more group: max(0, score + llr)."""
    return max(0.0, score + llr)


def ban_bound(false_ban_rate: float, horizon: int, tests: int = 1) -> float:
    """h = log(tests x horizon / false_ban_rate): an honest key reaches it in any of `tests`
    CUSUMs (one per statistic, run side by side) within `horizon` groups with probability at most
    `false_ban_rate` (module docstring; a union bound over the tests)."""
    if not 0 < false_ban_rate < 1 or horizon < 1 or tests < 1:
        raise ValueError("false_ban_rate must be in (0, 1), horizon and tests at least 1")
    return math.log(tests * horizon / false_ban_rate)


def upper_bound(count: int, n: int, confidence: float) -> float:
    """A one-sided upper confidence bound on a probability seen `count` times in `n` draws
    (Clopper-Pearson, by bisection on the binomial tail; 0 seen: 1 - (1 - confidence)^(1/n))."""
    if n <= 0:
        return 1.0
    if count >= n:
        return 1.0
    delta = 1.0 - confidence
    if count == 0:
        return 1.0 - delta ** (1.0 / n)

    def tail(p: float) -> float:  # P(X <= count) under Binomial(n, p)
        return sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(count + 1))

    lo, hi = count / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def _quantile(sorted_values: list[float], q: float) -> float:
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


def fit(
    statistic: str,
    honest: list[float],
    cheat: list[float],
    *,
    bound: float,
    confidence: float = 0.99,
    quantiles: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9, 0.97),
) -> EvidenceModel:
    """An evidence model for one statistic from calibration samples: edges at the honest
    `quantiles` and maximum, and between the honest maximum and the cheat's median; u from the
    honest counts (each bin's bound at `confidence`, Bonferroni over the bins), q from the cheat's
    counts plus one half per bin (so no bin has q = 0 and q sums to 1)."""
    if not honest or not cheat:
        raise ValueError(f"{statistic}: fitting evidence needs honest and cheat samples")
    hs, cs = sorted(honest), sorted(cheat)
    top, cheat_mid = hs[-1], _quantile(cs, 0.5)
    edges = {_quantile(hs, q) for q in quantiles} | {top}
    if cheat_mid > top:
        edges |= {(top + cheat_mid) / 2, cheat_mid}
    ordered = tuple(sorted(edges))
    k = len(ordered) + 1
    h_counts, c_counts = [0] * k, [0] * k
    for v in hs:
        h_counts[bin_of(v, ordered)] += 1
    for v in cs:
        c_counts[bin_of(v, ordered)] += 1
    per_bin = 1.0 - (1.0 - confidence) / k
    u = [upper_bound(c, len(hs), per_bin) for c in h_counts]
    q = [(c + 0.5) / (len(cs) + 0.5 * k) for c in c_counts]
    return EvidenceModel(statistic, ordered, tuple(math.log(qi / ui) for qi, ui in zip(q, u)), bound)


def mean_llr(model: EvidenceModel, values: list[float]) -> float:
    """The average evidence per group of a sample (positive: a key sending such groups is banned
    after about bound / mean groups)."""
    return sum(group_llr(v, model) for v in values) / len(values) if values else 0.0


def groups_to_ban(model: EvidenceModel, values: list[float]) -> float:
    """Groups a key sending groups like `values` needs, on average, before its score reaches the
    bound (inf when its groups carry no evidence against it)."""
    m = mean_llr(model, values)
    return model.bound / m if m > 0 else math.inf


def simulate_ban(models: list[EvidenceModel], groups: list[dict]) -> int | None:
    """The group at which a key sending groups with exactly these statistics, in order, is banned
    by any of `models` (one CUSUM each; 1-based; None if never)."""
    scores = [0.0] * len(models)
    for i, stats in enumerate(groups, 1):
        for j, m in enumerate(models):
            scores[j] = m.step(scores[j], stats)
            if scores[j] >= m.bound:
                return i
    return None


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


@dataclass(frozen=True)
class DriftReference:
    """What a run's calibration says about one statistic of honest work, to notice when the
    run's work no longer looks like it (the policy moved on, or the workers run otherwise than the
    calibration did): honest groups fall above `level` (the calibration's 90th percentile) with
    probability at most `share` (a 99 % upper confidence bound on the share it saw above it)."""

    statistic: str
    level: float
    share: float

    @classmethod
    def of(cls, statistic: str, honest: list[float], q: float = 0.9, confidence: float = 0.99) -> DriftReference:
        xs = sorted(honest)
        level = _quantile(xs, q)
        return cls(statistic, level, upper_bound(sum(x > level for x in xs), len(xs), confidence))

    def surprise(self, values: list[float]) -> tuple[int, float]:
        """(how many of `values` lie above the level, the probability of at least that many among
        honest work as calibrated): a small probability says the calibration no longer describes
        the work these values came from."""
        above = sum(v > self.level for v in values)
        return above, binomial_tail(above, len(values), self.share)
