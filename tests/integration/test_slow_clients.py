"""A slow client is cut off by every service it can reach, while an honest client is served
(issue 32): the orchestrator, `swarmrl serve`, the trainer's weight origin and a `swarmrl relay`,
each a real server on 127.0.0.1 with its timeouts set to 1.5 s. A slow client sends its request
line and headers a byte every 0.1 s (each read is quick; only a deadline over the whole head stops
it), or its headers at once and then its body a byte every 0.1 s."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.model.checkpoint import build_tiny_policy, save_policy
from swarmrl.protocol.signing import public_key_hex
from swarmrl.transport.broadcast import ShardServer, publish_version

from harness import wait_for
from orchestrator_harness import OrchestratorProcess, make_run_dir
from serving import Server

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 1.5
KEY = Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    model = root / "model"
    save_policy(*build_tiny_policy(seed=0), model)
    run = make_run_dir(
        root / "run",
        "--orchestrator.header_timeout_s",
        str(TIMEOUT),
        "--orchestrator.body_timeout_s",
        str(TIMEOUT),
    )
    orch = OrchestratorProcess(run).start()
    serve = Server(model, root, "--header-timeout-s", str(TIMEOUT), "--body-timeout-s", str(TIMEOUT))
    publish_version(model, root / "broadcast", 0, key=KEY)
    origin = ShardServer(root / "broadcast", client_timeout_s=TIMEOUT).start()
    (root / "trainer.pub").write_text(public_key_hex(KEY))
    relay = subprocess.Popen(
        [sys.executable, "-m", "swarmrl.cli", "relay", "--upstream", origin.url, "--cache-dir", str(root / "relay")]
        + ["--trainer-key", str(root / "trainer.pub"), "--url-file", str(root / "relay.json")]
        + ["--client-timeout-s", str(TIMEOUT)],
        stdout=open(root / "relay.log", "w"),
        stderr=subprocess.STDOUT,
    )
    wait_for(lambda: (root / "relay.json").exists(), 60, "relay.json", proc=relay, log=root / "relay.log")
    urls = {
        "orchestrator": orch.url,
        "serve": serve.url,
        "origin": origin.url,
        "relay": json.loads((root / "relay.json").read_text())["url"],
    }
    yield urls
    relay.terminate()
    relay.wait(timeout=20)
    origin.close()
    serve.stop()
    orch.stop()


# What an honest client asks each service, and expects back at once.
HONEST = {"orchestrator": "/healthz", "serve": "/v1/models", "origin": "/versions", "relay": "/versions"}
# A path each service reads a body on (the weight servers take no bodies).
POST = {"orchestrator": "/v1/leases", "serve": "/v1/chat/completions"}


def drip(url: str, head: bytes, body: bytes = b"") -> tuple[bytes, float]:
    """Send `head` (a byte every 0.1 s unless `body` is given: then at once, and `body` a byte
    every 0.1 s); return what the server answered before closing, and after how many seconds."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    stop = threading.Event()

    def send():
        try:
            if body:
                sock.sendall(head)
            for byte in body or head:
                if stop.wait(0.1):
                    return
                sock.send(bytes([byte]))
        except OSError:
            return

    sender = threading.Thread(target=send)
    t0 = time.monotonic()
    sender.start()
    try:
        sock.settimeout(15)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        return answer, time.monotonic() - t0
    except TimeoutError:
        return answer + b"<still open>", time.monotonic() - t0
    finally:
        stop.set()
        sender.join()
        sock.close()


@pytest.mark.parametrize("service", ["orchestrator", "serve", "origin", "relay"])
def test_a_slow_header_is_cut_off_while_an_honest_client_is_served(services, service):
    url = services[service]
    head = b"GET " + HONEST[service].encode() + b" HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 400 + b"\r\n\r\n"
    result: dict = {}
    slow = threading.Thread(target=lambda: result.update(answer=drip(url, head)))
    slow.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert httpx.get(url + HONEST[service], timeout=5).status_code == 200
    assert time.monotonic() - t0 < 3.0  # served while the slow client drips (its head would take 40 s)
    slow.join()
    answer, seconds = result["answer"]
    assert b"<still open>" not in answer and not answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert TIMEOUT - 0.2 < seconds < TIMEOUT + 4, seconds  # cut at the deadline, not when the head was done (40 s)
    if service in ("orchestrator", "serve"):
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


@pytest.mark.parametrize("service", ["orchestrator", "serve"])
def test_a_slow_body_is_cut_off_with_a_408(services, service):
    body = json.dumps({"padding": "a" * 400}).encode()
    head = (
        f"POST {POST[service]} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    answer, seconds = drip(services[service], head, body)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert TIMEOUT - 0.2 < seconds < TIMEOUT + 4, seconds
    assert b"Traceback" not in answer
