"""Patches on the wire and on disk: the origin writes root/vNNNNNN/patch.bin and its signed
patch.json beside the shards (`publish_patch`); relays and clients holding the version before it
fetch those two instead of the shards (`fetch_patch`, the patch written to disk as it arrives),
rebuild the files and check them against the signed manifest (`rebuild_folder` for a worker's HF
folder, `rebuild_shards` for a relay's shard layout), streamed a chunk at a time, so memory
does not grow with the model. Every failure here is a reason to download the full version, never
a stop: the callers (install.py) fall back and log why."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from swarmrl.protocol.manifest import BroadcastError, content_digest, version_name
from swarmrl.protocol.patch import PatchError, encode_patch, patch_chunks, sign_descriptor, verify_descriptor
from swarmrl.transport.broadcast.common import ShardWriter, SourceFailure, atomic_write, load_manifest_file
from swarmrl.transport.broadcast.download import get_file, get_small, parse_json

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
    dest: Path,
    last_resort: str | None = None,
    progress=None,
) -> dict | None:
    """The descriptor of the patch now in the file `dest`, from the first source, in the order
    given, whose descriptor is signed, for `manifest` and (unless None: a relay that only passes
    it on) based on `base_manifest`'s content, and whose patch has the descriptor's size and
    sha256 (written to disk as it arrives, never held in memory). None when no source has one
    (the version was published without a patch, or against another base). `last_resort` (the
    origin, for a worker whose relays hold the version) is asked only when a source failed
    otherwise than by not having a patch: the relays mirror a version's patch with it.
    `progress(n)` is called with each chunk's length (a relay's mirroring progress)."""
    vname = version_name(manifest["version"])
    failed = False
    for src in [*sources, last_resort]:
        if src is None or (src == last_resort and not failed):
            continue
        try:
            raw = get_small(src, f"/{vname}/{PATCH_JSON}", timeout_s, MAX_DESCRIPTOR_BYTES)
            d = verify_descriptor(parse_json(raw, PATCH_JSON), public_key, manifest)
            if base_manifest is not None and (
                d["base"] != base_manifest["version"] or d["base_content"] != content_digest(base_manifest)
            ):
                return None  # a patch against another base: nothing to gain from other sources
            t0 = time.monotonic()
            if get_file(src, f"/{vname}/{PATCH_BIN}", timeout_s, d["size"], dest, progress) != d["sha256"]:
                raise SourceFailure("patch.bin does not match its signed size and sha256", corrupt=True)
            scores.good(src, d["size"], time.monotonic() - t0)
            return d
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


def _want(manifest: dict) -> dict[str, tuple[int, str | None]]:
    return {f["name"]: (f["size"], f["sha256"]) for f in manifest["files"]}


def _reader(f) -> Callable[[int, int], bytes]:
    fd = f.fileno()
    return lambda offset, n: os.pread(fd, n, offset)


def rebuild_folder(patch: Path, base_dir: Path, base_manifest: dict, manifest: dict, out: Path) -> None:
    """The new version's HF folder in `out`, from the base's folder and the patch file, streamed
    (patch_chunks: every file written as it is rebuilt, its size and sha256 checked against
    `manifest` on the way); PatchError otherwise, OSError for the disk."""
    listed = {f["name"] for f in base_manifest["files"]}
    with ExitStack() as stack:
        bases: dict[str, Callable[[int, int], bytes] | None] = {}

        def base(name: str):
            if name not in bases:
                p = base_dir / name
                bases[name] = _reader(stack.enter_context(open(p, "rb"))) if name in listed and p.is_file() else None
            return bases[name]

        def base_size(name: str) -> int | None:
            return None if base(name) is None else (base_dir / name).stat().st_size

        pf = stack.enter_context(open(patch, "rb"))
        dst = None
        try:
            for name, piece in patch_chunks(
                _reader(pf), os.fstat(pf.fileno()).st_size, _want(manifest), base_size, lambda n, o, k: base(n)(o, k)
            ):
                if dst is None:
                    dst = open(out / name, "wb")
                if piece is None:
                    dst.close()
                    dst = None
                else:
                    dst.write(piece)
        finally:
            if dst is not None:
                dst.close()


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


def rebuild_shards(
    patch: Path, base_vdir: Path, base_manifest: dict, manifest: dict, shard_dir: Path, progress=None
) -> None:
    """A relay's copy: the new version's shards in `shard_dir`, from the base's shards and the patch
    file, streamed (each file checked against `manifest` as it is cut into shards, each shard at
    the end); PatchError otherwise, OSError for the disk. `progress(n)` with each piece written."""
    order = [f["name"] for f in manifest["files"]]
    spans = {f["name"]: (f["offset"], f["size"]) for f in base_manifest["files"]}
    shards, shard_size = base_vdir / "shards", base_manifest["shard_size"]
    writer = ShardWriter(shard_dir, manifest["shard_size"])
    written: list[str] = []

    def read_base(name: str, offset: int, n: int) -> bytes:
        start, size = spans[name]
        return read_span(shards, shard_size, start + offset, max(0, min(n, size - offset)))

    try:
        with open(patch, "rb") as pf:
            for name, piece in patch_chunks(
                _reader(pf),
                os.fstat(pf.fileno()).st_size,
                _want(manifest),
                lambda name: spans[name][1] if name in spans else None,
                read_base,
            ):
                if piece is None:
                    written.append(name)
                else:
                    writer.write(piece)
                    if progress is not None:
                        progress(len(piece))
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
