"""Hostile load (issue 15): honest workers keep their throughput while 20 free keys attack.

The scenario is tests/hostile.py: real processes on loopback only, the attackers (10 keys hoarding
leases, 10 submitting garbage with worst-case answers and well-formed proofs, a registration flood,
unsigned junk) in their own process. Bounded: two phases of PHASE_S seconds.

What it must show: honest groups accepted per second with attackers stay near the same count
without them, measured side by side in one run; /healthz answers within 1 s throughout; the
honest workers are never rejected or banned; every attacker key that got work ends refused.

The throughput goal (at least 80%) is a figure, measured over repeats by
`benchmarks/bench_orchestrator.py --attack 20` (docs/benchmarks.md). Here the attackers share the
honest workers' 2 cores, so one 12 s phase moves by several points with the machine's load (CI
once measured 0.796, and 0.67 on an AMD EPYC in a clean CI run): this test holds a floor of 60%
and checks the mechanism the fixed attacks worked through (0.57-0.68 before those fixes, under
load): the honest workers are never refused a lease nor rate-limited while attacked, which
hoarded leases counted against proven workers, or their groups awaiting a validator busy with
garbage counted against their allowance, did to them whatever the CPU's speed.
"""

from __future__ import annotations

import json

import pytest

from hostile import scenario

# serial: its figures are throughput under load, and another test beside it starves the attackers
# themselves (a parallel run once saw the registration flood make 15 requests and never reach
# the rate limit).
pytestmark = [pytest.mark.timeout(400), pytest.mark.serial]
PHASE_S = 12.0
FLOOR = 0.6  # of the calm throughput; the 80% goal is measured by the benchmark (see above)
REFUSED = ("no_lease", "lease_429", "submit_429")  # the Honest loop's notes of being turned away


def test_honest_workers_keep_their_throughput_under_attack(tmp_path):
    got = scenario(tmp_path, phase_s=PHASE_S)
    calm, attacked, report = got["calm"], got["attacked"], got["report"]
    print(
        f"honest groups/s: calm {calm:.2f}, attacked {attacked:.2f} ({attacked / calm:.0%}); "
        f"worst /healthz {got['worst_healthz_s'] * 1000:.0f} ms; final {json.dumps(report['final'])}"
    )
    print("calm:", got["calm_stats"], "\nattacked:", got["attacked_stats"])
    assert calm > 0
    turned_away = {k: v for k, v in got["attacked_stats"].items() if k.startswith(REFUSED)}
    assert not turned_away, f"the attack cost the honest workers leases or requests: {turned_away}"
    assert attacked >= FLOOR * calm, f"honest throughput fell to {attacked / calm:.0%} under attack"
    assert got["worst_healthz_s"] < 1.0, f"/healthz took {got['worst_healthz_s']:.2f} s"
    assert got["honest_rejected"] == []
    for me in got["honest_records"]:
        assert me["rejected"] == 0 and me["fraud"] == 0 and not me["banned"], me
    # The attack reached the server (this is not a test of nothing) ...
    seen = report["seen"]
    assert sum(c.get("lease", 0) for c in seen.values()) >= 10
    assert any(k.startswith("submitted") for c in seen.values() for k in c)
    assert seen["flood"].get("rate_limited", 0) > 0 and seen["junk"].get("401", 0) > 0
    # ... and every attacker key that got work ends up refused. A key the new workers' shared cap
    # kept from ever leasing cost the run nothing and is owed its first small lease (CI once saw
    # one such hoarder, starved of CPU at nice 19, end with "lease").
    leased = {k for k, c in seen.items() if k.startswith("key") and c.get("lease", 0) > 0}
    assert len(leased) >= len(report["final"]) // 2, seen
    refused = {k: v for k, v in report["final"].items() if k in leased and v not in {"banned", "allowance_exhausted"}}
    assert not refused, (refused, {k: seen.get(k) for k in refused})
    never = {k: v for k, v in report["final"].items() if k not in leased}
    assert all(v in {"banned", "allowance_exhausted", "lease"} or v.startswith("no_lease") for v in never.values()), (
        never
    )
