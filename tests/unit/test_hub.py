"""model.path as a Hub id: resolved from a Hugging Face cache laid out here (offline, nothing
fetched), the commit pinned, and the source signed into a version's manifest."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from huggingface_hub import constants

from swarmrl.config import load_config
from swarmrl.model.checkpoint import build_tiny_policy, save_policy
from swarmrl.model.hub import HubError, hub_source, is_hub_id, resolve
from swarmrl.protocol.manifest import BroadcastError, check_manifest_shape, verify_manifest
from swarmrl.transport.broadcast import publish_version

from hub_cache import lay_out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding the tiny model as Org/Tiny (main and a tag)."""
    model, tok = build_tiny_policy(seed=0)
    folder = save_policy(model, tok, tmp_path / "tiny")
    hub = tmp_path / "hub"
    commit = lay_out(hub, "Org/Tiny", folder)
    lay_out(hub, "Org/Tiny", folder, branch="v1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub, commit, folder


def test_a_hub_id_resolves_to_its_snapshot_and_commit_from_the_cache(cache):
    hub, commit, folder = cache
    for revision in (None, "main", "v1", commit):
        r = resolve("Org/Tiny", revision)
        assert r.commit == commit and r.repo_id == "Org/Tiny"
        assert r.folder == hub / "models--Org--Tiny" / "snapshots" / commit
        assert (r.folder / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    assert r.source == {"hub_id": "Org/Tiny", "revision": commit}
    # A local folder is itself, with no source to sign.
    local = resolve(str(folder))
    assert local.folder == folder and local.source is None and not is_hub_id(str(folder))


@pytest.mark.parametrize(
    ("path", "revision", "needles"),
    [
        ("Org/Missing", None, ["Org/Missing is not in the Hugging Face cache", "HF_HUB_OFFLINE is set", "hf download"]),
        ("Org/Tiny", "v9", ["Org/Tiny@v9 is not in the Hugging Face cache", "--revision v9"]),
        ("no/such/folder", None, ["'no/such/folder' is not a folder here, nor a Hugging Face Hub id"]),
    ],
)
def test_an_id_missing_offline_is_refused_naming_the_id_and_the_cache(cache, path, revision, needles):
    hub = cache[0]
    with pytest.raises(HubError) as info:
        resolve(path, revision)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    if path.count("/") == 1:
        assert str(hub) in str(info.value)


def test_a_revision_with_a_local_folder_is_refused(cache):
    with pytest.raises(HubError, match="model.revision 'main' is for a Hub id"):
        resolve(str(cache[2]), "main")


def test_the_pinned_commit_is_signed_into_every_version(cache, tmp_path):
    hub, commit, folder = cache
    cfg = load_config(None, ["--model.path", "Org/Tiny", "--model.revision", commit])
    assert hub_source(cfg) == {"hub_id": "Org/Tiny", "revision": commit}
    # Not pinned yet (a branch), or not a Hub id: nothing to sign.
    assert hub_source(load_config(None, ["--model.path", "Org/Tiny", "--model.revision", "main"])) is None
    assert hub_source(load_config(None, ["--model.path", str(folder)])) is None
    key = Ed25519PrivateKey.generate()
    manifest = publish_version(folder, tmp_path / "broadcast", 0, key=key, source=hub_source(cfg))
    assert manifest["source"] == {"hub_id": "Org/Tiny", "revision": commit}
    public = key.public_key().public_bytes_raw().hex()
    verify_manifest(manifest, public)
    # The source is under the signature: pointing the version at other weights breaks it.
    forged = json.loads(json.dumps(manifest))
    forged["source"]["revision"] = "f" * 40
    with pytest.raises(BroadcastError):
        verify_manifest(forged, public)
    for bad in (
        {"hub_id": "Org/Tiny"},
        {"hub_id": "Org/Tiny", "revision": "main"},
        {"hub_id": "x", "revision": commit},
    ):
        with pytest.raises(BroadcastError, match="source"):
            check_manifest_shape({**manifest, "source": bad}, "test")
