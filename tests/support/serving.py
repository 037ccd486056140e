"""`swarmrl serve` as a real process on 127.0.0.1 (its URL from --url-file), with an `openai` client."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai

from harness import RunHandle, wait_for


class Server:
    def __init__(self, model: Path, run: Path, *extra: str):
        self.url_file = run / "url.json"
        (run / "serve.log").unlink(missing_ok=True)
        argv = ("serve", "--model", str(model), "--port", "0", "--url-file", str(self.url_file), "--threads", "1")
        self.handle = RunHandle(*argv, *extra, log=run / "serve.log").start()
        self.proc = self.handle.proc
        self.handle.wait_for_file(self.url_file, 60)
        info = json.loads(self.url_file.read_text())
        self.url, self.model = info["url"], info["model"]
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=20)


def from_address(address: str, timeout: float = 120) -> httpx.Client:
    """An httpx client whose connections come from `address` (any 127.x.y.z is this machine), so a
    test can be several client addresses to the server's per-address limits."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=timeout)


def settled_stats(url: str, timeout_s: float = 180) -> dict:
    """The server's /stats once its engine is idle: neither its token steps nor its generated tokens
    moved for 0.6 s (tokens are counted when a request ends, steps at every step)."""
    seen: dict = {}

    def idle() -> dict | None:
        now = httpx.get(url + "/stats", timeout=60).json()
        key = (now["steps"], now["generated_tokens"], now.get("queued_completions", 0))
        last, seen["key"], seen["now"] = seen.get("key"), key, now
        return now if key == last and key[2] == 0 else None

    return wait_for(idle, timeout_s, "the server's engine to be idle", log=lambda: str(seen.get("now")), every=0.6)


def departing_requests(
    url: str, body: dict, count: int, *, open_max: int, linger_s: float, source: str = "127.0.0.1"
) -> list[bytes]:
    """POST /v1/completions `count` times from `source`, at most `open_max` sockets open, each closed
    `linger_s` after its request was sent (or once its stream's first content arrived, for
    "stream": true), whatever came back; the first bytes each socket read."""
    import socket

    host, port = url.split("//", 1)[1].split(":")
    seen: list[bytes] = []
    gate = threading.Semaphore(open_max)

    def one(i: int) -> None:
        raw = json.dumps({**body, "seed": body.get("seed", 0) + 1000 * i}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n"
        ).encode()
        try:
            with socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0)) as sock:
                sock.sendall(head + raw)
                end = time.monotonic() + linger_s
                got = b""
                while (left := end - time.monotonic()) > 0:
                    sock.settimeout(left)
                    try:
                        chunk = sock.recv(4096)
                    except TimeoutError:
                        break
                    if not chunk:
                        break
                    got += chunk
                    if body.get("stream") and b'"text": "' in got.split(b"\r\n\r\n", 1)[-1]:
                        break  # generation has started: leave now, mid-stream
                seen.append(got[:64])
        finally:
            gate.release()

    threads = []
    for i in range(count):
        gate.acquire()
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(timeout=60)
    return seen
