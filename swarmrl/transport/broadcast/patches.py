"""Patches on the wire and on disk: the origin writes root/vNNNNNN/patch.bin and its signed
patch.json beside the shards (`publish_patch`); relays and clients holding the version before it
fetch those two instead of the shards (`fetch_patch`), rebuild the files and check them against
the signed manifest (`rebuild_folder` for a worker's HF folder, `rebuild_shards` for a relay's
shard layout). Every failure here is a reason to download the full version, never a stop: the
callers (install.py) fall back and log why."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from swarmrl.protocol.manifest import BroadcastError, content_digest, version_name
from swarmrl.protocol.patch import PatchError, apply_patch, encode_patch, sign_descriptor, verify_descriptor
from swarmrl.transport.broadcast.common import ShardWriter, SourceFailure, atomic_write, load_manifest_file
from swarmrl.transport.broadcast.download import get_small

PATCH_BIN, PATCH_JSON = "patch.bin", "patch.json"
MAX_DESCRIPTOR_BYTES = 64 << 10


def publish_patch(
    vdir, new_dir, base_dir, *, base_manifest: dict, manifest: dict, key, max_share: float
) -> dict | None:
    """Write vdir/patch.bin (then patch.json, so a descriptor is never there without its patch)
    turning the files of `base_dir` (the version `base_manifest` describes) into those of `new_dir`
    (`manifest`'s version; vdir is its folder being published). None, writing nothing, when the
    patch would exceed `max_share` of the version's size (float32 weights: every element changes
    every step) or the base folder is gone."""
    new_dir, base_dir = Path(new_dir), Path(base_dir)
    want = {f["name"]: f["size"] for f in base_manifest["files"]}

    def read_base(name: str) -> bytes | None:
        p = base_dir / name
        return p.read_bytes() if name in want and p.is_file() and p.stat().st_size == want[name] else None

    try:
        blob = encode_patch(
            [f["name"] for f in manifest["files"]],
            lambda name: (new_dir / name).read_bytes(),
            read_base,
            max_bytes=int(max_share * manifest["total_size"]),
        )
    except OSError:
        return None  # the base folder was pruned meanwhile: the version goes out in full only
    if blob is None:
        return None
    d = sign_descriptor(key, manifest["version"], base_manifest["version"], base_manifest, manifest, blob)
    vdir = Path(vdir)
    atomic_write(vdir / PATCH_BIN, blob)
    atomic_write(vdir / PATCH_JSON, json.dumps(d, sort_keys=True).encode())
    return d


def fetch_patch(
    manifest: dict,
    base_manifest: dict | None,
    sources: list[str],
    scores,
    *,
    public_key: str,
    timeout_s: float,
    log,
    last_resort: str | None = None,
) -> tuple[dict, bytes] | None:
    """(descriptor, patch) from the first source, in the order given, whose descriptor is signed,
    for `manifest` and (unless None: a relay that only passes it on) based on `base_manifest`'s
    content, and whose patch has the descriptor's size and sha256. None when no source has one
    (the version was published without a patch, or against another base). `last_resort` (the
    origin, for a worker whose relays hold the version) is asked only when a source failed
    otherwise than by not having a patch: the relays mirror a version's patch with it."""
    vname = version_name(manifest["version"])
    failed = False
    for src in [*sources, last_resort]:
        if src is None or (src == last_resort and not failed):
            continue
        try:
            raw = get_small(src, f"/{vname}/{PATCH_JSON}", timeout_s, MAX_DESCRIPTOR_BYTES)
            try:
                d = verify_descriptor(json.loads(raw), public_key, manifest)
            except ValueError:
                raise SourceFailure("patch.json is not JSON", corrupt=True) from None
            if base_manifest is not None and (
                d["base"] != base_manifest["version"] or d["base_content"] != content_digest(base_manifest)
            ):
                return None  # a patch against another base: nothing to gain from other sources
            t0 = time.monotonic()
            blob = get_small(src, f"/{vname}/{PATCH_BIN}", timeout_s, d["size"])
            if len(blob) != d["size"] or hashlib.sha256(blob).hexdigest() != d["sha256"]:
                raise SourceFailure("patch.bin does not match its signed size and sha256", corrupt=True)
            scores.good(src, len(blob), time.monotonic() - t0)
            return d, blob
        except PatchError as e:
            failed = True
            scores.bad(src, str(e), corrupt=True)
            log(f"{vname}: {src} serves a bad patch descriptor ({e})")
        except SourceFailure as e:
            if "HTTP 404" in str(e):
                continue  # no patch there (or not the version yet): ask the next
            failed = True
            scores.bad(src, str(e), corrupt=e.corrupt)
            log(f"{vname}: no patch from {src} ({e})")
    return None


def _check(name: str, data: bytes, want: dict) -> None:
    if name not in want:
        raise PatchError(f"the patch writes {name!r}, which the signed manifest does not list")
    if len(data) != want[name]["size"] or hashlib.sha256(data).hexdigest() != want[name]["sha256"]:
        raise PatchError(f"{name!r} rebuilt from the patch does not match the signed manifest")


def rebuild_folder(blob: bytes, base_dir: Path, base_manifest: dict, manifest: dict, out: Path) -> None:
    """The new version's HF folder in `out`, from the base's folder and the patch, each file checked
    against `manifest`'s size and sha256; PatchError otherwise."""
    want = {f["name"]: f for f in manifest["files"]}
    sizes = {f["name"]: f["size"] for f in base_manifest["files"]}
    written = []

    def read_base(name: str) -> bytes | None:
        p = base_dir / name
        return p.read_bytes() if name in sizes and p.is_file() else None

    def write(name: str, data: bytes) -> None:
        _check(name, data, want)
        (out / name).write_bytes(data)
        written.append(name)

    apply_patch(blob, read_base, write)
    if sorted(written) != sorted(want):
        raise PatchError("the patch does not rebuild every file the signed manifest lists")


def read_span(shard_dir: Path, shard_size: int, offset: int, size: int) -> bytes:
    """Bytes offset..offset+size of a version's files, concatenated, from its shard folder."""
    out = bytearray()
    pos, end = offset, offset + size
    while pos < end:
        i = pos // shard_size
        n = min(end, (i + 1) * shard_size) - pos
        with open(shard_dir / f"{i:05d}", "rb") as f:
            f.seek(pos - i * shard_size)
            piece = f.read(n)
        if len(piece) != n:
            raise OSError(f"shard {i:05d} of {shard_dir} is shorter than its manifest says")
        out += piece
        pos += n
    return bytes(out)


def rebuild_shards(blob: bytes, base_vdir: Path, base_manifest: dict, manifest: dict, shard_dir: Path) -> None:
    """A relay's copy: the new version's shards in `shard_dir`, from the base's shards and the patch,
    each file and each shard checked against `manifest`; PatchError otherwise."""
    want = {f["name"]: f for f in manifest["files"]}
    spans = {f["name"]: (f["offset"], f["size"]) for f in base_manifest["files"]}
    order = [f["name"] for f in manifest["files"]]
    writer = ShardWriter(shard_dir, manifest["shard_size"])
    written: list[str] = []

    def read_base(name: str) -> bytes | None:
        if name not in spans:
            return None
        return read_span(base_vdir / "shards", base_manifest["shard_size"], *spans[name])

    def write(name: str, data: bytes) -> None:
        _check(name, data, want)
        if len(written) >= len(order) or order[len(written)] != name:
            raise PatchError("the patch does not write the files in the manifest's order")
        writer.write(data)
        written.append(name)

    try:
        apply_patch(blob, read_base, write)
    finally:
        writer.close()
    if written != order or writer.shards != manifest["shards"]:
        raise PatchError("the shards rebuilt from the patch do not match the signed manifest")


def held_base(root: Path, version: int, manifest_name: str) -> tuple[Path, dict] | None:
    """(folder, manifest) of version-1 in `root` if it is there whole, else None."""
    if version == 0:
        return None
    vdir = root / version_name(version - 1)
    path = vdir / manifest_name
    if not path.is_file():
        return None
    try:
        return vdir, load_manifest_file(path)
    except BroadcastError:
        return None
