"""What a run's validation decided, per worker key, from its store: the table docs/validation.md
gives for each `swarmrl rl` run of issue 49 ("Through `swarmrl rl`").

For every key: groups accepted, how many were fully checked (a validator's verdict with its
statistics), how many were refused and why, the worst statistic each check saw, the versions it
worked on, whether it was banned and after how many fully checked groups, and each sequential
test's score and peak against its ban bound (bounds from the run's limits file). Reads the store
read-only, so it can run beside a live orchestrator or after the run.

    python benchmarks/evidence_report.py RUN_DIR [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

from swarmrl.config import load_config
from swarmrl.orchestrator.store import Store
from swarmrl.proofs.evidence import EvidenceModel

STATS = (
    "mant_err_group",
    "mant_err_mean_max",
    "exp_mismatches_max",
    "sampling_margin_max",
    "logprob_err_max",
    "logprob_err_mean",
    "logprob_bias",
)


BUCKET = 20  # versions per row of the drift view

SHOWN = ("mant_err_group", "logprob_err_max", "sampling_margin_max")  # the table's worst-statistics column


def bounds(run: Path) -> dict[tuple[str, str], float]:
    """(engine, test name) -> ban bound, from the limits file the run validated with."""
    cfg = load_config(run / "config.toml")
    path = cfg.validator.limits_file
    if not path:
        return {}
    engines = json.loads(Path(path).expanduser().read_text()).get("engines", {})
    out = {}
    for engine, e in engines.items():
        for d in e.get("evidence") or []:
            m = EvidenceModel.from_dict(d)
            out[(engine, m.name)] = m.bound
    return out


def report(run: Path) -> list[dict]:
    """One entry per worker key, in the order the keys registered."""
    store = Store.read_only(run / "orchestrator.sqlite")
    limit = bounds(run)
    with store.read() as db:
        workers = [dict(r) for r in db.execute("SELECT * FROM workers ORDER BY registered")]
        rows = db.execute("SELECT worker, state, verdict, policy_version FROM groups ORDER BY id").fetchall()
        rejections = db.execute("SELECT worker, reason FROM rejections").fetchall()
        evidence = [dict(r) for r in db.execute("SELECT * FROM evidence")]
    entries = {}
    for w in workers:
        entries[w["key"]] = {
            "name": w["name"],
            "accepted": w["accepted"],
            "banned": bool(w["banned"]),
            "checked": 0,
            "hard": 0,
            "refused": collections.Counter(),
            "states": collections.Counter(),
            "worst": {},
            "versions": [],
            "by_version": collections.defaultdict(list),  # version bucket -> passed groups' group statistic
            "checked_before_ban": None,
            "evidence": [],
        }
    for r in rows:
        e = entries.get(r["worker"])
        if e is None:
            continue
        e["states"][r["state"]] += 1
        e["versions"].append(r["policy_version"])
        verdict = json.loads(r["verdict"]) if r["verdict"] else None
        if not verdict:
            continue
        if not verdict.get("ok"):  # refused by a hard limit: judged (the rejections table has why)
            e["checked"] += 1
            e["hard"] += 1
        elif r["state"] == "rejected":
            # A ban refuses the key's untrained groups, judged or not, under the verdict of the
            # group that crossed the bound: counted once below, from the evidence table.
            e["refused"]["at its ban"] += 1
        elif verdict.get("stats"):
            e["checked"] += 1
            x = verdict["stats"].get("mant_err_group")
            if isinstance(x, (int, float)):
                e["by_version"][r["policy_version"] // BUCKET * BUCKET].append(float(x))
            for k in STATS:
                x = verdict["stats"].get(k)
                if isinstance(x, (int, float)):
                    e["worst"][k] = max(e["worst"].get(k, float("-inf")), float(x))
    for r in rejections:  # at submission, by a validator's hard limits, or the ban itself ("evidence")
        if r["worker"] in entries:
            entries[r["worker"]]["refused"][r["reason"]] += 1
    for ev in evidence:
        e = entries.get(ev["worker"])
        if e is not None:
            bound = limit.get((ev["engine"], ev["test"]))
            e["evidence"].append(
                {
                    "engine": ev["engine"],
                    "test": ev["test"],
                    "groups": ev["groups"],
                    "score": ev["score"],
                    "peak": ev["peak"],
                    "bound": bound,
                    "peak_share": ev["peak"] / bound if bound else None,
                }
            )
    out = []
    for e in entries.values():
        e["versions"] = [min(e["versions"]), max(e["versions"])] if e["versions"] else []
        e["refused"], e["states"] = dict(e["refused"]), dict(e["states"])
        # Drift: does honest work move away from the calibrated version as the policy learns?
        e["by_version"] = {
            f"v{b}-v{b + BUCKET - 1}": {"groups": len(xs), "median": statistics.median(xs), "max": max(xs)}
            for b, xs in sorted(e["by_version"].items())
        }
        if e["banned"]:
            # fully checked before the ban: the hard refusals, and the groups that passed them,
            # each of which went into every sequential test of its engine
            passed = max((x["groups"] for x in e["evidence"]), default=0)
            e["checked_before_ban"] = passed + e["hard"]
        e["evidence"].sort(key=lambda x: -(x["peak_share"] or 0))
        out.append(e)
    return out


def markdown(entries: list[dict]) -> str:
    lines = [
        "| worker | groups accepted (fully checked) | trained on | refused | worst group statistic / logprob error / "
        "sampling margin | highest evidence (peak / bound) | how it ended |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        w = e["worst"]
        worst = " / ".join(f"{w[k]:.3g}" if k in w else "-" for k in SHOWN)
        top = e["evidence"][0] if e["evidence"] else None
        peak = "-"
        if top and top["bound"]:
            peak = f"{top['peak']:.2f} / {top['bound']:.1f} ({top['engine']} {top['test']})"
        refused = ", ".join(f"{k} {n}" for k, n in sorted(e["refused"].items())) or "0"
        ended = f"banned after {e['checked_before_ban']} fully checked groups" if e["banned"] else "not banned"
        trained = e["states"].get("consumed", 0)
        cells = [e["name"], f"{e['accepted']} ({e['checked']})", trained, refused, worst, peak, ended]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Group statistic of passed groups by version (drift from the calibrated version):", ""]
    for e in entries:
        if e["by_version"] and not e["banned"]:
            cells = [
                f"{k}: median {d['median']:.2f}, max {d['max']:.2f} ({d['groups']})" for k, d in e["by_version"].items()
            ]
            lines.append(f"- {e['name']}: " + "; ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--json", action="store_true", help="print every figure as JSON instead of the table")
    args = ap.parse_args()
    entries = report(args.run_dir)
    print(json.dumps(entries, indent=1) if args.json else markdown(entries))


if __name__ == "__main__":
    main()
