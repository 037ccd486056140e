"""Weight patches over real ShardServers on 127.0.0.1: a client or relay holding the version
before fetches the patch instead of the shards; a corrupted patch, a patch against another base
and a missing base each end with the right files, fetched in full."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from swarmrl.protocol.signing import public_key_hex
from swarmrl.transport.broadcast import (
    INSTALLED_MANIFEST,
    ShardRequestHandler,
    ShardServer,
    SourceScores,
    fetch_version,
    mirror_version,
    publish_version,
)

pytestmark = pytest.mark.timeout(60)

KEY = Ed25519PrivateKey.generate()
PUB = public_key_hex(KEY)
SHARD = 64 << 10
FAST = {"timeout_s": 2.0, "relay_wait_s": 0.0}


class Recording(ShardRequestHandler):
    def do_GET(self):
        self.server.owner.requests.append(self.path)
        super().do_GET()


class RecordingServer(ShardServer):
    handler_class = Recording

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.requests: list[str] = []


def model(folder: Path, seed: int, steps: int) -> Path:
    """A bfloat16 model folder after `steps` small signed updates (few bf16 values move per step)."""
    g = torch.Generator().manual_seed(seed)
    w = {"embed.weight": torch.randn(512, 96, generator=g) * 0.02, "norm.weight": torch.ones(96)}
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 + s)
        w = {k: v - 1e-5 * torch.randn(v.shape, generator=g).sign() for k, v in w.items()}
    folder.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "seed": seed}))
    return folder


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    return names == sorted(p.name for p in b.iterdir() if not p.name.startswith(".")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


@pytest.fixture
def versions(tmp_path):
    """v0 and v1 (one step apart) published at an origin root, v1 with its patch against v0."""
    m0, m1 = model(tmp_path / "m0", 0, 0), model(tmp_path / "m1", 0, 1)
    root = tmp_path / "origin"
    man0 = publish_version(m0, root, 0, key=KEY, shard_size=SHARD)
    man1 = publish_version(
        m1, root, 1, key=KEY, parent=0, shard_size=SHARD, patch_from={"dir": m0, "manifest": man0, "max_share": 0.5}
    )
    return {"m0": m0, "m1": m1, "root": root, "man1": man1}


def shard_requests(server, version: int) -> list[str]:
    return [p for p in server.requests if p.startswith(f"/v{version:06d}/shards/")]


def test_a_client_holding_the_version_before_fetches_only_the_patch(versions, tmp_path):
    root, man1 = versions["root"], versions["man1"]
    patch = root / "v000001" / "patch.bin"
    assert patch.is_file() and (root / "v000001" / "patch.json").is_file()
    assert patch.stat().st_size < 0.5 * man1["total_size"]
    client, logs = tmp_path / "client", []
    with RecordingServer(root) as o:
        fetch_version(0, [o.url], client, public_key=PUB, **FAST)
        got = fetch_version(1, [o.url], client, public_key=PUB, log=logs.append, **FAST)
        assert shard_requests(o, 1) == []
        assert "/v000001/patch.bin" in o.requests
    assert same_files(got, versions["m1"])
    assert json.loads((got / INSTALLED_MANIFEST).read_text()) == man1
    assert any("installed from v000000 and a patch" in m for m in logs), logs


def test_without_the_base_or_with_patches_off_the_shards_are_fetched(versions, tmp_path):
    with RecordingServer(versions["root"]) as o:
        got = fetch_version(1, [o.url], tmp_path / "empty", public_key=PUB, **FAST)  # no v0 held
        assert shard_requests(o, 1) and not any("patch" in p for p in o.requests)
        assert same_files(got, versions["m1"])
        o.requests.clear()
        fetch_version(0, [o.url], tmp_path / "off", public_key=PUB, **FAST)
        fetch_version(1, [o.url], tmp_path / "off", public_key=PUB, patches=False, **FAST)
        assert shard_requests(o, 1) and not any("patch" in p for p in o.requests)


def test_a_corrupted_patch_at_one_source_is_fetched_from_the_next_and_scored_down(versions, tmp_path):
    bad_root = tmp_path / "bad"
    shutil.copytree(versions["root"], bad_root)
    blob = bytearray((bad_root / "v000001" / "patch.bin").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (bad_root / "v000001" / "patch.bin").write_bytes(bytes(blob))
    client, scores = tmp_path / "client", SourceScores()
    with RecordingServer(bad_root) as bad, RecordingServer(versions["root"]) as good:
        fetch_version(0, [good.url], client, public_key=PUB, **FAST)
        got = fetch_version(1, [bad.url, good.url], client, public_key=PUB, scores=scores, **FAST)
        assert "/v000001/patch.bin" in bad.requests and "/v000001/patch.bin" in good.requests
        assert shard_requests(bad, 1) == shard_requests(good, 1) == []
        assert scores.snapshot()[bad.url]["bad_shards"] == 1
    assert same_files(got, versions["m1"])


def test_a_patch_against_another_base_is_not_used(versions, tmp_path):
    """The client holds a v0 of another publication (other weights): the descriptor names the
    base by content digest, so the patch is not even downloaded."""
    other_root = tmp_path / "other"
    publish_version(model(tmp_path / "other-m0", 7, 0), other_root, 0, key=KEY, shard_size=SHARD)
    client = tmp_path / "client"
    with ShardServer(other_root) as other, RecordingServer(versions["root"]) as o:
        fetch_version(0, [other.url], client, public_key=PUB, **FAST)
        got = fetch_version(1, [o.url], client, public_key=PUB, **FAST)
        assert "/v000001/patch.json" in o.requests and "/v000001/patch.bin" not in o.requests
        assert shard_requests(o, 1)
    assert same_files(got, versions["m1"])


def test_a_damaged_base_on_disk_rebuilds_wrong_files_and_falls_back(versions, tmp_path):
    client, logs = tmp_path / "client", []
    with RecordingServer(versions["root"]) as o:
        base = fetch_version(0, [o.url], client, public_key=PUB, **FAST)
        w = bytearray((base / "model.safetensors").read_bytes())
        w[-3] ^= 0x01  # the disk flipped a bit of a weight the step did not touch
        (base / "model.safetensors").write_bytes(bytes(w))
        got = fetch_version(1, [o.url], client, public_key=PUB, log=logs.append, **FAST)
        assert "/v000001/patch.bin" in o.requests and shard_requests(o, 1)
    assert same_files(got, versions["m1"])
    assert any("does not match the signed manifest" in m for m in logs), logs


def test_a_relay_holding_the_base_rebuilds_the_shards_from_the_patch_and_serves_it_on(versions, tmp_path):
    root, relay_root = versions["root"], tmp_path / "relay"
    with RecordingServer(root) as o:
        mirror_version(0, [o.url], relay_root, public_key=PUB, timeout_s=2.0)
        n = len(o.requests)
        assert mirror_version(1, [o.url], relay_root, public_key=PUB, timeout_s=2.0) == versions["man1"]
        assert shard_requests(o, 1) == [] and "/v000001/patch.bin" in o.requests[n:]
    for name in sorted(p.name for p in (root / "v000001" / "shards").iterdir()):
        assert (relay_root / "v000001" / "shards" / name).read_bytes() == (
            root / "v000001" / "shards" / name
        ).read_bytes()
    # A relay without the base mirrors the shards, and the patch too, for its own clients.
    relay2 = tmp_path / "relay2"
    with ShardServer(relay_root) as relay:
        mirror_version(1, [relay.url], relay2, public_key=PUB, timeout_s=2.0)
    assert (relay2 / "v000001" / "patch.bin").read_bytes() == (root / "v000001" / "patch.bin").read_bytes()
    client = tmp_path / "client"
    with RecordingServer(relay2) as r2, RecordingServer(relay_root) as r1:
        fetch_version(0, [r1.url], client, public_key=PUB, **FAST)
        got = fetch_version(1, [r2.url], client, public_key=PUB, **FAST)
        assert shard_requests(r2, 1) == [] and "/v000001/patch.bin" in r2.requests
    assert same_files(got, versions["m1"])


def test_a_version_whose_patch_would_be_too_large_is_published_without_one(tmp_path):
    m0, m1 = model(tmp_path / "m0", 0, 0), model(tmp_path / "m1", 3, 0)  # unrelated weights: all differ
    root = tmp_path / "origin"
    man0 = publish_version(m0, root, 0, key=KEY, shard_size=SHARD)
    publish_version(m1, root, 1, key=KEY, shard_size=SHARD, patch_from={"dir": m0, "manifest": man0, "max_share": 0.5})
    assert sorted(p.name for p in (root / "v000001").iterdir()) == ["manifest.json", "shards"]


def test_the_origin_is_not_asked_for_a_patch_its_relay_does_not_hold(versions, tmp_path):
    """A relay that mirrored v1 without its patch (patches off there) answers 404 for it: the
    client takes v1's shards from the relay, and the origin sees no request for v1 at all."""
    relay_root, client = tmp_path / "relay", tmp_path / "client"
    with RecordingServer(versions["root"]) as o:
        for v in (0, 1):
            mirror_version(v, [o.url], relay_root, public_key=PUB, timeout_s=2.0, patches=False)
        assert not (relay_root / "v000001" / "patch.bin").exists()
        with RecordingServer(relay_root) as relay:
            fetch_version(0, [relay.url, o.url], client, public_key=PUB, **FAST)
            o.requests.clear()
            got = fetch_version(1, [relay.url, o.url], client, public_key=PUB, **FAST)
            assert "/v000001/patch.json" in relay.requests and shard_requests(relay, 1)
        assert o.requests == []
    assert same_files(got, versions["m1"])


def test_a_worker_waits_for_a_relay_that_is_still_mirroring_the_version(versions, tmp_path):
    """Over a narrow link a version can take longer than `relay_wait_s` to reach the region's
    relay; a worker that then fetched it from the origin too would double the traffic on that
    link. A relay lists the versions it is mirroring as "incoming" (Relay sets its server's
    `incoming`), and the worker keeps waiting for those, up to `relay_wait_max_s`."""
    relay_root, client = tmp_path / "relay", tmp_path / "client"
    with RecordingServer(versions["root"]) as o:
        mirror_version(0, [o.url], relay_root, public_key=PUB, timeout_s=2.0)
        fetch_version(0, [o.url], client, public_key=PUB, **FAST)
        with RecordingServer(relay_root) as relay:
            relay.incoming = lambda: {1}
            assert httpx.get(relay.url + "/versions", timeout=5).json() == {"versions": [0], "incoming": [1]}

            def finish_mirror():
                time.sleep(1.5)
                mirror_version(1, [o.url], relay_root, public_key=PUB, timeout_s=2.0)
                relay.incoming = lambda: ()

            done = threading.Thread(target=finish_mirror)
            done.start()
            got = fetch_version(1, [relay.url, o.url], client, public_key=PUB, relay_wait_s=0.3, timeout_s=2.0)
            done.join()
            assert "/v000001/patch.bin" in relay.requests  # waited, then took it from the relay
        assert shard_requests(o, 1) == [] and o.requests.count("/v000001/patch.bin") == 1  # the relay's only
        assert same_files(got, versions["m1"])
        # A relay that never finishes is waited for up to relay_wait_max_s, then the origin serves.
        m2 = model(tmp_path / "m2", 0, 2)
        publish_version(m2, versions["root"], 2, key=KEY, shard_size=SHARD)
        with RecordingServer(relay_root) as relay:
            relay.incoming = lambda: {2}
            t0 = time.monotonic()
            got = fetch_version(
                2, [relay.url, o.url], client, public_key=PUB, relay_wait_s=0.3, relay_wait_max_s=2.0, timeout_s=2.0
            )
            assert 1.8 < time.monotonic() - t0 < 10
        assert same_files(got, m2)
