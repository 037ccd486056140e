"""HTTP clients of the orchestrator: workers (signed requests), the trainer and validators (tokens).

Both separate failures worth retrying (`Unavailable`: connection refused or reset, timeouts,
5xx, 429) from refusals (`Refused`: any other 4xx, with the orchestrator's code and message),
because a worker must keep a finished group through an outage but drop it when it is refused.
"""

from __future__ import annotations

import json
import socket
import time
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from swarmrl.errors import SwarmrlError
from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.messages import (
    Batch,
    Claim,
    Finished,
    LeaseReply,
    Published,
    Recorded,
    Registered,
    Status,
    SubmitIn,
    SubmitReply,
    UploadReply,
    WorkerRecord,
    request_body,
)
from swarmrl.protocol.signing import WrongRun, public_key_hex, sign_headers
from swarmrl.protocol.tls import TLSError, explain, tls_failure

M = TypeVar("M", bound=BaseModel)


class Unavailable(SwarmrlError, RuntimeError):
    """The orchestrator could not be reached or asked us to come back later (`status`: the HTTP
    status it answered with, 429 or 5xx; None when it could not be reached)."""

    def __init__(self, message: str, retry_after: float | None = None, status: int | None = None):
        super().__init__(message)
        self.retry_after, self.status = retry_after, status


class Refused(SwarmrlError, RuntimeError):
    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class ProtocolMismatch(SwarmrlError, RuntimeError):
    """A reply that does not have the shape protocol/messages.py says: not something to retry."""


def _checked(model: type[BaseModel], reply: dict, what: str) -> dict:
    """The reply, after checking it has `model`'s shape (callers keep reading it as a dict)."""
    _parsed(model, reply, what)
    return reply


def _parsed(model: type[M], reply: dict, what: str) -> M:
    """The reply as `model` (ProtocolMismatch, naming the first field that differs, when it is not)."""
    try:
        return model.model_validate(reply)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "<reply>"
        raise ProtocolMismatch(
            f"the reply to {what} does not match swarmrl protocol v{PROTOCOL_VERSION} "
            f"({where}: {first.get('msg')}): run the same swarmrl version as the orchestrator "
            "(GET /v1/status says its protocol_version)"
        ) from None


def service_url(url: str, flag: str = "--orchestrator") -> str:
    """A service's base URL as the clients use it, or ValueError saying what is wrong with it.

    A URL without a scheme can never connect (httpx refuses it), so retrying it is pointless; a
    trailing /v1, the form `swarmrl serve` and `swarmrl eval` teach for OpenAI endpoints, is
    dropped because the clients add /v1/... themselves."""
    url = url.strip().rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"{flag} {url!r} has no scheme: write it as http://{url or 'HOST:PORT'} (or https://...)")
    if scheme.lower() not in ("http", "https"):
        raise ValueError(f"{flag} {url!r}: the scheme must be http or https, not {scheme!r}")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


class _Client:
    def __init__(self, url: str, timeout_s: float = 30.0, local_address: str | None = None):
        self.url = service_url(url)
        # TCP_NODELAY: a request goes out as headers then body; with Nagle's algorithm and the
        # server's delayed ACK every POST waited ~40 ms (measured: lease p50 48 ms -> see docs).
        # local_address: the source address to connect from (a machine with several).
        transport = httpx.HTTPTransport(
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)], local_address=local_address
        )
        self.http = httpx.Client(timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self.http.close()

    def _send(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> dict:
        try:
            r = self.http.request(method, self.url + path, content=body, headers=headers)
        except httpx.HTTPError as e:
            bad_tls = tls_failure(e)
            if bad_tls is not None:  # no retry fixes a certificate: say so and stop
                raise TLSError(explain(self.url, bad_tls)) from None
            raise Unavailable(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code == 429 or r.status_code >= 500:
            retry = r.headers.get("retry-after")
            raise Unavailable(
                f"{method} {path}: HTTP {r.status_code} {r.text[:200]}",
                retry_after=float(retry) if retry and retry.replace(".", "", 1).isdigit() else None,
                status=r.status_code,
            )
        try:
            data = r.json()
        except ValueError:
            raise Unavailable(f"{method} {path}: HTTP {r.status_code} with a non-JSON body") from None
        if r.status_code >= 400:
            raise Refused(r.status_code, str(data.get("error", "error")), str(data.get("detail", data)))
        return data

    def status(self) -> dict:
        return _checked(Status, self._send("GET", "/v1/status"), "GET /v1/status")


class WorkerClient(_Client):
    """Every mutating request is signed afresh (new timestamp and nonce), retries included, for
    the run this orchestrator serves. `run_id` pins the run: an orchestrator serving another run
    is refused here (WrongRun) instead of being sent signatures. Without it the run id is read
    from GET /v1/status on first use."""

    def __init__(
        self, url: str, key, timeout_s: float = 30.0, run_id: str | None = None, local_address: str | None = None
    ):
        super().__init__(url, timeout_s, local_address)
        self.key = key
        self.key_hex = public_key_hex(key)
        self.pinned = run_id
        self.run_id = run_id

    def run(self) -> str:
        """The run id requests are signed for (read from GET /v1/status once; checked if pinned)."""
        if self.run_id is None or self.pinned:
            served = str(self.status().get("run_id", ""))
            if self.pinned and served != self.pinned:
                raise WrongRun(
                    f"{self.url} serves run {served!r}, not the run {self.pinned} this worker was "
                    "started for: check the orchestrator URL"
                )
            self.run_id = served
            self.pinned = None  # checked once; the id is part of every signature from now on
        return self.run_id

    def _signed(self, path: str, payload: dict) -> dict:
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {"content-type": "application/json", **sign_headers(self.key, self.run(), "POST", path, body)}
        return self._send("POST", path, body, headers)

    def register(self, name: str) -> dict:
        return _checked(Registered, self._signed("/v1/workers/register", {"name": name}), "register")

    def lease(self, policy_version: int) -> dict:
        body = {"policy_version": policy_version, "protocol_version": PROTOCOL_VERSION}
        return _checked(LeaseReply, self._signed("/v1/leases", body), "lease")

    def submit(self, submission: SubmitIn | dict) -> dict:
        """POST /v1/rollouts: a submission built as `SubmitIn`, or its body (an outbox entry's)."""
        body = request_body(submission) if isinstance(submission, SubmitIn) else submission
        return _checked(SubmitReply, self._signed("/v1/rollouts", body), "submit")

    def upload(self, piece: dict) -> dict:
        """POST /v1/rollouts/upload: a piece of one group's JSON (UploadIn's fields)."""
        return _checked(UploadReply, self._signed("/v1/rollouts/upload", piece), "upload")

    def me(self) -> dict:
        return _checked(WorkerRecord, self._signed("/v1/workers/me", {}), "me")


class TrainerClient(_Client):
    def __init__(self, url: str, token: str, timeout_s: float = 60.0):
        super().__init__(url, timeout_s)
        self.auth = {"authorization": f"Bearer {token}", "content-type": "application/json"}

    def _post(self, path: str, payload: dict | None = None) -> dict:
        return self._send("POST", path, json.dumps(payload or {}).encode(), self.auth)

    def batch(self, step: int) -> Batch:
        """Batch `step`, frozen (`ready`, its groups as rollout records) or what it still lacks."""
        return _parsed(Batch, self._post(f"/v1/trainer/batches/{step}"), f"batch {step}")

    def publish(self, version: int, url: str, manifest: dict) -> dict:
        return _checked(
            Published,
            self._post("/v1/trainer/policies", {"version": version, "url": url, "manifest": manifest}),
            "publish",
        )

    def finish(self) -> dict:
        return _checked(Finished, self._post("/v1/trainer/finish"), "finish")

    def report(self, step: int, metrics: dict[str, float]) -> dict:
        """Figures for the dashboard (held-out accuracy after `step` steps)."""
        return _checked(Recorded, self._post("/v1/trainer/metrics", {"step": step, "metrics": metrics}), "metrics")


class ValidatorClient(TrainerClient):
    """A trusted validator (bearer token from <run-dir>/validator.token)."""

    def claim(self, max_groups: int) -> dict:
        return _checked(Claim, self._post("/v1/validator/claim", {"max_groups": max_groups}), "claim")

    def record(self, verdicts: list[dict], retry: list[int]) -> dict:
        return _checked(
            Recorded, self._post("/v1/validator/verdicts", {"verdicts": verdicts, "retry": retry}), "verdicts"
        )


SKEW_RETRIES = 3  # tries signed afresh after a clock_skew refusal before it is raised


def retrying(
    call, *, what: str, give_up_s: float, check=lambda: None, log=print, base_s: float = 0.2, max_s: float = 5.0
):
    """Run `call` until it succeeds, retrying on Unavailable with exponential backoff; raise after
    `give_up_s` seconds of continuous failure. `check` runs between tries (watchdogs)."""
    delay, start, said, skewed = base_s, time.monotonic(), None, 0
    while True:
        try:
            result = call()
            if said is not None:
                log(f"{what}: reached again after {time.monotonic() - start:.0f} s")
            return result
        except Refused as e:
            # A request signed in time can reach a stalled server's handler more than
            # max_clock_skew_s later (seen at a load average of 29 on 2 cores): signed afresh, the
            # next try is judged on its own clock. A clock that is really wrong fails every try,
            # and after SKEW_RETRIES the refusal is raised with its advice to check the clock.
            if e.code != "clock_skew" or skewed >= SKEW_RETRIES:
                raise
            skewed += 1
            log(f"{what}: {e.detail}; signing again (try {skewed} of {SKEW_RETRIES})")
            check()
            time.sleep(delay)
            delay = min(max_s, delay * 2)
        except Unavailable as e:
            waited = time.monotonic() - start
            if waited > give_up_s:
                raise Unavailable(f"{what}: orchestrator unreachable for {give_up_s:.0f} s; last error: {e}") from None
            # Said at once, then every 30 s while it lasts: an operator watching a worker's log
            # must see it is still trying, and until when.
            if said is None or time.monotonic() - said >= 30:
                log(f"{what}: {e}; retrying with backoff ({waited:.0f} s so far, giving up after {give_up_s:.0f} s)")
                said = time.monotonic()
            check()
            time.sleep(e.retry_after if e.retry_after else delay)
            delay = min(max_s, delay * 2)
