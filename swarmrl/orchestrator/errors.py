"""What the orchestrator's parts share: the refusal type every rule raises, request bodies parsed
into it (strictly, protocol/messages.py parse_body), and the group states back-pressure counts
as queued."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from swarmrl.protocol.messages import BodyError, Request, parse_body

# Group states that will (most likely) become queued: back-pressure counts them as queued.
WAITING = ("queued", "pending", "validating")


class ApiError(Exception):
    """A refusal: reaches the client as {"error": code, "detail": message} with `status`."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


def describe_validation(exc: ValidationError | RequestValidationError, prefix: str | None = None) -> str:
    """The first few fields pydantic refused, each with its place (`body.groups.0.slot: ...`)."""
    parts = []
    for e in exc.errors()[:5]:
        where = ".".join(str(x) for x in ((prefix,) if prefix else ()) + tuple(e.get("loc", ())))
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def parsed(model: type[Request], raw: bytes) -> Request:
    """A request body as `model` (an empty body as {}), or 422 `invalid_request` naming the
    field, or the key sent twice."""
    try:
        return parse_body(model, raw or b"{}")
    except BodyError as e:
        raise ApiError(422, "invalid_request", f"body: {e}") from None
    except ValidationError as e:
        raise ApiError(422, "invalid_request", describe_validation(e, prefix="body")) from None


def body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI description of a body the route parses itself (json_body, or after the
    signature check)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def json_body(model: type[Request]) -> Callable[[HttpRequest], Awaitable[Request]]:
    """A FastAPI dependency: the request's body parsed by `parsed` (FastAPI's own body parsing
    lets a repeated key's last value win)."""

    async def dependency(request: HttpRequest) -> Request:
        return parsed(model, await request.body())

    return dependency
