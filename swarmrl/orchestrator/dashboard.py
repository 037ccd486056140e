"""What anyone may see of a run: progress, the swarm, validation and broadcast, as one JSON
document (GET /v1/dashboard), drawn by the page at GET / (static/: plain DOM and SVG, polling
every 2 s) and printed as tables by `swarmrl status`.

Public by design, so it carries nothing secret: worker keys are public already and shown as
fingerprints (their first 16 hex digits), names are what workers chose to call themselves, and
no token, file path or configuration beyond the run's public settings appears. It is assembled
from the orchestrator's store at most once per `cache_s` (a crowd of viewers costs one set of
queries per interval, not one per viewer) and can be turned off (`orchestrator.dashboard`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Response

from swarmrl.orchestrator import retention
from swarmrl.orchestrator.errors import ApiError, body_schema, json_body
from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.messages import Dashboard, MetricsIn, Recorded

# Batch metrics worth charting (computed by the orchestrator for every batch it hands out).
PROGRESS_KEYS = (
    "reward/mean",
    "reward/task_mean_all",
    "length/mean",
    "length/max",
    "length/truncated_frac",
    "length/target_mean",
    "length/abs_error_mean",
    "off_policy/mean",
    "off_policy/max",
    "batch/generated_tokens",
    "time/generation",
    "eval/accuracy",
    # Multi-turn episodes (docs/environments.md): absent from single-turn runs.
    "episode/turns_mean",
    "episode/tool_calls_mean",
    "episode/tool_errors",
    "episode/observation_token_share",
)
STATIC = Path(__file__).parent / "static"  # the page: dashboard.html, .js, .css (no third-party code)
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
MAX_STEPS = 1000  # the newest steps in `progress` (a long run's chart is thinned by the page, not here)
MAX_WORKERS = 500  # leaderboard rows


def fingerprint(key: str) -> str:
    return key[:16]


def build(orch, *, now: float | None = None) -> dict:
    """The dashboard document for orchestrator `orch` (service.Orchestrator)."""
    now = time.time() if now is None else now
    cfg = orch.cfg
    store = orch.store
    with store.read() as db:
        next_step, latest, finished = store.progress(db)
        batches = db.execute(
            "SELECT step, metrics, created FROM batches ORDER BY step DESC LIMIT ?", (MAX_STEPS,)
        ).fetchall()
        workers = db.execute(
            "SELECT key, name, registered, last_seen, accepted, rejected, fraud, banned, validated FROM workers "
            "ORDER BY accepted DESC, registered LIMIT ?",
            (MAX_WORKERS,),
        ).fetchall()
        n_workers = db.execute("SELECT COUNT(*) FROM workers").fetchone()[0]
        by_worker: dict[str, dict[str, int]] = {}
        for key, reason, count in db.execute("SELECT worker, reason, COUNT(*) FROM rejections GROUP BY worker, reason"):
            by_worker.setdefault(key, {})[reason] = count
        states = store.group_state_counts(db)
        reasons = store.rejection_counts(db)
        policies = db.execute(
            "SELECT version, manifest, published FROM policies ORDER BY version DESC LIMIT 20"
        ).fetchall()
        trainer_metrics = store.get_meta(db, "trainer_metrics", {})
        evidence = store.evidence(db)
        footprint = retention.footprint(store, db)
    # One point per step as metrics.jsonl counts them: batch n's figures at step n + 1 (the
    # version trained on it), the trainer's held-out figures at the version they evaluated (0:
    # before any training).
    points: dict[int, dict] = {}
    for row in batches:
        metrics = json.loads(row["metrics"])
        point = points.setdefault(row["step"] + 1, {"step": row["step"] + 1, "time": row["created"]})
        point.update({k: float(metrics[k]) for k in PROGRESS_KEYS if isinstance(metrics.get(k), (int, float))})
    oldest = min(points, default=0)
    for step, extra in trainer_metrics.items():
        if int(step) >= oldest - 1:
            point = points.setdefault(int(step), {"step": int(step)})
            point.update({k: float(v) for k, v in extra.items() if k in PROGRESS_KEYS})
    progress = [points[k] for k in sorted(points)]
    versions = []
    for row in policies:
        manifest = json.loads(row["manifest"])
        size = manifest.get("total_size")
        versions.append(
            {
                "version": row["version"],
                "published": row["published"],
                "bytes": int(size) if isinstance(size, int) else None,
                # a LoRA version names the base it applies to (trainer.lora)
                "adapter": "base" in manifest,
            }
        )
    swarm = []
    for w in workers:
        swarm.append(
            {
                "fingerprint": fingerprint(w["key"]),
                "name": w["name"],
                "accepted": w["accepted"],
                "validated": w["validated"],
                "rejected": w["rejected"],
                "fraud": w["fraud"],
                "banned": bool(w["banned"]),
                "trusted": orch.is_trusted(w["key"]),
                "rejections": by_worker.get(w["key"], {}),
                # The sequential test per engine and statistic (calibrated runs): score against its bound.
                "evidence": [
                    {**e, "bound": orch.validation.bound(e["engine"], e["test"])} for e in evidence.get(w["key"], [])
                ],
                "last_seen_s": max(0.0, now - w["last_seen"]),
                "registered": w["registered"],
            }
        )
    return {
        "run": {
            "run_id": orch.run_id,
            "next_step": next_step,
            "total_steps": cfg.trainer.steps,
            "latest_version": latest,
            "finished": bool(finished),
            "async_bound": cfg.async_.bound,
            "group_size": cfg.sampling.group_size,
            "prompts_per_step": cfg.sampling.prompts_per_step,
            "protocol_version": PROTOCOL_VERSION,
            "time": now,
        },
        "progress": progress,
        "workers": swarm,
        "workers_total": n_workers,
        "validation": {
            "groups": {
                s: int(states.get(s, 0))
                for s in ("pending", "validating", "queued", "consumed", "uninformative", "stale", "rejected")
            },
            "rejections": reasons,
            "mode": cfg.validator.mode,
            # Per engine: does the run's passed work still look like the calibration's honest work?
            "drift": orch.validation.drift_report(),
            # The limits file judged by now: measured on which version, dtype and CPU kind.
            "limits": orch.validation.limits_summary(),
        },
        "broadcast": {"versions": versions},
        "store": footprint,
    }


class Cached:
    """`build(orch)` at most once per `ttl_s`; concurrent viewers share one build."""

    def __init__(self, orch, ttl_s: float = 2.0):
        self.orch, self.ttl_s = orch, ttl_s
        self._lock = threading.Lock()
        self._at, self._doc = 0.0, None

    def get(self) -> dict:
        with self._lock:
            if self._doc is None or time.monotonic() - self._at > self.ttl_s:
                self._doc = build(self.orch)
                self._at = time.monotonic()
            return self._doc


def record_trainer_metrics(orch, step: int, metrics: dict[str, float]) -> int:
    """Keep the trainer's figures for `step` (only the charted keys; the newest MAX_STEPS steps)."""
    kept = {k: float(v) for k, v in metrics.items() if k in PROGRESS_KEYS}
    if not kept:
        return 0
    with orch.store.tx() as db:
        held = orch.store.get_meta(db, "trainer_metrics", {})
        held.setdefault(str(step), {}).update(kept)
        for old in sorted(held, key=int)[:-MAX_STEPS]:
            del held[old]
        orch.store.set_meta(db, "trainer_metrics", held)
    return 1


def add_dashboard_routes(app, orch, responses: dict, trainer_only) -> None:
    """GET /v1/dashboard on the orchestrator's app (404 when `orchestrator.dashboard` is off), and
    POST /v1/trainer/metrics, where the trainer reports held-out accuracy for it."""
    board = Cached(orch, orch.cfg.orchestrator.dashboard_cache_s)

    @app.post(
        "/v1/trainer/metrics",
        responses=responses,
        response_model=Recorded,
        dependencies=[Depends(trainer_only)],
        openapi_extra=body_schema(MetricsIn),
    )
    def trainer_metrics(body: Annotated[MetricsIn, Depends(json_body(MetricsIn))]) -> dict:
        return {"recorded": record_trainer_metrics(orch, body.step, body.metrics)}

    def page(name: str, media_type: str) -> Response:
        if not orch.cfg.orchestrator.dashboard:
            raise ApiError(404, "dashboard_off", "this orchestrator's dashboard is turned off (orchestrator.dashboard)")
        # Only this folder's own files: no inline script, nothing from another origin.
        return Response((STATIC / name).read_bytes(), media_type=media_type, headers=_PAGE_HEADERS)

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        return page("dashboard.html", "text/html; charset=utf-8")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:  # browsers ask for one; answering 204 keeps their consoles clean
        return Response(status_code=204)

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    def script() -> Response:
        return page("dashboard.js", "text/javascript; charset=utf-8")

    @app.get("/dashboard/dashboard.css", include_in_schema=False)
    def style() -> Response:
        return page("dashboard.css", "text/css; charset=utf-8")

    @app.get("/v1/dashboard", response_model=Dashboard, responses=responses)
    def dashboard() -> dict:
        if not orch.cfg.orchestrator.dashboard:
            raise ApiError(404, "dashboard_off", "this orchestrator's dashboard is turned off (orchestrator.dashboard)")
        return board.get()
