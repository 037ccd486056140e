"""What the orchestrator's parts share: the refusal type every rule raises, and the group states
back-pressure counts as queued."""

from __future__ import annotations

# Group states that will (most likely) become queued: back-pressure counts them as queued.
WAITING = ("queued", "pending", "validating")


class ApiError(Exception):
    """A refusal: reaches the client as {"error": code, "detail": message} with `status`."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after
