"""Policy versions over HTTP: real sockets on 127.0.0.1, a PolicyServer in this process."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmrl.transport.weights import PolicyServer, WeightsError, fetch_policy, folder_manifest, prune_cache

FAST = {"timeout_s": 2.0, "retries": 2, "backoff_s": 0.01}


def _publish(policies: Path, version: int, extra: dict[str, bytes] | None = None) -> Path:
    folder = policies / f"v{version:06d}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "toy", "version": version}))
    (folder / "model.safetensors").write_bytes(os.urandom(200_000))
    (folder / "empty.txt").write_bytes(b"")
    (folder / ".DS_Store").write_bytes(b"litter")  # dotfiles are not part of a version
    for name, data in (extra or {}).items():
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def policies(tmp_path):
    p = tmp_path / "policies"
    p.mkdir()
    return p


@pytest.fixture
def server(policies):
    with PolicyServer(policies) as s:
        yield s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_folder_manifest_shape(policies):
    folder = _publish(policies, 1)
    m = folder_manifest(folder)
    assert sorted(m["files"]) == ["config.json", "empty.txt", "model.safetensors"]
    assert m["files"]["model.safetensors"]["size"] == 200_000
    assert m["files"]["empty.txt"]["size"] == 0
    assert len(m["sha256"]) == 64
    (folder / "config.json").write_text("{}")
    assert folder_manifest(folder)["sha256"] != m["sha256"]


def test_round_trip(server, policies, tmp_path):
    src = _publish(policies, 3)
    manifest = folder_manifest(src)
    assert server.url.startswith("http://127.0.0.1:")
    got = fetch_policy(server.url, 3, manifest, tmp_path / "cache", **FAST)
    assert got == tmp_path / "cache" / "v000003"
    for name in manifest["files"]:
        assert (got / name).read_bytes() == (src / name).read_bytes()
    assert not (got / ".DS_Store").exists()
    assert folder_manifest(got) == manifest
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["v000003"]  # no temp folders left


def test_fetch_again_needs_no_server(policies, tmp_path):
    manifest = folder_manifest(_publish(policies, 1))
    with PolicyServer(policies) as s:
        url = s.url
        fetch_policy(url, 1, manifest, tmp_path / "cache", **FAST)
    # Server gone: succeeds only because the destination already matches.
    got = fetch_policy(url, 1, manifest, tmp_path / "cache", **FAST)
    assert folder_manifest(got) == manifest


def test_damaged_destination_is_replaced(server, policies, tmp_path):
    manifest = folder_manifest(_publish(policies, 1))
    got = fetch_policy(server.url, 1, manifest, tmp_path / "cache", **FAST)
    (got / "model.safetensors").write_bytes(b"truncated")
    got = fetch_policy(server.url, 1, manifest, tmp_path / "cache", **FAST)
    assert folder_manifest(got) == manifest
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["v000001"]


@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "other-size"])
def test_file_changed_on_server(server, policies, tmp_path, same_size):
    src = _publish(policies, 2)
    manifest = folder_manifest(src)
    (src / "model.safetensors").write_bytes(os.urandom(200_000 if same_size else 150_000))
    t0 = time.monotonic()
    with pytest.raises(WeightsError) as e:
        fetch_policy(server.url, 2, manifest, tmp_path / "cache", timeout_s=2.0, retries=3, backoff_s=0.2)
    assert time.monotonic() - t0 < 1.0  # a mismatch is not retried
    msg = str(e.value)
    assert "model.safetensors" in msg and "v000002" in msg and server.url in msg
    assert ("sha256 mismatch" if same_size else "size mismatch") in msg
    if same_size:
        assert manifest["files"]["model.safetensors"]["sha256"] in msg  # expected vs got
    assert list((tmp_path / "cache").iterdir()) == []  # no vNNNNNN, no temp folder


def test_missing_version_is_404_without_retries(server, policies, tmp_path):
    manifest = folder_manifest(_publish(policies, 1))
    t0 = time.monotonic()
    with pytest.raises(WeightsError, match="404") as e:
        fetch_policy(server.url, 7, manifest, tmp_path / "cache", timeout_s=2.0, retries=3, backoff_s=0.2)
    assert time.monotonic() - t0 < 1.0  # retries would take 0.2 + 0.4 + 0.8 s
    assert "v000007" in str(e.value) and f"{server.url}/v000007/" in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_server_down_bounded_retries(policies, tmp_path):
    manifest = folder_manifest(_publish(policies, 1))
    url = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(WeightsError, match="after 3 attempts") as e:
        fetch_policy(url, 1, manifest, tmp_path / "cache", timeout_s=1.0, retries=2, backoff_s=0.01)
    assert time.monotonic() - t0 < 2.0
    assert url in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_traversal_and_non_files_are_404(server, policies, tmp_path):
    secret = b"TOP-SECRET-CONTENT"
    (tmp_path / "secret").write_bytes(secret)
    (policies / "secret").write_bytes(secret)
    folder = _publish(policies, 1)
    (folder / ".secret").write_bytes(secret)
    host, port = server.url.removeprefix("http://").split(":")
    paths = [
        "/v000001/../secret",
        "/v000001/../../secret",
        "/secret",
        "/v000001/%2e%2e/secret",
        "/v000001/%2E%2E%2Fsecret",
        "/v000001/..%2fsecret",
        "/v000001/",
        "/v000001",
        "/v000001/.secret",
        "/v000001/nope.bin",
        "/v000001/config.json?x=1",
        "/v1/config.json",
    ]
    for method in ("GET", "HEAD"):
        for path in paths:
            conn = http.client.HTTPConnection(host, int(port), timeout=2)
            conn.request(method, path)
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            assert resp.status == 404, (method, path)
            assert secret not in body and b"Traceback" not in body
    # ...while the real file is served, with its length, and HEAD sends no body.
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    conn.request("HEAD", "/v000001/model.safetensors")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Length") == "200000" and resp.read() == b""
    conn.close()


def test_client_disconnect_is_quiet(server, policies, capfd):
    folder = _publish(policies, 1, extra={"big.bin": bytes(24 << 20)})  # larger than socket buffers
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"GET /v000001/big.bin HTTP/1.0\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.0 200")
    # Abort with unread data: the server's next writes fail with a reset/broken pipe.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    time.sleep(0.3)
    # The server still works, and nothing was printed.
    manifest = folder_manifest(folder)
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    conn.request("GET", "/v000001/config.json")
    assert conn.getresponse().read() == (folder / "config.json").read_bytes()
    conn.close()
    assert manifest["files"]["big.bin"]["size"] == 24 << 20
    out, err = capfd.readouterr()
    assert "Traceback" not in err and err == ""


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda m: m["files"].update({"sub/x.bin": m["files"]["config.json"]}), "sub/x.bin"),
        (lambda m: m["files"].update({"..": m["files"]["config.json"]}), "'..'"),
        (lambda m: m["files"].update({".env": m["files"]["config.json"]}), ".env"),
        (lambda m: m["files"]["config.json"].update(sha256="xyz" * 21 + "a"), "64 hex"),
        (lambda m: m["files"]["config.json"].update(size=-1), "non-negative"),
        (lambda m: m["files"]["config.json"].update(size="12"), "non-negative"),
        (lambda m: m.update(files={}), "no files"),
        (lambda m: m.update(sha256="0" * 64), "top-level sha256"),
    ],
)
def test_bad_manifest(policies, tmp_path, mutate, needle):
    manifest = folder_manifest(_publish(policies, 1))
    mutate(manifest)
    # No server needed: validation happens before any request.
    with pytest.raises(WeightsError, match="manifest") as e:
        fetch_policy(f"http://127.0.0.1:{_closed_port()}", 1, manifest, tmp_path / "cache", **FAST)
    assert needle in str(e.value)
    assert not (tmp_path / "cache").exists()


def test_prune_cache_keeps_newest(tmp_path):
    root = tmp_path / "cache"
    for v in (1, 2, 5, 10, 11):
        (root / f"v{v:06d}").mkdir(parents=True)
        (root / f"v{v:06d}" / "config.json").write_text("{}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / f".tmp-v000012-{dead.pid}-deadbeef").mkdir()  # a crashed fetch's leftovers
    (root / f".tmp-v000013-{os.getpid()}-cafef00d").mkdir()  # a fetch in progress here: kept
    (root / "notes").mkdir()  # not ours: left alone
    prune_cache(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [f".tmp-v000013-{os.getpid()}-cafef00d", "notes", "v000010", "v000011"]
    )
    prune_cache(root, keep=5)  # fewer than keep: nothing to do
    assert (root / "v000010").is_dir() and (root / "v000011").is_dir()
    with pytest.raises(WeightsError):
        prune_cache(root, keep=-1)


def test_server_start_errors(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        PolicyServer(tmp_path / "nope").start()
    s = PolicyServer(tmp_path)
    with pytest.raises(WeightsError, match="start"):
        s.url
    s.close()  # closing a never-started server is harmless
