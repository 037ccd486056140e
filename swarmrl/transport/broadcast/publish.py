"""The origin's side: cut a saved HF folder into signed, hashed shards under a broadcast root
(`publish_version`), list and prune the versions there."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.protocol.manifest import (
    FORMAT,
    MAX_SHARDS,
    BroadcastError,
    canonical,
    check_base,
    check_source,
    check_version,
    is_int,
    is_plain_name,
    manifest_digest,
    same_content,
    version_name,
)
from swarmrl.transport.broadcast.common import (
    CHUNK,
    VERSION_DIR,
    ShardWriter,
    active_temp_dirs,
    clean_temps,
    load_manifest_file,
    manifest_bytes,
    remove_dir,
    remove_old_versions,
    temp_name,
)
from swarmrl.transport.broadcast.patches import publish_patch

# ---- publishing ---------------------------------------------------------------------------------


def _model_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise BroadcastError(f"cannot publish: {model_dir} is not a directory (expected a saved HF model folder)")
    out = []
    for p in sorted(model_dir.iterdir(), key=lambda p: p.name):
        if p.name.startswith(".") or not p.is_file():
            continue
        if not is_plain_name(p.name):
            raise BroadcastError(
                f"cannot publish {p}: file names may only use letters, digits, '.', '_' and '-'; rename the file"
            )
        out.append(p)
    if not out:
        raise BroadcastError(f"cannot publish: {model_dir} holds no files (expected a saved HF model folder)")
    return out


def _split(paths: list[Path], shard_dir: Path | None, shard_size: int) -> tuple[list[dict], list[dict], int]:
    writer = ShardWriter(shard_dir, shard_size)
    files, offset = [], 0
    try:
        for p in paths:
            h, size = hashlib.sha256(), 0
            with open(p, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    writer.write(chunk)
            files.append({"name": p.name, "offset": offset, "size": size, "sha256": h.hexdigest()})
            offset += size
    finally:
        writer.close()
    return files, writer.shards, offset


def publish_version(
    model_dir,
    root,
    version: int,
    *,
    key,
    parent: int | None = None,
    shard_size: int = 1 << 20,
    base: dict | None = None,
    patch_from: dict | None = None,
    source: dict | None = None,
) -> dict:
    """Shard and sign HF folder `model_dir` as root/vNNNNNN (written whole, atomically); return the manifest.

    `patch_from` ({"dir": the previous version's HF folder, "manifest": its published manifest,
    "max_share": float}) also writes the patch from that version to this one (patches.py) into the
    folder before it appears, so no relay mirrors the version before its patch is there; skipped
    when the patch would be larger than max_share of the version.

    `base` ({"version": b, "digest": content_digest of version b's manifest}) marks the folder as
    a LoRA adapter that applies to version b: the manifest names it, under the signature.

    `source` ({"hub_id": ..., "revision": 40-hex commit}) names the Hub model the run started from,
    under the signature too.

    Versions are immutable: an existing root/vNNNNNN with the same content (same files, shard size,
    parent, base and key) is returned as is; with other content, BroadcastError (use unpublish_version
    first to replace it on purpose)."""
    check_version(version)
    if parent is not None:
        check_version(parent, "parent")
    if base is not None:
        check_base(base, version, lambda msg: BroadcastError(f"cannot publish {version_name(version)}: {msg}"))
    if source is not None:
        check_source(source, lambda msg: BroadcastError(f"cannot publish {version_name(version)}: {msg}"))
    if not is_int(shard_size) or shard_size <= 0:
        raise BroadcastError(f"shard_size must be a positive int (bytes), got {shard_size!r}")
    if not isinstance(key, Ed25519PrivateKey):
        raise BroadcastError(f"key must be an Ed25519PrivateKey (auth.load_or_create_key), got {type(key).__name__}")
    model_dir, root, vname = Path(model_dir), Path(root), version_name(version)
    paths = _model_files(model_dir)
    n = -(-sum(p.stat().st_size for p in paths) // shard_size)
    if n > MAX_SHARDS:
        raise BroadcastError(
            f"cannot publish {vname}: {n} shards of {shard_size} bytes, more than {MAX_SHARDS}; use a larger shard_size"
        )
    model_config: dict = {}
    if (model_dir / "config.json").is_file():
        try:
            model_config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise BroadcastError(f"cannot publish {vname}: {model_dir / 'config.json'} is not valid JSON ({e})") from e
        if not isinstance(model_config, dict):
            raise BroadcastError(f"cannot publish {vname}: {model_dir / 'config.json'} is not a JSON object")

    def sign(files, shards, total) -> dict:
        m = {
            "format": FORMAT,
            "version": version,
            "parent": parent,
            "created": time.time(),
            "model_config": model_config,
            "files": files,
            "shard_size": shard_size,
            "total_size": total,
            "shards": shards,
            "public_key": key.public_key().public_bytes_raw().hex(),
        }
        if base is not None:
            m["base"] = {"version": base["version"], "digest": base["digest"]}
        if source is not None:
            m["source"] = {"hub_id": source["hub_id"], "revision": source["revision"]}
        m["signature"] = key.sign(canonical(m)).hex()
        return m

    dest = root / vname

    def existing_or_refuse(new: dict) -> dict:
        if not (dest / "manifest.json").is_file():
            raise BroadcastError(
                f"cannot publish {vname}: {dest} exists but holds no manifest.json (not a complete "
                "version); delete it and publish again"
            )
        old = load_manifest_file(dest / "manifest.json")
        if same_content(old, new):
            return old
        raise BroadcastError(
            f"cannot publish {vname}: {dest} already holds a different {vname} (manifest digest "
            f"{manifest_digest(old)[:16]}...); versions are immutable: publish under a new version number, or "
            "call unpublish_version first to replace it"
        )

    if dest.exists():  # a dry run: hash only, write nothing
        try:
            return existing_or_refuse(sign(*_split(paths, None, shard_size)))
        except OSError as e:
            raise BroadcastError(f"cannot publish {vname}: cannot read {model_dir}: {e}") from e
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / temp_name("tmp", vname)
    (tmp / "shards").mkdir(parents=True)
    with active_temp_dirs() as active:
        active.add(tmp)
    try:
        try:
            manifest = sign(*_split(paths, tmp / "shards", shard_size))
            if patch_from is not None:
                publish_patch(
                    tmp,
                    model_dir,
                    patch_from["dir"],
                    base_manifest=patch_from["manifest"],
                    manifest=manifest,
                    key=key,
                    max_share=patch_from["max_share"],
                )
            (tmp / "manifest.json").write_bytes(manifest_bytes(manifest))
        except OSError as e:
            raise BroadcastError(f"cannot publish {vname} into {root}: {e}; check free space and permissions") from e
        try:
            os.rename(tmp, dest)
        except OSError:
            if dest.exists():  # another publisher finished first
                return existing_or_refuse(manifest)
            raise
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with active_temp_dirs() as active:
            active.discard(tmp)


def unpublish_version(root, version: int) -> bool:
    """Delete root/vNNNNNN (renamed aside first, so it vanishes whole); True if it was there.
    For a trainer that redoes steps after a resume and must replace a version number."""
    check_version(version)
    return remove_dir(Path(root) / version_name(version))


def published_manifest(root, version: int) -> dict | None:
    """The manifest of root/vNNNNNN as published there, or None when that version is not there."""
    check_version(version)
    path = Path(root) / version_name(version) / "manifest.json"
    return load_manifest_file(path) if path.is_file() else None


def read_versions(root) -> list[int]:
    """The complete versions under `root` (vNNNNNN folders holding a manifest.json), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if (m := VERSION_DIR.fullmatch(p.name)) and (p / "manifest.json").is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def prune_versions(root, keep: int, in_use=lambda version: False) -> None:
    """Keep the newest `keep` complete versions under `root`; delete the older ones except those
    `in_use(version)` says are being downloaded; remove temp folders of dead processes."""
    if not is_int(keep) or keep < 0:
        raise BroadcastError(f"keep must be a non-negative int, got {keep!r}")
    root = Path(root)
    versions = read_versions(root)
    clean_temps(root, below=versions[-keep] if keep and len(versions) >= keep else None)
    remove_old_versions(root, versions, keep, in_use)
