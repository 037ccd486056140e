"""What a client may cost `swarmrl serve`, and how it is told no: errors in OpenAI's shape
(never a traceback), the bound on the completions each client address may have queued or
generating (`Queued`, 429 with Retry-After), and noticing that a client has left (`client_gone`),
so that its request is dropped or stopped rather than generated for nobody
(docs/security.md, "`swarmrl serve` under a disconnecting flood")."""

from __future__ import annotations

import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swarmrl.serve.engine import GenRequest
from swarmrl.transport.connlimit import source_of


class OpenAIError(Exception):
    """An answer for the client: OpenAI's error JSON with this 4xx status (and headers, such as a
    429's Retry-After). Not the orchestrator's `ApiError`, whose body is swarmrl's {error, detail}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client closed its connection before its answer was ready (nobody reads the reply)."""


class Queued:
    """The completions each client address has queued or generating, and all together, bounded so
    that no address can queue more work than the server does in a while: past a bound the request
    gets a 429 before anything of it runs. A source is an address as the connection limits count
    it (`transport.connlimit.source_of`: an IPv4 address, an IPv6 /64). Thread-safe: a slot is
    given back from the engine thread when the request's future ends."""

    # Rows free at every token step, so some of an address's work has usually ended a second
    # later; a longer wait would leave the server idle when the client is an honest batch job.
    RETRY_AFTER_S = 1

    def __init__(self, per_client: int, total: int):
        self.per_client, self.total = per_client, total
        self.held: dict[str, int] = {}
        self.all = 0
        self._lock = threading.Lock()

    def take(self, source: str, units: int) -> None:
        """Count `units` completions against `source`, or raise the 429 that says which bound."""
        with self._lock:
            mine = self.held.get(source, 0)
            if mine + units > self.per_client:
                raise OpenAIError(
                    429,
                    f"your address has {mine} completions queued or generating and this request asks for "
                    f"{units}; this server allows {self.per_client} per client address "
                    "(--max-queued-per-client). Wait for some of your requests to finish, then retry "
                    "(Retry-After), or send fewer at once",
                    kind="rate_limit_error",
                    code="queue_full_per_client",
                    headers={"Retry-After": str(self.RETRY_AFTER_S)},
                )
            if self.all + units > self.total:
                raise OpenAIError(
                    429,
                    f"the server has {self.all} completions queued or generating, all clients together, of the "
                    f"{self.total} it queues (--max-queued-total); retry after Retry-After seconds",
                    kind="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(self.RETRY_AFTER_S)},
                )
            self.held[source] = mine + units
            self.all += units

    def admit(self, http: Request, request: GenRequest) -> None:
        """Count the request's completions against its client's address (429 past a bound). They
        are given back when the engine is done with it (finished, failed, or dropped or stopped
        after a disconnect), from whichever thread ends its future."""
        source = source_of(http.client.host if http.client else None)
        request.client = source  # the engine takes waiting requests round-robin by address
        self.take(source, request.n)
        request.future.add_done_callback(lambda _f: self.give_back(source, request.n))

    def give_back(self, source: str, units: int) -> None:
        with self._lock:
            left = self.held.get(source, 0) - units
            if left > 0:
                self.held[source] = left
            else:
                self.held.pop(source, None)
            self.all -= units


async def client_gone(request: Request) -> None:
    """Return once the client has closed its connection. Called after the body was read, when
    the server's receive() has nothing left to give but the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; a bug of ours as a 500 without a traceback."""

    @app.exception_handler(OpenAIError)
    async def _api_error(_request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone_error(_request: Request, _exc: ClientGone):  # written to nobody
        return OpenAIError(
            400, "the client closed the connection before the answer was ready", code="client_gone"
        ).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        return OpenAIError(
            exc.status_code,
            str(exc.detail),
            kind="not_found_error" if exc.status_code == 404 else "invalid_request_error",
        ).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        return OpenAIError(400, f"invalid request: {exc.errors()[0].get('msg', 'bad value')}").response()

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):  # a bug of ours: no traceback to the client
        return OpenAIError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()
