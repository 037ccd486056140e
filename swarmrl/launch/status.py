"""`swarmrl status`: the dashboard document (orchestrator/dashboard.py) as terminal tables."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _evidence(rows: list[dict]) -> str:
    """The key's closest test to a ban: "score/bound test (groups)"; "-" without any."""
    rows = [r for r in rows if r.get("bound")]
    if not rows:
        return "-"
    r = max(rows, key=lambda r: r["score"] / r["bound"])
    return f"{r['score']:.1f}/{r['bound']:.1f} {r['test']} ({r['groups']})"


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _num(point: dict, key: str, fmt: str = "{:.3f}") -> str:
    value = point.get(key)
    return "" if value is None else fmt.format(value)


def render(doc: dict, *, steps: int = 10, workers: int = 20, console: Console | None = None) -> None:
    console = console or Console()
    run = doc["run"]
    state = "finished" if run["finished"] else "running"
    latest = "none yet" if run["latest_version"] is None else f"v{run['latest_version']}"
    console.print(
        Text(
            f"run {run['run_id']}  {state}  step {run['next_step']}/{run['total_steps']}  policy {latest}  "
            f"async bound {run['async_bound']}  {run['prompts_per_step']} prompts x {run['group_size']} "
            f"per step  (as of {time.strftime('%H:%M:%S', time.localtime(run['time']))})"
        )
    )

    progress = Table(title="progress (newest steps)", title_justify="left")
    for name in ("step", "reward/mean", "held-out acc", "length/mean", "len err", "off-policy max", "tokens"):
        progress.add_column(name, justify="right")
    for p in doc["progress"][-steps:]:
        progress.add_row(
            str(p["step"]),
            _num(p, "reward/mean"),
            _num(p, "eval/accuracy"),
            _num(p, "length/mean", "{:.1f}"),
            _num(p, "length/abs_error_mean", "{:.1f}"),
            _num(p, "off_policy/max", "{:.0f}"),
            _num(p, "batch/generated_tokens", "{:.0f}"),
        )
    console.print(progress)

    board = Table(title=f"workers ({doc['workers_total']}; most accepted groups first)", title_justify="left")
    columns = ("fingerprint", "name", "accepted", "validated", "rejected", "fraud", "evidence", "status", "last seen")
    for name in columns:
        board.add_column(name, justify="right" if name in ("accepted", "validated", "rejected", "fraud") else "left")
    for w in doc["workers"][:workers]:
        status = "BANNED" if w["banned"] else ("trusted" if w["trusted"] else "ok")
        why = ", ".join(f"{r} {n}" for r, n in sorted(w["rejections"].items(), key=lambda kv: -kv[1])[:2])
        # Names are chosen by workers: printed as plain text (Text), never parsed as markup.
        board.add_row(
            w["fingerprint"],
            Text(w["name"][:32]),
            str(w["accepted"]),
            str(w["validated"]),
            f"{w['rejected']}" + (f" ({why})" if why else ""),
            str(w["fraud"]),
            _evidence(w.get("evidence") or []),
            Text(status, style="bold red" if w["banned"] else ""),
            _ago(w["last_seen_s"]),
        )
    console.print(board)

    v = doc["validation"]
    groups = "  ".join(f"{k} {n}" for k, n in v["groups"].items())
    reasons = ", ".join(f"{k} {n}" for k, n in sorted(v["rejections"].items(), key=lambda kv: -kv[1])) or "none"
    console.print(Text(f"validation ({v['mode']}): {groups}\nrejections: {reasons}"))
    st = doc.get("store")
    if st:
        mb = 1 << 20
        console.print(
            Text(
                f"store: {st['bytes'] / mb:.1f} MB (+ {st['wal_bytes'] / mb:.1f} MB log, "
                f"{st['free_bytes'] / mb:.1f} MB free); tokens and proofs of {st['groups_with_payload']} groups "
                f"({st['payload_bytes'] / mb:.1f} MB), {st['groups_pruned']} groups trained on and pruned to summaries"
            )
        )
    lim = v.get("limits")
    if lim:
        console.print(
            Text(
                f"limits: measured on policy version {lim['measured_on']} ({lim['dtype']}, CPU kind {lim['cpu']}); "
                f"engines accepted: {', '.join(lim['engines']) or 'none'}"
            )
        )
    for engine, d in (v.get("drift") or {}).items():
        console.print(
            Text(
                f"drift {engine}: {'ALARM, ' if d['alarm'] else ''}{d['above']} of the last {d['window']} passed "
                f"groups above the calibration's honest 90th percentile of {d['statistic']} "
                f"(at most {d['expected_at_most']:g} expected): "
                + ("measure the limits again near the current version" if d["alarm"] else "within the calibration")
            )
        )
    versions = doc["broadcast"]["versions"][:5]
    if versions:
        shown = ", ".join(
            f"v{x['version']}"
            + (f" {x['bytes'] / 1e6:.1f} MB" if x["bytes"] else "")
            + (" (adapter)" if x["adapter"] else "")
            for x in versions
        )
        console.print(Text(f"newest versions: {shown}"))


def fetch(orchestrator: str) -> dict:
    """GET /v1/dashboard, or ValueError saying why not (the TLS errors of protocol/tls.py pass)."""
    import httpx

    from swarmrl.protocol.tls import TLSError, explain, tls_failure

    url = orchestrator + "/v1/dashboard"
    try:
        response = httpx.get(url, timeout=30)
    except httpx.HTTPError as e:
        bad = tls_failure(e)
        if bad is not None:
            raise TLSError(explain(orchestrator, bad)) from None
        raise ValueError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        try:
            detail = response.json().get("detail", response.text[:200])
        except ValueError:
            detail = response.text[:200]
        raise ValueError(f"GET {url} answered {response.status_code}: {detail}")
    return response.json()


def watch(orchestrator: str, *, as_json: bool, steps: int, workers: int, every_s: float) -> None:
    """`swarmrl status`: print the dashboard once, or every `every_s` seconds until the run ends."""
    import json

    while True:
        doc = fetch(orchestrator)
        if as_json:
            print(json.dumps(doc, indent=1))
        else:
            render(doc, steps=steps, workers=workers)
        if every_s <= 0 or doc["run"]["finished"]:
            return
        time.sleep(every_s)
