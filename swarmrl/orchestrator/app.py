"""The orchestrator's HTTP face (FastAPI). Thin: parse, authenticate, call `Orchestrator`.

Endpoints (all JSON; errors are {"error": code, "detail": message} with a 4xx status):

    GET  /healthz                     liveness
    GET  /metrics                     Prometheus text format
    GET  /v1/status                   step, newest policy version and where to get it, async bound
    POST /v1/workers/register         signed by the worker key: join the run
    POST /v1/leases                   signed: get problems to sample (or "no work now, retry")
    POST /v1/rollouts                 signed: submit the groups of a lease (with TOPLOC proofs)
    POST /v1/rollouts/upload          signed: one group too large for a request, in pieces
    POST /v1/workers/me               signed: this key's record (accepted, rejections by reason, ban)
    POST /v1/validator/claim          validator (bearer token): groups to check, with their policies
    POST /v1/validator/verdicts       validator: the verdicts on claimed groups
    POST /v1/trainer/batches/{step}   trainer (bearer token): batch `step`, built on first ask
    POST /v1/trainer/policies         trainer: a new policy version is available at a URL
    POST /v1/trainer/finish           trainer: the run is over, workers may leave

Nothing a client sends may produce a 5xx: bodies are size-capped before parsing, parsed strictly
(a key sent twice, or a field in another JSON type, is refused: protocol/messages.py parse_body),
validated by pydantic with explicit limits, and every refusal is an ApiError with a code the
client can act on.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import traceback
from typing import Annotated

from fastapi import Depends, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from swarmrl.orchestrator.dashboard import add_dashboard_routes
from swarmrl.orchestrator.errors import ApiError, body_schema, describe_validation, json_body, parsed
from swarmrl.orchestrator.service import Orchestrator
from swarmrl.protocol.manifest import BroadcastError, verify_manifest
from swarmrl.protocol.messages import (
    Batch,
    Claim,
    ClaimIn,
    ErrorOut,
    Finished,
    LeaseIn,
    LeaseReply,
    Published,
    PublishIn,
    Recorded,
    Registered,
    RegisterIn,
    Status,
    SubmitIn,
    SubmitReply,
    UploadIn,
    UploadReply,
    VerdictsIn,
    WorkerRecord,
)
from swarmrl.protocol.signing import AuthError, ClockSkew, WrongRun, verify_request
from swarmrl.transport.connlimit import source_of


class SizeLimit:
    """Refuse bodies over the limit, or slower than the time limit, before the app parses them.
    Pure ASGI, so it also covers a chunked upload with no Content-Length: the body is counted as
    it arrives, cut off at the limit (or when `timeout_s` has passed since the request began), and
    whatever the app answers to the truncated body is replaced by the 413 (or 408)."""

    def __init__(self, app: FastAPI, max_bytes: int, timeout_s: float = 30.0):
        self.app, self.fastapi, self.max_bytes, self.timeout_s = app, app, max_bytes, timeout_s

    def _too_big(self) -> JSONResponse:
        return _error(413, "too_large", f"request body over {self.max_bytes} bytes; split it into smaller requests")

    def _too_slow(self) -> JSONResponse:
        return _error(
            408, "too_slow", f"the request body did not arrive within {self.timeout_s:.0f} s; send it at once"
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                return await _error(400, "bad_request", "invalid Content-Length header")(scope, receive, send)
            if declared > self.max_bytes:
                return await self._too_big()(scope, receive, send)
        seen, refusal, done = 0, None, False
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        truncated = {"type": "http.request", "body": b"", "more_body": False}

        async def counted():
            nonlocal seen, refusal, done
            if done or refusal is not None:
                return await receive()  # the body is complete: waiting for a disconnect is fine
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                refusal = self._too_slow()
                return truncated
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    refusal = self._too_big()
                    return truncated
            return message

        async def guarded_send(message):
            if refusal is None:
                return await send(message)
            if message["type"] == "http.response.start":
                await refusal(scope, receive, send)

        await self.app(scope, counted, guarded_send)


def _error(status: int, code: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def _observe(app: FastAPI, orch: Orchestrator) -> None:
    """Prometheus metrics: request counts and latency per route, and the run's totals and gauges
    at GET /metrics."""
    registry = CollectorRegistry()
    requests = Counter("swarmrl_requests", "HTTP requests", ["endpoint", "status"], registry=registry)
    latency = Histogram(
        "swarmrl_request_seconds",
        "Request latency",
        ["endpoint"],
        registry=registry,
        buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10),
    )
    totals = Gauge("swarmrl_total", "Totals since this orchestrator process started", ["what"], registry=registry)
    state = Gauge("swarmrl_state", "Run state (step, versions, group counts)", ["what"], registry=registry)

    @app.middleware("http")
    async def observe(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        requests.labels(endpoint, str(response.status_code)).inc()
        latency.labels(endpoint).observe(time.perf_counter() - t0)
        return response

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        for name, value in orch.totals().items():
            totals.labels(name).set(value)
        for name, value in orch.gauges().items():
            state.labels(name).set(value)
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _error_handlers(app: FastAPI, orch: Orchestrator) -> None:
    """Every refusal as {"error", "detail"} with a 4xx; a bug of ours as a 500 without a traceback."""

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        headers = {"Retry-After": f"{max(1, round(exc.retry_after))}"} if exc.retry_after else None
        return _error(exc.status, exc.code, exc.message, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return _error(422, "invalid_request", describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def crash(_request, exc: Exception):
        # A bug, never the client's fault: log it here, never send the traceback out.
        orch.log("orchestrator: internal error\n" + "".join(traceback.format_exception(exc)))
        return _error(500, "internal", "internal error; it has been logged on the orchestrator")


def create_app(orch: Orchestrator) -> SizeLimit:
    """The ASGI app (size limit around FastAPI; the FastAPI object is `.fastapi`)."""
    app = FastAPI(
        title="swarmrl orchestrator",
        version="1",
        description="Leases, rollouts and batches for asynchronous GRPO with untrusted workers.",
    )
    _observe(app, orch)
    _error_handlers(app, orch)
    responses = {
        400: {"model": ErrorOut},
        401: {"model": ErrorOut},
        403: {"model": ErrorOut},
        404: {"model": ErrorOut},
        409: {"model": ErrorOut},
        410: {"model": ErrorOut},
        413: {"model": ErrorOut},
        422: {"model": ErrorOut},
        429: {"model": ErrorOut},
    }

    def signed(model: type[BaseModel] | None = None):
        """A dependency: the request's signer (key, auth) and, once the signature checked out,
        its body parsed as `model`. Cheapest first: the source's request rate, the run and
        signature (one ed25519 check on the raw bytes), and only then JSON parsing."""

        async def dependency(request: Request) -> tuple[str, dict, BaseModel | None]:
            source = source_of(request.client.host if request.client else None)
            orch.admit_source(source)
            body = await request.body()
            try:
                key, nonce, ts = verify_request(
                    {k.lower(): v for k, v in request.headers.items()},
                    request.method,
                    request.url.path,
                    body,
                    run_id=orch.run_id,
                    max_skew_s=orch.cfg.orchestrator.max_clock_skew_s,
                )
            except WrongRun as e:
                raise ApiError(401, "wrong_run", str(e)) from None
            except ClockSkew as e:
                raise ApiError(401, "clock_skew", str(e)) from None
            except AuthError as e:
                raise ApiError(401, "bad_signature", str(e)) from None
            return key, {"nonce": nonce, "ts": ts, "source": source}, None if model is None else parsed(model, body)

        return dependency

    def trainer_only(request: Request) -> None:
        header = request.headers.get("authorization", "")
        if not (header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), orch.trainer_token.encode())):
            raise ApiError(401, "not_trainer", "this endpoint needs the trainer's bearer token")

    def validator_only(request: Request) -> None:
        header = request.headers.get("authorization", "")
        token = orch.validator_token
        if not (token and header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), token.encode())):
            raise ApiError(
                401, "not_validator", "this endpoint needs the validator's bearer token (<run-dir>/validator.token)"
            )

    @app.get("/healthz")
    async def healthz() -> dict:
        # On the event loop, not in the thread pool: it answers while every thread is busy.
        return {"ok": True}

    @app.get("/v1/status", response_model=Status)
    def status() -> dict:
        return orch.status()

    @app.post(
        "/v1/workers/register", responses=responses, response_model=Registered, openapi_extra=body_schema(RegisterIn)
    )
    def register(who: tuple = Depends(signed(RegisterIn))) -> dict:
        key, auth, body = who
        orch.admit_registration(key, auth["source"])
        orch.authenticate(key, auth["nonce"], auth["ts"], registering=True)
        return orch.register(key, body.name)

    @app.post("/v1/leases", responses=responses, response_model=LeaseReply, openapi_extra=body_schema(LeaseIn))
    def lease(who: tuple = Depends(signed(LeaseIn))) -> dict:
        key, auth, body = who
        orch.check_lease_refusal(key)
        orch.authenticate(key, auth["nonce"], auth["ts"])
        return orch.lease(key, body.policy_version, auth["source"], body.protocol_version)

    @app.post(
        "/v1/rollouts",
        responses=responses,
        response_model=SubmitReply,
        response_model_exclude_none=True,
        openapi_extra=body_schema(SubmitIn),
    )
    def rollouts(who: tuple = Depends(signed(SubmitIn))) -> dict:
        key, auth, body = who
        orch.authenticate(key, auth["nonce"], auth["ts"])
        return orch.submit(key, body.lease_id, body.groups)

    @app.post(
        "/v1/rollouts/upload",
        responses=responses,
        response_model=UploadReply,
        response_model_exclude_none=True,
        openapi_extra=body_schema(UploadIn),
    )
    def upload(who: tuple = Depends(signed(UploadIn))) -> dict:
        key, auth, body = who
        orch.authenticate(key, auth["nonce"], auth["ts"])
        return orch.upload(key, auth["source"], body)

    @app.post("/v1/workers/me", responses=responses, response_model=WorkerRecord)
    def me(who: tuple = Depends(signed())) -> dict:
        key, auth, _ = who
        orch.authenticate(key, auth["nonce"], auth["ts"], allow_banned=True)
        return orch.worker_record(key)

    @app.post(
        "/v1/validator/claim",
        responses=responses,
        response_model=Claim,
        dependencies=[Depends(validator_only)],
        openapi_extra=body_schema(ClaimIn),
    )
    def claim(body: Annotated[ClaimIn, Depends(json_body(ClaimIn))]) -> dict:
        return orch.claim_validation(body.max_groups)

    @app.post(
        "/v1/validator/verdicts",
        responses=responses,
        response_model=Recorded,
        dependencies=[Depends(validator_only)],
        openapi_extra=body_schema(VerdictsIn),
    )
    def verdicts(body: Annotated[VerdictsIn, Depends(json_body(VerdictsIn))]) -> dict:
        return orch.record_verdicts([v.model_dump() for v in body.verdicts], body.retry)

    @app.post(
        "/v1/trainer/batches/{step}",
        responses=responses,
        response_model=Batch,
        response_model_exclude_none=True,
        dependencies=[Depends(trainer_only)],
    )
    def batch(step: int = Path(ge=0, le=10**9)) -> dict:
        return orch.build_batch(step)

    @app.post(
        "/v1/trainer/policies",
        responses=responses,
        response_model=Published,
        dependencies=[Depends(trainer_only)],
        openapi_extra=body_schema(PublishIn),
    )
    def publish(body: Annotated[PublishIn, Depends(json_body(PublishIn))]) -> dict:
        try:
            # Signed by the trainer's key (<run-dir>/trainer.pub once the trainer wrote it; before
            # that, by the key the manifest names: the bearer token already says who sent it).
            key = orch.trainer_public_key() or str(body.manifest.get("public_key", ""))
            verify_manifest(body.manifest, key, version=body.version)
        except BroadcastError as e:
            raise ApiError(422, "bad_manifest", str(e)) from None
        return orch.publish(body.version, body.url, body.manifest)

    @app.post("/v1/trainer/finish", responses=responses, response_model=Finished, dependencies=[Depends(trainer_only)])
    def finish() -> dict:
        return orch.finish()

    add_dashboard_routes(app, orch, responses, trainer_only)
    return SizeLimit(app, orch.cfg.orchestrator.max_request_bytes, orch.cfg.orchestrator.body_timeout_s)
