"""Signed, sharded policy broadcast: real ShardServers on 127.0.0.1 in this process."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.protocol.manifest import FORMAT, canonical, manifest_digest, verify_manifest
from swarmrl.protocol.signing import public_key_hex
from swarmrl.transport.broadcast import (
    INSTALLED_MANIFEST,
    BroadcastError,
    ShardRequestHandler,
    ShardServer,
    SourceScores,
    download_shards,
    fetch_manifest,
    fetch_version,
    list_versions,
    mirror_version,
    prune_versions,
    publish_version,
    read_versions,
    unpublish_version,
)

from harness import dripping, free_port, read_until_closed, wait_for

pytestmark = pytest.mark.timeout(60)

KEY = Ed25519PrivateKey.generate()
PUB = public_key_hex(KEY)
OTHER = Ed25519PrivateKey.generate()
SHARD = 64 << 10
FAST = {"timeout_s": 2.0}


def fake_model(folder: Path, kib: int = 300, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8, "seed": seed}))
    (folder / "model.safetensors").write_bytes(os.urandom(kib << 10))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0}, "seed": seed}))
    (folder / ".DS_Store").write_bytes(b"litter")  # dotfiles are not part of a version
    return folder


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    return names == sorted(p.name for p in b.iterdir() if not p.name.startswith(".")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def raw(url: str, method: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class Recording(ShardRequestHandler):
    """Records (path, Range header) of every GET into the server's `requests` list."""

    def do_GET(self):
        self.server.owner.requests.append((self.path, self.headers.get("Range")))
        super().do_GET()


class RecordingServer(ShardServer):
    handler_class = Recording

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.requests: list[tuple[str, str | None]] = []


@pytest.fixture
def origin(tmp_path):
    """v000001 published from a ~300 KiB fake model in 64 KiB shards: (model dir, root, manifest)."""
    model = fake_model(tmp_path / "model")
    root = tmp_path / "origin"
    manifest = publish_version(model, root, 1, key=KEY, shard_size=SHARD)
    return model, root, manifest


# ---- publish and fetch --------------------------------------------------------------------------


def test_publish_layout_and_fetch_gives_identical_files(origin, tmp_path):
    model, root, manifest = origin
    verify_manifest(manifest, PUB, version=1)
    assert manifest["format"] == FORMAT and manifest["parent"] is None and manifest["public_key"] == PUB
    assert [f["name"] for f in manifest["files"]] == ["config.json", "model.safetensors", "tokenizer.json"]
    assert manifest["model_config"]["model_type"] == "qwen2"
    total = sum((model / f["name"]).stat().st_size for f in manifest["files"])
    assert manifest["total_size"] == total and len(manifest["shards"]) == -(-total // SHARD) >= 5
    shards = sorted((root / "v000001" / "shards").iterdir())
    assert [p.name for p in shards] == [f"{i:05d}" for i in range(len(manifest["shards"]))]
    assert b"".join(p.read_bytes() for p in shards) == b"".join(
        (model / f["name"]).read_bytes() for f in manifest["files"]
    )
    assert json.loads((root / "v000001" / "manifest.json").read_text()) == manifest
    assert [p.name for p in root.iterdir()] == ["v000001"]  # no temp folder left behind
    assert read_versions(root) == [1]
    assert canonical(manifest) == canonical({k: v for k, v in manifest.items() if k != "signature"})
    assert len(manifest_digest(manifest)) == 64

    dest_root = tmp_path / "client"
    with RecordingServer(root) as server:
        assert list_versions(server.url) == [1]
        got = fetch_version(1, [server.url], dest_root, public_key=PUB, **FAST)
        assert got == dest_root / "v000001" and same_files(got, model)
        assert not (got / ".DS_Store").exists()
        # The shard copy is gone, nothing else is left over.
        assert sorted(p.name for p in dest_root.iterdir()) == [".shards", "v000001"]
        assert list((dest_root / ".shards").iterdir()) == []
        # Again: the manifest is asked for, the shards are not downloaded a second time.
        n = len(server.requests)
        assert fetch_version(1, [server.url], dest_root, public_key=PUB, **FAST) == got
        assert [p for p, _ in server.requests[n:]] == ["/v000001/manifest.json"]
    # Knowing which publication it wants, a client needs no source at all for a folder it holds.
    assert (
        fetch_version(
            1, [closed_port_url()], dest_root, public_key=PUB, expected_digest=manifest_digest(manifest), **FAST
        )
        == got
    )


def test_republishing_is_a_no_op_with_the_same_content_and_refused_with_other_content(origin, tmp_path):
    model, root, manifest = origin
    before = (root / "v000001" / "manifest.json").stat().st_mtime_ns
    assert publish_version(model, root, 1, key=KEY, shard_size=SHARD) == manifest
    assert (root / "v000001" / "manifest.json").stat().st_mtime_ns == before
    other = fake_model(tmp_path / "other", kib=100, seed=1)
    with pytest.raises(BroadcastError, match="already holds a different v000001"):
        publish_version(other, root, 1, key=KEY, shard_size=SHARD)
    with pytest.raises(BroadcastError, match="different"):  # same files, another shard size: another version
        publish_version(model, root, 1, key=KEY, shard_size=SHARD * 2)
    assert json.loads((root / "v000001" / "manifest.json").read_text()) == manifest
    assert [p.name for p in root.iterdir()] == ["v000001"]
    # Replacing on purpose (a trainer redoing steps after a resume) is explicit.
    assert unpublish_version(root, 1) and not unpublish_version(root, 1)
    replaced = publish_version(other, root, 1, key=KEY, parent=0, shard_size=SHARD)
    assert replaced["parent"] == 0 and manifest_digest(replaced) != manifest_digest(manifest)


def test_publish_refuses_bad_input(tmp_path):
    model = fake_model(tmp_path / "model", kib=10)
    with pytest.raises(BroadcastError, match="not a directory"):
        publish_version(tmp_path / "missing", tmp_path / "root", 1, key=KEY)
    with pytest.raises(BroadcastError, match="Ed25519PrivateKey"):
        publish_version(model, tmp_path / "root", 1, key=PUB)
    with pytest.raises(BroadcastError, match="0..999999"):
        publish_version(model, tmp_path / "root", -1, key=KEY)
    (model / "bad name.bin").write_bytes(b"x")
    with pytest.raises(BroadcastError, match="rename the file"):
        publish_version(model, tmp_path / "root", 1, key=KEY)
    assert read_versions(tmp_path / "root") == []


# ---- signatures ---------------------------------------------------------------------------------


def test_verify_manifest_refusals_each_say_what_is_wrong(origin, tmp_path):
    _, _, manifest = origin
    messages = {}

    def refused(m, key=PUB, version=None, match=None) -> str:
        with pytest.raises(BroadcastError, match=match) as e:
            verify_manifest(m, key, version)
        return str(e.value)

    unsigned = {k: v for k, v in manifest.items() if k != "signature"}
    messages["unsigned"] = refused(unsigned, match="unsigned")
    forged = dict(manifest, signature=OTHER.sign(canonical(manifest)).hex())  # claims PUB, signed by OTHER
    assert "bad signature" in refused(forged)  # cannot be told apart from tampering: same message
    other_signed = publish_version(tmp_path / "model", tmp_path / "other_root", 1, key=OTHER, shard_size=SHARD)
    verify_manifest(other_signed, public_key_hex(OTHER), 1)  # valid for its own key ...
    messages["other key"] = refused(other_signed, match="not the configured trainer key")  # ... not for ours
    shards = [dict(s) for s in manifest["shards"]]
    shards[2]["sha256"] = "0" * 64
    messages["tampered shard"] = refused(dict(manifest, shards=shards), match="altered after the trainer signed")
    messages["tampered version"] = refused(dict(manifest, version=2), match="altered")
    messages["wrong version"] = refused(manifest, version=2, match="is for v000001, not v000002")
    files = [dict(f) for f in manifest["files"]]
    files[1]["offset"] += 1
    messages["malformed"] = refused(dict(manifest, files=files), match="offset of 'model.safetensors'")
    files = [dict(f) for f in manifest["files"]]
    files[0]["name"] = "../config.json"
    messages["bad name"] = refused(dict(manifest, files=files), match="bad name")
    messages["bad key"] = refused(manifest, key="", match="64 lowercase hex")
    refused(dict(manifest, format="swarmrl-broadcast/2"), match="incompatible")
    refused(dict(manifest, extra=1), match="unknown field")
    refused([manifest], match="not a JSON object")
    assert len(set(messages.values())) == len(messages)
    for msg in messages.values():
        assert "v00000" in msg  # every message names the version


def test_fetch_refuses_a_bad_signature_and_installs_nothing(tmp_path):
    model = fake_model(tmp_path / "model")
    publish_version(model, tmp_path / "forged", 1, key=OTHER, shard_size=SHARD)
    dest_root = tmp_path / "client"
    with RecordingServer(tmp_path / "forged") as server:
        with pytest.raises(BroadcastError, match="v000001") as e:
            fetch_version(1, [server.url], dest_root, public_key=PUB, **FAST)
        assert server.url in str(e.value) and "key" in str(e.value)
        assert all("/shards/" not in p for p, _ in server.requests)  # not a single shard was fetched
        with pytest.raises(BroadcastError, match="required"):
            fetch_version(1, [server.url], dest_root, public_key=None, **FAST)
        # A relay never mirrors without the trainer key, nor what does not verify against it.
        with pytest.raises(BroadcastError, match="public_key is required.*trainer.pub"):
            mirror_version(1, [server.url], tmp_path / "relay", public_key=None, **FAST)
        with pytest.raises(BroadcastError, match="v000001"):
            mirror_version(1, [server.url], tmp_path / "relay", public_key=PUB, **FAST)
    assert not dest_root.exists()
    assert read_versions(tmp_path / "relay") == []
    # A copy already in the relay's folder (mirrored by an older swarmrl without a key) is not
    # trusted either: it is fetched again, and refused.
    shutil.copytree(tmp_path / "forged", tmp_path / "relay", dirs_exist_ok=True)
    with ShardServer(tmp_path / "forged") as server, pytest.raises(BroadcastError, match="not the configured"):
        mirror_version(1, [server.url], tmp_path / "relay", public_key=PUB, **FAST)
    assert read_versions(tmp_path / "relay") == []


# ---- the server ---------------------------------------------------------------------------------


def test_ranges_head_and_path_safety(origin, tmp_path):
    _, root, manifest = origin
    (root / "secret.txt").write_text("not served")
    shard = (root / "v000001" / "shards" / "00001").read_bytes()
    with ShardServer(root) as server:
        url = server.url
        status, headers, body = raw(url, "GET", "/v000001/shards/00001")
        assert status == 200 and body == shard and headers["accept-ranges"] == "bytes"
        status, headers, body = raw(url, "GET", "/v000001/shards/00001", {"Range": "bytes=100-199"})
        assert status == 206 and body == shard[100:200]
        assert headers["content-range"] == f"bytes 100-199/{len(shard)}" and headers["content-length"] == "100"
        status, headers, body = raw(url, "GET", "/v000001/shards/00001", {"Range": "bytes=60000-"})
        assert status == 206 and body == shard[60000:]
        assert headers["content-range"] == f"bytes 60000-{len(shard) - 1}/{len(shard)}"
        status, headers, body = raw(url, "GET", "/v000001/shards/00001", {"Range": f"bytes={len(shard) - 10}-99999999"})
        assert status == 206 and body == shard[-10:]
        status, headers, _ = raw(url, "GET", "/v000001/shards/00001", {"Range": f"bytes={len(shard)}-"})
        assert status == 416 and headers["content-range"] == f"bytes */{len(shard)}"
        status, headers, body = raw(url, "HEAD", "/v000001/shards/00001")
        assert status == 200 and headers["content-length"] == str(len(shard)) and body == b""
        status, headers, body = raw(url, "HEAD", "/v000001/shards/00001", {"Range": "bytes=10-"})
        assert status == 206 and headers["content-length"] == str(len(shard) - 10) and body == b""
        status, _, body = raw(url, "GET", "/v000001/manifest.json")
        assert status == 200 and json.loads(body) == manifest
        status, _, body = raw(url, "GET", "/versions")
        assert status == 200 and json.loads(body) == {"versions": [1], "incoming": []}
        for bad in [
            "/v000001/../secret.txt",
            "/v000001/shards/../manifest.json",
            "/%2e%2e/secret.txt",
            "/v000001/%2e%2e/%2e%2e/secret.txt",
            "/v000001/shards/%2e%2e/manifest.json",
            "/secret.txt",
            "/v000001/shards/00001?x=1",
            "/v000001/shards/0001",
            "/v000001/shards/99999",
            "/v000002/manifest.json",
            "/v000001/shards",
            "/v000001/",
            "/",
            "//etc/passwd",
            "/v000001/shards/00001/",
        ]:
            status, _, body = raw(url, "GET", bad)
            assert status == 404 and b"not served" not in body, bad
        assert raw(url, "POST", "/v000001/manifest.json")[0] == 501
    with pytest.raises(BroadcastError, match="is a ShardServer"):
        list_versions(url, timeout_s=1.0)


# ---- untrusted sources --------------------------------------------------------------------------


def test_a_corrupted_shard_on_one_server_is_fetched_elsewhere_and_scored_down(origin, tmp_path):
    model, root, manifest = origin
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    shard = copy / "v000001" / "shards" / "00000"
    data = bytearray(shard.read_bytes())
    data[1234] ^= 0xFF
    shard.write_bytes(bytes(data))
    scores = SourceScores()
    log = []
    with ShardServer(root) as a, ShardServer(copy) as b:
        # b first: unknown sources are tried in the order given, so b gets shard 00000.
        got = fetch_version(
            1, [b.url, a.url], tmp_path / "client", public_key=PUB, scores=scores, log=log.append, parallel=1, **FAST
        )
        assert same_files(got, model)
        snap = scores.snapshot()
        assert snap[b.url]["bad_shards"] == 1 and "sha256 mismatch" in snap[b.url]["last_error"]
        assert snap[b.url]["score"] < snap[a.url]["score"], snap
        assert scores.order([b.url, a.url]) == [a.url, b.url]
        assert any("sha256 mismatch" in line and b.url in line for line in log)


def test_a_dropped_connection_is_resumed_with_a_range_request(origin, tmp_path):
    model, root, manifest = origin
    cut = 10_000

    class Dropping(Recording):
        dropped = threading.Event()

        def write_body(self, f, length):
            if self.path.endswith("/shards/00001") and not self.dropped.is_set():
                self.dropped.set()
                self.wfile.write(f.read(cut))
                self.close_connection = True
                return  # the connection closes with the body cut short
            super().write_body(f, length)

    class DroppingServer(RecordingServer):
        handler_class = Dropping

    with DroppingServer(root) as server:
        got = fetch_version(1, [server.url], tmp_path / "client", public_key=PUB, parallel=2, **FAST)
        assert same_files(got, model)
        shard1 = [rng for path, rng in server.requests if path == "/v000001/shards/00001"]
        assert shard1 == [None, f"bytes={cut}-"]  # the second request fetched only the rest
        assert sum(1 for p, _ in server.requests if "/shards/" in p) == len(manifest["shards"]) + 1


def test_a_failed_fetch_leaves_its_shards_for_the_next_call(origin, tmp_path):
    model, root, manifest = origin
    holey = tmp_path / "holey"
    shutil.copytree(root, holey)
    last = f"{len(manifest['shards']) - 1:05d}"
    (holey / "v000001" / "shards" / last).unlink()
    dest_root = tmp_path / "client"
    with ShardServer(holey) as b:
        t0 = time.monotonic()
        with pytest.raises(BroadcastError, match=f"shard {last}") as e:
            fetch_version(1, [b.url], dest_root, public_key=PUB, parallel=1, **FAST)
        assert time.monotonic() - t0 < 10 and b.url in str(e.value) and "404" in str(e.value)
    assert not (dest_root / "v000001").exists()
    kept = sorted(p.name for p in (dest_root / ".shards").rglob("0*"))
    assert kept == [f"{i:05d}" for i in range(len(manifest["shards"]) - 1)]
    with RecordingServer(root) as a:
        got = fetch_version(1, [a.url], dest_root, public_key=PUB, **FAST)
        assert same_files(got, model)
        assert [p for p, _ in a.requests] == ["/v000001/manifest.json", f"/v000001/shards/{last}"]
    assert list((dest_root / ".shards").iterdir()) == []


def test_a_dead_source_among_live_ones_and_all_sources_dead(origin, tmp_path):
    model, root, manifest = origin
    dead1, dead2 = closed_port_url(), closed_port_url()
    scores = SourceScores()
    with ShardServer(root) as a:
        a_url = a.url
        got = fetch_version(1, [dead1, a.url], tmp_path / "client", public_key=PUB, scores=scores, **FAST)
        assert same_files(got, model)
        download_shards(manifest, [dead1, a.url], tmp_path / "shards", scores=scores, **FAST)
        assert len(list((tmp_path / "shards").iterdir())) == len(manifest["shards"])
    snap = scores.snapshot()
    assert snap[dead1]["failures"] >= 1 and snap[dead1]["score"] < snap[a_url]["score"]

    t0 = time.monotonic()
    with pytest.raises(BroadcastError) as e:
        fetch_version(1, [dead1, dead2], tmp_path / "client2", public_key=PUB, **FAST)
    assert "v000001" in str(e.value) and dead1 in str(e.value) and dead2 in str(e.value)
    with pytest.raises(BroadcastError) as e:
        download_shards(manifest, [dead1, dead2], tmp_path / "shards2", **FAST)
    msg = str(e.value)
    assert "v000001" in msg and "shard 0000" in msg and dead1 in msg and dead2 in msg and "6 tries" in msg
    with pytest.raises(BroadcastError, match="v000001"):
        mirror_version(1, [dead1], tmp_path / "relay", public_key=PUB, **FAST)
    assert time.monotonic() - t0 < 15
    assert not (tmp_path / "client2" / "v000001").exists()


def test_source_scores_order():
    s = SourceScores(penalty_s=60)
    assert s.order(["a", "b", "c"]) == ["a", "b", "c"]  # nothing known: as given
    s.good("a", 1000, 1.0)
    s.good("b", 5000, 1.0)
    assert s.order(["a", "b", "c"]) == ["c", "b", "a"]  # unknown first, then fastest first
    s.bad("b", "timed out")
    s.good("c", 100, 1.0)
    assert s.order(["a", "b", "c"]) == ["a", "c", "b"]  # a recent failure drops behind every other
    s.bad("a", "bad shard", corrupt=True)
    assert s.order(["a", "b", "c"]) == ["c", "b", "a"]  # a bad shard costs more than a timeout
    snap = s.snapshot()
    assert snap["a"]["bad_shards"] == 1 and snap["b"]["failures"] == 1 and snap["c"]["ema_bps"] > 0


# ---- pruning and relays -------------------------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_prune_versions_keeps_the_newest_and_versions_in_use(tmp_path):
    model = fake_model(tmp_path / "model", kib=200)
    root = tmp_path / "root"
    for v in (1, 2, 3, 4):
        publish_version(model, root, v, key=KEY, shard_size=SHARD)
    stale = root / f".tmp-v000005-{dead_pid()}-abcdef12"
    ours = root / f".tmp-v000005-{os.getpid()}-abcdef12"
    ours_old = root / f".tmp-v000002-{os.getpid()}-abcdef13"  # an idle partial of a version being pruned
    for p in (stale, ours, ours_old):
        p.mkdir()
    prune_versions(root, 2, in_use=lambda v: v == 1)
    assert read_versions(root) == [1, 3, 4]
    assert not stale.exists() and not ours_old.exists()
    assert ours.exists()  # this process may still be writing it
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [ours.name]

    # A real download in progress: the handler holds the response for shard 00001 open.
    gate, started = threading.Event(), threading.Event()

    class Slow(ShardRequestHandler):
        def write_body(self, f, length):
            if self.path.endswith("/shards/00001"):
                self.wfile.write(f.read(1000))
                started.set()
                gate.wait(10)
            super().write_body(f, length)

    class SlowServer(ShardServer):
        handler_class = Slow

    manifest = json.loads((root / "v000001" / "manifest.json").read_text())
    result = {}
    with SlowServer(root, busy_grace_s=0.0) as server:

        def download():
            try:
                download_shards(manifest, [server.url], tmp_path / "shards", parallel=1, timeout_s=10.0)
                result["ok"] = True
            except BroadcastError as e:
                result["error"] = e

        t = threading.Thread(target=download)
        t.start()
        assert started.wait(10)
        assert server.in_use(1) and not server.in_use(3)
        prune_versions(root, 1, in_use=server.in_use)
        assert read_versions(root) == [1, 4]
        gate.set()
        t.join(10)
        assert result == {"ok": True}
        # The server thread ends its response just after the client has read the last byte.
        wait_for(lambda: not server.in_use(1), 5, "v1 no longer in use", every=0.01)
        prune_versions(root, 1, in_use=server.in_use)
        assert read_versions(root) == [4]
    with ShardServer(root, busy_grace_s=30.0) as server:  # between one client's requests: still in use
        raw(server.url, "GET", "/v000004/shards/00000")
        assert server.in_use(4)


def test_a_mirror_serves_what_it_mirrored_origin_to_relay_to_client(origin, tmp_path):
    model, root, manifest = origin
    relay_root = tmp_path / "relay"
    with ShardServer(root) as o:
        origin_url = o.url
        mirrored = mirror_version(1, [closed_port_url(), o.url], relay_root, public_key=PUB, **FAST)
        assert mirrored == manifest
        assert fetch_manifest(1, [o.url], public_key=PUB) == manifest
    assert read_versions(relay_root) == [1]
    assert [p.name for p in relay_root.iterdir()] == ["v000001"]
    for i in range(len(manifest["shards"])):
        name = f"v000001/shards/{i:05d}"
        assert (relay_root / name).read_bytes() == (root / name).read_bytes()
    # Complete already: returns at once, the origin is not needed (it is closed now).
    assert mirror_version(1, [origin_url], relay_root, public_key=PUB, **FAST) == manifest
    with ShardServer(relay_root) as relay:
        relay2 = tmp_path / "relay2"
        mirror_version(1, [relay.url], relay2, public_key=PUB, **FAST)  # relays chain
        with ShardServer(relay2) as r2:
            got = fetch_version(1, [r2.url], tmp_path / "client", public_key=PUB, **FAST)
    assert same_files(got, model)
    assert json.loads((got / INSTALLED_MANIFEST).read_text()) == manifest


def test_fetch_version_keeps_the_newest_versions_and_replaces_a_republished_one(tmp_path):
    root, dest_root = tmp_path / "origin", tmp_path / "client"
    models = {v: fake_model(tmp_path / f"m{v}", kib=70, seed=v) for v in (1, 2, 3)}
    for v, m in models.items():
        publish_version(m, root, v, key=KEY, parent=v - 1, shard_size=SHARD)
    with ShardServer(root) as server:
        for v in (3, 1, 2):  # fetching an old version keeps it, even past `keep`
            assert same_files(fetch_version(v, [server.url], dest_root, public_key=PUB, keep=1, **FAST), models[v])
            assert sorted(p.name for p in dest_root.iterdir() if not p.name.startswith(".")) == (
                ["v000003"] if v == 3 else ["v000001", "v000003"] if v == 1 else ["v000002", "v000003"]
            )
        # The trainer resumes and republishes v2 with other weights: the client notices and refetches.
        unpublish_version(root, 2)
        new2 = fake_model(tmp_path / "new2", kib=90, seed=22)
        m2 = publish_version(new2, root, 2, key=KEY, parent=1, shard_size=SHARD)
        got = fetch_version(
            2, [server.url], dest_root, public_key=PUB, keep=2, expected_digest=manifest_digest(m2), **FAST
        )
        assert same_files(got, new2)


def test_a_stalled_source_times_out_and_moves_to_the_back(origin, tmp_path):
    model, root, manifest = origin
    release = threading.Event()

    class Stalled(ShardRequestHandler):
        def write_body(self, f, length):
            release.wait(10)  # headers sent, then nothing: the client's read times out

    class StalledServer(ShardServer):
        handler_class = Stalled

    scores = SourceScores()
    try:
        with StalledServer(root) as stalled, ShardServer(root) as good:
            t0 = time.monotonic()
            got = fetch_version(
                1,
                [stalled.url, good.url],
                tmp_path / "client",
                public_key=PUB,
                scores=scores,
                parallel=1,
                timeout_s=0.5,
            )
            assert same_files(got, model) and time.monotonic() - t0 < 5
            snap = scores.snapshot()
            assert snap[stalled.url]["failures"] == 1 and snap[stalled.url]["score"] < snap[good.url]["score"]
            assert "timed out" in snap[stalled.url]["last_error"]
    finally:
        release.set()


def test_concurrent_fetches_into_one_dest_root_agree(origin, tmp_path):
    model, root, manifest = origin
    out, errors = {}, []
    with ShardServer(root) as server:

        def client(i: int) -> None:
            try:
                out[i] = fetch_version(1, [server.url], tmp_path / "client", public_key=PUB, parallel=2, **FAST)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors == [] and sorted(out) == [0, 1, 2]
    assert all(p == tmp_path / "client" / "v000001" for p in out.values())
    assert same_files(tmp_path / "client" / "v000001", model)
    assert sorted(p.name for p in (tmp_path / "client").iterdir()) == [".shards", "v000001"]
    assert list((tmp_path / "client" / ".shards").iterdir()) == []


def test_max_bytes_per_s_caps_each_response(origin):
    _, root, _ = origin
    with ShardServer(root, max_bytes_per_s=400_000) as server:
        t0 = time.monotonic()
        status, _, body = raw(server.url, "GET", "/v000001/shards/00000")
        assert status == 200 and len(body) == SHARD and time.monotonic() - t0 >= SHARD / 400_000 * 0.9


# ---- a bounded server ---------------------------------------------------------------------------


def test_connections_over_the_bound_get_a_503_at_once_and_idle_ones_are_closed(origin, tmp_path):
    model, root, _ = origin
    with ShardServer(root, max_connections=4, client_timeout_s=1.0) as server:
        address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        base = threading.active_count()
        idle = [socket.create_connection(address) for _ in range(12)]  # each sends nothing
        # One address gets 3 of the 4 slots: the last is kept for addresses holding fewer than 2
        # (transport/connlimit.py; tests/integration/test_connection_limits.py has other sources).
        try:
            t0 = time.monotonic()
            refused = [read_until_closed(s, 2.0) for s in idle[3:]]
            # Refused at once (no thread, no slot): the accept loop never waits on anyone.
            assert time.monotonic() - t0 < 1.0
            assert all(r == b"" or r.startswith(b"HTTP/1.1 503") for r in refused), refused
            assert any(r.startswith(b"HTTP/1.1 503") for r in refused)
            assert threading.active_count() <= base + 3
            # The three that got a slot are closed after client_timeout_s, freeing it.
            held = [read_until_closed(s, 5.0) for s in idle[:3]]
            assert held == [b""] * 3 and time.monotonic() - t0 < 3.0
        finally:
            for s in idle:
                s.close()
        # A client trickling its request a byte at a time (each within the socket timeout) is
        # cut off when its request is not in after client_timeout_s, not kept alive by each byte.
        trickle = socket.create_connection(address)
        with dripping(trickle, b"GET /versions HTTP/1.0\r\nX-Padding: " + b"a" * 1000, every=0.2):
            t0 = time.monotonic()
            assert read_until_closed(trickle, 10.0) == b""
            assert 0.8 < time.monotonic() - t0 < 3.0
        # Every slot is free again: a normal download completes, and the threads are gone.
        got = fetch_version(1, [server.url], tmp_path / "client", public_key=PUB, parallel=4, **FAST)
        assert same_files(got, model)
        wait_for(lambda: threading.active_count() <= base, 5, f"the server's threads to end (back to {base})")


def test_a_client_refused_with_a_503_fetches_from_another_source(origin, tmp_path):
    model, root, _ = origin
    with ShardServer(root, max_connections=1, client_timeout_s=5.0) as busy, ShardServer(root) as free:
        address = ("127.0.0.1", int(busy.url.rsplit(":", 1)[1]))
        hog = socket.create_connection(address)  # holds busy's only slot
        try:
            time.sleep(0.1)
            assert raw(busy.url, "GET", "/versions")[0] == 503
            scores = SourceScores()
            got = fetch_version(1, [busy.url, free.url], tmp_path / "client", public_key=PUB, scores=scores, **FAST)
            assert same_files(got, model)
            assert "503" in scores.snapshot()[busy.url]["last_error"]
        finally:
            hog.close()
