"""Serving a broadcast root over HTTP (`ShardServer`): read-only GET/HEAD of the version list,
manifests and shards, with Range requests, for the trainer (the origin) and every relay.

Anyone who can reach the port is a client, so what one client can hold is bounded: at most
`max_connections` connections are served at once (one thread each), at most
`max_connections_per_source` from one address, and the last quarter of them only for addresses
holding few (transport/connlimit.py); a connection over a bound gets a 503 at once and is closed.
A connection that sends nothing, or trickles its request byte by byte, is closed after
`client_timeout_s` (slowloris), as is one that stops reading.
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from swarmrl.protocol.manifest import BroadcastError, version_name
from swarmrl.transport.broadcast.common import CHUNK, PATH_MANIFEST, PATH_PATCH, PATH_SHARD, RANGE
from swarmrl.transport.broadcast.publish import read_versions
from swarmrl.transport.connlimit import SourceSlots, refusal_response, source_of

log = logging.getLogger(__name__)


# ---- server -------------------------------------------------------------------------------------


class ShardRequestHandler(BaseHTTPRequestHandler):
    """Read-only GET/HEAD of /versions, /vNNNNNN/manifest.json and /vNNNNNN/shards/NNNNN.
    Subclass and set `ShardServer.handler_class` to inject faults in tests."""

    server: _Server

    def setup(self):
        # Every socket read or write waits at most this long (a stalled client), and a request's
        # line and headers must arrive within it in all (a trickling one): see _DeadlineReader.
        self.timeout = self.server.owner.client_timeout_s
        super().setup()
        self._deadline = time.monotonic() + self.timeout
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle_one_request(self):
        self._deadline = time.monotonic() + self.timeout  # also bounds the idle time between keep-alive requests
        super().handle_one_request()

    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        pass  # one line per request to stderr is noise: clients fetch many shards

    def do_GET(self):
        self._serve(send_body=True)

    def do_HEAD(self):
        self._serve(send_body=False)

    def _send_small(self, code: int, body: bytes, ctype: str, send_body: bool, extra: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _not_found(self, send_body: bool) -> None:
        self._send_small(404, b"not found\n", "text/plain; charset=utf-8", send_body)

    def _serve(self, send_body: bool) -> None:
        try:
            path = self.path
            if path == "/versions":
                incoming = self.server.owner.incoming()
                listing: dict = {"versions": read_versions(self.server.root), "incoming": sorted(incoming)}
                if isinstance(incoming, Mapping):  # a relay: how much of each it holds so far
                    listing["progress"] = {str(v): int(n) for v, n in sorted(incoming.items())}
                body = json.dumps(listing).encode()
                return self._send_small(200, body, "application/json", send_body)
            if m := PATH_MANIFEST.fullmatch(path):
                v = int(m.group(1))
                return self._send_file(v, self.server.root / version_name(v) / "manifest.json", send_body)
            if m := PATH_SHARD.fullmatch(path):
                v = int(m.group(1))
                return self._send_file(v, self.server.root / version_name(v) / "shards" / m.group(2), send_body)
            if m := PATH_PATCH.fullmatch(path):
                v = int(m.group(1))
                return self._send_file(v, self.server.root / version_name(v) / m.group(2), send_body)
            return self._not_found(send_body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; it will retry elsewhere

    def _range(self, size: int):
        """None: whole file; (start, end) inclusive; or "unsatisfiable"."""
        header = self.headers.get("Range")
        if header is None:
            return None
        m = RANGE.fullmatch(header.strip())
        if m is None or m.group(1) == m.group(2) == "":
            return None  # other units, several ranges, nonsense: ignored, as RFC 9110 allows
        a, b = m.groups()
        if a == "":  # bytes=-n: the last n bytes
            n = int(b)
            return "unsatisfiable" if n == 0 or size == 0 else (max(0, size - n), size - 1)
        start = int(a)
        if b and int(b) < start:
            return None  # syntactically invalid: must be ignored
        end = int(b) if b else size - 1
        if start >= size:
            return "unsatisfiable"
        return start, min(end, size - 1)

    def _send_file(self, version: int, path: Path, send_body: bool) -> None:
        try:
            f = open(path, "rb")
        except OSError:  # absent, or pruned between the listing and now
            return self._not_found(send_body)
        # Counted from the open on: a version pruned after this point is unlinked, but the open
        # file stays readable until this response is done.
        tracker = self.server.owner
        tracker._begin(version)
        try:
            with f:
                size = os.fstat(f.fileno()).st_size
                rng = self._range(size)
                if rng == "unsatisfiable":
                    return self._send_small(
                        416,
                        b"range not satisfiable\n",
                        "text/plain; charset=utf-8",
                        send_body,
                        {"Content-Range": f"bytes */{size}", "Accept-Ranges": "bytes"},
                    )
                start, end = rng if rng else (0, size - 1)
                length = end - start + 1
                self.send_response(206 if rng else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if send_body and length > 0:
                    f.seek(start)
                    self.write_body(f, length)
        finally:
            tracker._end(version)

    def write_body(self, f, length: int) -> None:
        """Stream `length` bytes of `f` (positioned) to the client, paced by the server's rate cap."""
        owner = self.server.owner
        rate = owner.max_bytes_per_s
        step = CHUNK if not rate else max(1, min(CHUNK, int(rate) // 20))
        sent = 0
        while sent < length:
            chunk = f.read(min(step, length - sent))
            if not chunk:
                break  # the file shrank under us: the client sees a short body and retries
            if rate:
                wait = owner._reserve(len(chunk))
                if wait > 0:
                    time.sleep(wait)
            self.wfile.write(chunk)
            sent += len(chunk)


class _DeadlineReader(io.RawIOBase):
    """The request side of a connection: each recv waits at most until the handler's deadline.

    A plain socket timeout bounds one recv only, so a client sending a byte every few seconds
    would keep its thread (and its slot) forever; here the whole request line and headers must
    arrive before the deadline set when the request began."""

    def __init__(self, handler: ShardRequestHandler):
        super().__init__()
        self._handler = handler
        self._sock = handler.connection

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._handler._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client took too long to send its request")
        self._sock.settimeout(min(left, self._handler.timeout))
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._handler.timeout)  # writes get the full timeout


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung client must never keep the process alive
    block_on_close = False  # nor make close() wait for it
    request_queue_size = 128  # a burst of clients waits in the kernel's backlog rather than being dropped

    def __init__(self, address, handler, owner: ShardServer):
        self.owner = owner
        self.root = owner.root
        self.slots = SourceSlots.sized(owner.max_connections, owner.max_connections_per_source)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        # Runs in the accept loop: never wait here, or one flood would stall every later client.
        source = source_of(client_address[0] if client_address else None)
        why = self.slots.admit(source)
        if why is not None:
            return self._refuse(request, why)
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.slots.release(source)
            raise

    def process_request_thread(self, request, client_address):
        try:
            if self.owner.tls is not None:
                request.settimeout(self.owner.client_timeout_s)
                try:
                    request.do_handshake()
                except (OSError, ValueError):  # a failed or abandoned handshake: drop the connection
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release(source_of(client_address[0] if client_address else None))

    def _refuse(self, request, why: str) -> None:
        """503 without reading the request, sent without blocking, then close."""
        if self.owner.tls is not None:  # no handshake yet: nothing can be said, only closed
            self.shutdown_request(request)
            return
        try:
            request.setblocking(False)
            request.send(refusal_response(why))
            request.recv(1 << 16)  # what already arrived: closing with unread data would reset the 503 away
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return  # disconnects are routine
        log.warning("shard server: error serving %s", client_address, exc_info=True)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class ShardServer:
    """Serves a broadcast root read-only over HTTP, one thread per connection, at most
    `max_connections` at once and `max_connections_per_source` from one address (default: 16, or
    all of them on a loopback address, where every client is this machine),
    each closed after `client_timeout_s` without progress (see the module doc).

    `in_use(version)` is True while a response for that version is being written, and for
    `busy_grace_s` seconds after the last one (a client fetches a version's shards one request
    after another), so prune_versions(..., in_use=server.in_use) never deletes a version a client
    is still downloading. `max_bytes_per_s` caps the server's upload rate, all responses together
    (None: no cap)."""

    handler_class = ShardRequestHandler

    def __init__(
        self,
        root,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        busy_grace_s: float = 30.0,
        max_bytes_per_s: float | None = None,
        max_connections: int = 128,
        max_connections_per_source: int | None = None,
        client_timeout_s: float = 20.0,
        tls=None,
    ):
        if max_bytes_per_s is not None and not (isinstance(max_bytes_per_s, (int, float)) and max_bytes_per_s > 0):
            raise BroadcastError(f"max_bytes_per_s must be None (no cap) or a positive number, got {max_bytes_per_s!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise BroadcastError(f"max_connections must be a positive int, got {max_connections!r}")
        if not (isinstance(client_timeout_s, (int, float)) and client_timeout_s > 0):
            raise BroadcastError(f"client_timeout_s must be a positive number of seconds, got {client_timeout_s!r}")
        if max_connections_per_source is None:
            # A client opens `parallel` (4) connections. Bound to loopback, only this machine's
            # roles can connect (all from 127.0.0.1: `swarmrl rl` with many workers), so one
            # address may use them all.
            max_connections_per_source = max_connections if _loopback(host) else min(16, max_connections)
        if isinstance(max_connections_per_source, bool) or not isinstance(max_connections_per_source, int):
            raise BroadcastError(f"max_connections_per_source must be an int, got {max_connections_per_source!r}")
        if not 1 <= max_connections_per_source <= max_connections:
            raise BroadcastError(
                f"max_connections_per_source must be between 1 and max_connections ({max_connections}), "
                f"got {max_connections_per_source}"
            )
        self.max_connections = max_connections
        self.max_connections_per_source = max_connections_per_source
        # An ssl.SSLContext (protocol/tls.py server_context): serve https. The handshake runs in
        # the connection's own thread, under client_timeout_s, never in the accept loop.
        self.tls = tls
        # 20 s: a 256 KiB write (CHUNK) then needs the client to read at >= 13 KiB/s, below the
        # 32 KiB/s (MIN_RATE) under which clients give up on a source themselves.
        self.client_timeout_s = float(client_timeout_s)
        self.root = Path(root)
        self.host, self.port = host, port
        self.busy_grace_s = busy_grace_s
        self.max_bytes_per_s = max_bytes_per_s
        # The versions this server's owner is fetching now (a relay mirroring them), listed by GET
        # /versions as "incoming", so that clients wait for them rather than fetch them from
        # further up over the same link. The origin has none. A callable returning the versions,
        # or a mapping version -> bytes of it written so far, listed as "progress" ({"3": 1048576}:
        # a key older clients ignore), without which clients do not wait long (_prefer_relays).
        self.incoming: Callable[[], Iterable[int] | Mapping[int, int]] = lambda: ()
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}
        self._last: dict[int, float] = {}
        self._next_send = 0.0  # the rate cap's clock: when the next byte may go out
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def _begin(self, version: int) -> None:
        with self._lock:
            self._active[version] = self._active.get(version, 0) + 1
            self._last[version] = time.monotonic()

    def _end(self, version: int) -> None:
        with self._lock:
            n = self._active.get(version, 1) - 1
            if n > 0:
                self._active[version] = n
            else:
                self._active.pop(version, None)
            self._last[version] = time.monotonic()

    def _reserve(self, nbytes: int) -> float:
        """Book `nbytes` of upload under the rate cap; the seconds to wait before sending them."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_send)
            self._next_send = start + nbytes / self.max_bytes_per_s
            return self._next_send - now  # the end of its slot: n bytes take n / rate seconds

    def in_use(self, version: int) -> bool:
        with self._lock:
            if self._active.get(version, 0) > 0:
                return True
            last = self._last.get(version)
            return last is not None and time.monotonic() - last < self.busy_grace_s

    def start(self) -> ShardServer:
        if self._server is not None:
            raise BroadcastError("ShardServer is already started; create another instance to serve again")
        if not self.root.is_dir():
            raise BroadcastError(f"broadcast root {self.root} does not exist; create it (versions are published there)")
        try:
            self._server = _Server((self.host, self.port), self.handler_class, self)
            if self.tls is not None:
                self._server.socket = self.tls.wrap_socket(
                    self._server.socket, server_side=True, do_handshake_on_connect=False
                )
        except OSError as e:
            raise BroadcastError(
                f"ShardServer cannot listen on {self.host}:{self.port}: {e}; choose another host or port"
            ) from e
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="shard-server", daemon=True
        )
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        if self._server is None:
            raise BroadcastError("ShardServer has no URL until start() is called")
        host, port = self._server.server_address[:2]
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
