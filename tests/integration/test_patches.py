"""Weight patches over real ShardServers on 127.0.0.1: a client or relay holding the version
before fetches the patch instead of the shards; a corrupted patch, a patch against another base
and a missing base each end with the right files, fetched in full."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from swarmrl.protocol.patch import MAGIC, sign_descriptor
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
from swarmrl.transport.broadcast.common import CHUNK

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


def growing(version: int):
    """A relay's `incoming`: `version` coming in, its bytes growing with time."""
    t0 = time.monotonic()
    return lambda: {version: 1 + int((time.monotonic() - t0) * 1e6)}


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
    link. A relay lists the versions it is mirroring as "incoming", with the bytes it holds of
    each (Relay sets its server's `incoming`), and the worker keeps waiting for those while the
    bytes grow, up to `relay_wait_max_s`."""
    relay_root, client = tmp_path / "relay", tmp_path / "client"
    with RecordingServer(versions["root"]) as o:
        mirror_version(0, [o.url], relay_root, public_key=PUB, timeout_s=2.0)
        fetch_version(0, [o.url], client, public_key=PUB, **FAST)
        with RecordingServer(relay_root) as relay:
            relay.incoming = growing(1)
            listing = httpx.get(relay.url + "/versions", timeout=5).json()
            assert listing["versions"] == [0] and listing["incoming"] == [1] and listing["progress"]["1"] > 0

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
        # A relay whose copy grows but never finishes is waited for up to relay_wait_max_s, then
        # the origin serves.
        m2 = model(tmp_path / "m2", 0, 2)
        publish_version(m2, versions["root"], 2, key=KEY, shard_size=SHARD)
        with RecordingServer(relay_root) as relay:
            relay.incoming = growing(2)
            t0 = time.monotonic()
            got = fetch_version(
                2, [relay.url, o.url], client, public_key=PUB, relay_wait_s=0.3, relay_wait_max_s=2.0, timeout_s=2.0
            )
            assert 1.8 < time.monotonic() - t0 < 10
        assert same_files(got, m2)


def test_a_relays_progress_figure_stays_within_the_versions_signed_size(versions, tmp_path):
    """Workers take a relay's progress figure above the version's signed total_size for a lie (no
    wait window: the review's F3), so a relay rebuilding a version from its patch, which counted
    the patch's bytes and then every rebuilt shard's, reports at most total_size."""
    relay_root, told = tmp_path / "relay", []
    with ShardServer(versions["root"]) as o:
        mirror_version(0, [o.url], relay_root, public_key=PUB, timeout_s=2.0)
        mirror_version(1, [o.url], relay_root, public_key=PUB, timeout_s=2.0, progress=told.append)
    assert (relay_root / "v000001" / "patch.bin").is_file()  # it came as a patch
    assert sum(told) == versions["man1"]["total_size"] and len(told) > 1, (sum(told), len(told))


# ---- malformed patches and memory (the hostile review) --------------------------------------------


KEEP_WEIGHTS = {"name": "model.safetensors", "op": "same"}


def forge_patch(root: Path, files: list[dict], sections: bytes) -> None:
    """Replace v1's patch at `root` with one of this header and these sections, signed by the
    trainer's key (what a buggy or compromised trainer publishes: the descriptor verifies)."""
    header = json.dumps({"files": files}).encode()
    blob = MAGIC + struct.pack("<I", len(header)) + header + sections
    man0, man1 = (json.loads((root / f"v00000{v}" / "manifest.json").read_text()) for v in (0, 1))
    d = sign_descriptor(KEY, 1, 0, man0, man1, blob)
    (root / "v000001" / "patch.bin").write_bytes(blob)
    (root / "v000001" / "patch.json").write_text(json.dumps(d, sort_keys=True))


def test_a_full_entry_declaring_2_63_bytes_falls_back_to_the_shards(versions, tmp_path):
    """The hostile review: a "full" entry of 2^63 bytes or more raised OverflowError out of
    zlib, which escaped the fall-back and failed the install. Now every declared size is checked
    against the signed manifest first, and any malformed patch is a PatchError: the shards."""
    z = zlib.compress(b"{}")
    forge_patch(
        versions["root"],
        [
            {"name": "config.json", "op": "full", "size": 2**63, "z": len(z)},
            {"name": "model.safetensors", "op": "same"},
        ],
        z,
    )
    client, logs = tmp_path / "client", []
    with RecordingServer(versions["root"]) as o:
        fetch_version(0, [o.url], client, public_key=PUB, **FAST)
        got = fetch_version(1, [o.url], client, public_key=PUB, log=logs.append, **FAST)
        assert "/v000001/patch.bin" in o.requests and shard_requests(o, 1)
    assert same_files(got, versions["m1"])
    assert any("declares 9223372036854775808 bytes; the signed manifest says" in m for m in logs), logs


def test_a_header_declaring_more_than_the_manifest_is_refused_before_anything_is_allocated(versions, tmp_path):
    """The hostile review: memory was bounded by the sizes the patch header declares, not by the
    signed manifest: config.json (a few dozen bytes) declared as 64 MiB of zeros was inflated
    whole before its sha256 was checked. Now the header is refused before any section is read."""
    bomb = zlib.compressobj(1)
    z = b"".join(bomb.compress(bytes(1 << 20)) for _ in range(64)) + bomb.flush()
    forge_patch(
        versions["root"],
        [
            {"name": "config.json", "op": "full", "size": 64 << 20, "z": len(z)},
            {"name": "model.safetensors", "op": "same"},
        ],
        z,
    )
    del bomb
    client, logs = tmp_path / "client", []
    with RecordingServer(versions["root"]) as o:
        fetch_version(0, [o.url], client, public_key=PUB, **FAST)
        tracemalloc.start()
        try:
            got = fetch_version(1, [o.url], client, public_key=PUB, log=logs.append, **FAST)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert "/v000001/patch.bin" in o.requests and shard_requests(o, 1)
    assert same_files(got, versions["m1"])
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB traced: the 64 MiB the header declares was allocated"
    assert any(f"declares {64 << 20} bytes; the signed manifest says" in m for m in logs), logs


def bf16_model(folder: Path, mib: int, changed: float) -> Path:
    """One bfloat16 tensor of `mib` MiB (written without torch); with `changed`, that share of its
    elements moved by one ulp, as a small training step does."""
    n = (mib << 20) // 2
    w = np.random.default_rng(0).integers(0x3C00, 0xBC00, size=n, dtype=np.uint16)
    if changed:
        w[np.random.default_rng(1).choice(n, size=int(changed * n), replace=False)] += 1
    header = json.dumps({"w": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + w.tobytes())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return folder


MEASURE = """
import json, resource, sys, tracemalloc
from swarmrl.transport.broadcast import fetch_version, mirror_version
origin, pub, tmp = sys.argv[1:4]
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
for where in ("a", "b"):
    fetch_version(0, [origin], f"{tmp}/client-{where}", public_key=pub, relay_wait_s=0)
mirror_version(0, [origin], f"{tmp}/relay", public_key=pub)
logs, out = [], {}
before = rss()
fetch_version(1, [origin], f"{tmp}/client-a", public_key=pub, relay_wait_s=0, log=logs.append)
out["worker_rss_growth"] = rss() - before
for who, install in (
    ("worker", lambda: fetch_version(1, [origin], f"{tmp}/client-b", public_key=pub, relay_wait_s=0, log=logs.append)),
    ("relay", lambda: mirror_version(1, [origin], f"{tmp}/relay", public_key=pub, log=logs.append)),
):
    tracemalloc.start()
    install()
    out[f"{who}_traced_peak"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
out["logs"] = logs
print(json.dumps(out))
"""


def test_an_honest_patch_install_holds_a_few_chunks_not_the_file(tmp_path):
    """The hostile review: an honest patch install peaked at 3x the file (the base read whole, a
    copy patched, the result), worker and relay alike. Now it streams through disk: measured in a
    child process, both stay within a small multiple of the chunk, far below the file."""
    mib = 32
    m0, m1 = bf16_model(tmp_path / "m0", mib, 0.0), bf16_model(tmp_path / "m1", mib, 0.03)
    size = (m1 / "model.safetensors").stat().st_size
    root = tmp_path / "origin"
    man0 = publish_version(m0, root, 0, key=KEY, shard_size=4 << 20)
    publish_version(m1, root, 1, key=KEY, parent=0, shard_size=4 << 20,
                    patch_from={"dir": m0, "manifest": man0, "max_share": 0.5})  # fmt: skip
    assert (root / "v000001" / "patch.bin").is_file()
    with ShardServer(root) as o:
        run = subprocess.run(
            [sys.executable, "-c", MEASURE, o.url, PUB, str(tmp_path)], capture_output=True, text=True, timeout=120
        )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert sum("installed from v000000 and a patch" in m for m in got["logs"]) == 2, got["logs"]
    assert same_files(tmp_path / "client-b" / "v000001", m1)
    for who in ("worker", "relay"):
        peak = got[f"{who}_traced_peak"]
        assert peak < size / 8 and peak < 16 * CHUNK, f"{who}: {peak / 2**20:.1f} MiB traced for a {mib} MiB file"
    assert got["worker_rss_growth"] < size / 2, f"RSS grew {got['worker_rss_growth'] / 2**20:.1f} MiB"
