"""What one source address may hold of a listening service: connections, and time before its
request head is complete.

Sockets cost an attacker nothing. Without these bounds one machine holding 1000 idle TCP
connections took every slot of the orchestrator (503 for everyone, `/healthz` included), and a
connection sending its header one byte a second was never cut (issue 34). Every service that
listens (the orchestrator and its dashboard, `swarmrl serve`, the weight origin and the relays)
applies the same two rules:

  * `SourceSlots`: at most `per_source` open connections per source, `total` in all, and the last
    `reserve` of those only for sources holding fewer than `share`: a source at its cap, or a few
    sources together, cannot take the room a new source needs. A source is an IPv4 address, or an
    IPv6 /64 (one host is handed a whole /64, so single IPv6 addresses cost nothing).
  * a request head (request line and headers) must arrive within `head_timeout_s` of the
    connection opening or of the first byte after the previous response; an idle keep-alive
    connection is closed after `idle_timeout_s`.

Everything behind one address counts as one source: a run behind a reverse proxy or a large NAT
must raise `per_source` (docs/security.md). Many addresses (a botnet, many cloud hosts) are the
network's job: these bounds make one machine harmless, not a million.

`guarded_h11(...)` is the uvicorn protocol class (h11) with both rules; the shard server
(transport/broadcast/origin.py) applies `SourceSlots` in its accept loop.
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass, field


def source_of(host: str | None) -> str:
    """The source a connection's peer address counts against: the IPv4 address (also when written
    as IPv4-mapped IPv6), or the IPv6 /64 prefix. Anything unparseable is its own string."""
    if not host:
        return "unknown"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass
class SourceSlots:
    """Open connections per source, under the rules of the module doc. Thread-safe: the shard
    server admits in its accept thread and releases in connection threads."""

    total: int = 1000
    """Connections open at once, all sources together."""
    per_source: int = 64
    """Connections one source may hold."""
    reserve: int = 0
    """The last `reserve` of `total` go only to sources holding fewer than `share`."""
    share: int = 4
    """What a source may hold and still take reserved room."""
    open: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # reason -> count, for /metrics and tests

    def __post_init__(self):
        for name in ("total", "per_source", "share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"connection limit {name} must be a positive int, got {value!r}")
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, int) or not 0 <= self.reserve < self.total:
            raise ValueError(f"connection reserve must be an int in [0, total), got {self.reserve!r}")
        self._lock = threading.Lock()
        self._count = 0

    @classmethod
    def sized(cls, total: int, per_source: int) -> SourceSlots:
        """The defaults every service uses: a quarter of `total` kept for sources holding under a
        quarter of their own cap (at least 2 connections each)."""
        return cls(total=total, per_source=per_source, reserve=total // 4, share=max(2, per_source // 4))

    @property
    def count(self) -> int:
        return self._count

    def admit(self, source: str) -> str | None:
        """Take a slot for `source`; None if taken, else why not (and nothing is taken)."""
        with self._lock:
            held = self.open.get(source, 0)
            if held >= self.per_source:
                why = "per_source"
            elif self._count >= self.total:
                why = "total"
            elif self._count >= self.total - self.reserve and held >= self.share:
                why = "reserve"
            else:
                self.open[source] = held + 1
                self._count += 1
                return None
            self.refused[why] = self.refused.get(why, 0) + 1
            return why

    def release(self, source: str) -> None:
        with self._lock:
            held = self.open.get(source, 0)
            if held <= 0:
                return  # never admitted (or released twice): nothing to give back
            if held == 1:
                del self.open[source]
            else:
                self.open[source] = held - 1
            self._count -= 1


_REFUSALS = {
    "per_source": "too many connections from your address: close idle ones, or reuse one (keep-alive)",
    "total": "the server is at its connection limit: try again shortly",
    "reserve": "the server is near its connection limit and your address holds several: reuse those",
}


def refusal_response(why: str, *, retry_after_s: int = 1) -> bytes:
    """The raw HTTP/1.1 503 a refused connection gets before it is closed (nothing was read)."""
    body = (_REFUSALS.get(why, "connection refused") + "\n").encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {retry_after_s}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


_SLOW_BODY = b"your request's line and headers did not arrive in time\n"
SLOW_HEAD_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_SLOW_BODY)
) + _SLOW_BODY


def guarded_h11(slots: SourceSlots, *, head_timeout_s: float, idle_timeout_s: float):
    """uvicorn's h11 protocol class with `slots` and the head timeout (module doc). Pass it as
    `uvicorn.Config(http=...)` with `timeout_keep_alive=idle_timeout_s` (uvicorn's own idle timer
    runs between requests; this adds the one before the first request, and the head timer) and
    `limit_concurrency=None` (`slots.total` bounds connections instead, so uvicorn's own 503, which
    punishes every source alike, never fires first)."""
    if not (head_timeout_s > 0 and idle_timeout_s > 0):
        raise ValueError(f"head and idle timeouts must be positive seconds, got {head_timeout_s!r}, {idle_timeout_s!r}")
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _source: str | None = None  # set once admitted; released when the connection is lost
        _head_timer = None
        _refused = False

        def connection_made(self, transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            source = source_of(peer[0] if isinstance(peer, (tuple, list)) and peer else None)
            why = slots.admit(source)
            if why is not None:
                self._refused = True
                try:
                    transport.write(refusal_response(why))
                finally:
                    transport.close()
                return
            self._source = source
            super().connection_made(transport)
            self._arm_head_timer()  # nothing yet: the first request's head must come in time

        def connection_lost(self, exc) -> None:
            if self._refused:
                return  # nothing was set up
            self._cancel_head_timer()
            if self._source is not None:
                slots.release(self._source)
                self._source = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            if self._head_timer is None and (before is None or before.response_complete):
                self._arm_head_timer()  # the first byte of a keep-alive connection's next request
            super().data_received(data)
            if self.cycle is not before:
                self._cancel_head_timer()  # the head is in; a slow body is the app's to cut

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is not None and not self.cycle.response_complete:
                self._cancel_head_timer()  # a pipelined request's head was already buffered

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport is None or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served: not a slow head
            self.transport.write(SLOW_HEAD_RESPONSE)
            self.transport.close()

    return GuardedH11Protocol
