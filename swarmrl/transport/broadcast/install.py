"""Putting a downloaded version in place: `mirror_version` (a relay keeps the shard layout and
serves it on) and `fetch_version` (a worker or validator rebuilds the HF folder), both resumable
and renamed into place whole."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from swarmrl.protocol.manifest import (
    BroadcastError,
    check_public_key,
    check_version,
    is_int,
    manifest_digest,
    verify_manifest,
    version_name,
)
from swarmrl.transport.broadcast.common import (
    CHUNK,
    INSTALLED_MANIFEST,
    MAX_MANIFEST_BYTES,
    TEMP_DIR,
    VERSION_DIR,
    active_temp_dirs,
    atomic_write,
    check_sources,
    clean_temps,
    load_manifest_file,
    manifest_bytes,
    pid_alive,
    remove_dir,
    remove_old_versions,
    sha256_file,
    temp_name,
)
from swarmrl.transport.broadcast.download import SourceScores, download_shards, fetch_manifest, incoming
from swarmrl.transport.broadcast.patches import (
    PATCH_BIN,
    PATCH_JSON,
    fetch_patch,
    held_base,
    rebuild_folder,
    rebuild_shards,
)


def _checked_request(version, public_key, sources, doing: str, why: str) -> tuple[str, list[str]]:
    """The version's folder name and the checked sources of a request to mirror or fetch it;
    BroadcastError (its message starting with `doing` and the version) for a bad version, a
    missing or malformed trainer key, or bad sources."""
    check_version(version)
    vname = version_name(version)
    if public_key is None:
        raise BroadcastError(
            f"{doing} {vname}: public_key is required (the trainer's key, <run-dir>/trainer.pub): {why}"
        )
    check_public_key(public_key, f"{doing} {vname}")
    return vname, check_sources(sources, f"{doing} {vname}")


def _claim_partial(root: Path, vname: str, digest: str) -> Path:
    fresh = root / temp_name("tmp", vname)
    with active_temp_dirs() as active:
        for p in sorted(root.glob(f".tmp-{vname}-*")):
            m = TEMP_DIR.fullmatch(p.name)
            if m is None or p in active or not (p / ".digest").is_file():
                continue
            pid = int(m.group(1))
            if pid != os.getpid() and pid_alive(pid):
                continue  # another live process is working on it
            try:
                os.rename(p, fresh)  # only one claimer wins
            except OSError:
                continue
            try:
                same = (fresh / ".digest").read_text() == digest
            except OSError:
                same = False
            if not same:  # a different publication of this version number
                shutil.rmtree(fresh / "shards", ignore_errors=True)
            break
        (fresh / "shards").mkdir(parents=True, exist_ok=True)
        (fresh / ".digest").write_text(digest)
        active.add(fresh)
    return fresh


def _mirror(
    version: int,
    manifest: dict,
    sources: list[str],
    root: Path,
    *,
    scores,
    parallel: int,
    timeout_s: float,
    log,
    tries_per_shard: int | None = None,
    build=None,
    progress=None,
) -> dict:
    """Download `manifest`'s shards into root/vNNNNNN (resuming a partial copy), or, with `build`,
    call build(tmp) to write them and anything else the folder should hold, then rename it in.
    `progress(n)`: see download_shards."""
    vname = version_name(version)
    vdir = root / vname
    if (vdir / "manifest.json").is_file():
        return load_manifest_file(vdir / "manifest.json")
    root.mkdir(parents=True, exist_ok=True)
    digest = manifest_digest(manifest)
    tmp = _claim_partial(root, vname, digest)
    try:
        if build is None:
            download_shards(
                manifest,
                sources,
                tmp / "shards",
                scores=scores,
                parallel=parallel,
                timeout_s=timeout_s,
                log=log,
                tries_per_shard=tries_per_shard,
                progress=progress,
            )
        else:
            build(tmp)
        (tmp / ".digest").unlink(missing_ok=True)
        for leftover in (tmp / "shards").glob("*.part"):
            leftover.unlink(missing_ok=True)
        (tmp / "manifest.json").write_bytes(manifest_bytes(manifest))
        # Other fetchers into the same root may finish first, and may remove their copy again
        # (fetch_version deletes the shard copy once the files are rebuilt): a few rounds settle it.
        for _ in range(5):
            try:
                os.rename(tmp, vdir)
                return manifest
            except OSError:
                pass
            try:
                existing = load_manifest_file(vdir / "manifest.json")
            except (BroadcastError, OSError):
                time.sleep(0.05)  # gone again, or still being moved: try the rename once more
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            if manifest_digest(existing) == digest:
                return existing
            raise BroadcastError(
                f"cannot mirror {vname} into {root}: it already holds another {vname} "
                f"(digest {manifest_digest(existing)[:16]}...); delete {vdir} to replace it"
            )
        raise BroadcastError(
            f"cannot mirror {vname}: {vdir} exists but is not a complete version; delete it and try again"
        )
    except OSError as e:
        raise BroadcastError(f"cannot mirror {vname} into {root}: {e}; check free space and permissions") from e
    finally:
        with active_temp_dirs() as active:
            active.discard(tmp)


def mirror_version(
    version: int,
    sources: list[str],
    root,
    *,
    public_key: str,
    scores=None,
    parallel: int = 4,
    timeout_s: float = 10.0,
    log=lambda msg: None,
    expected_digest: str | None = None,
    patches: bool = True,
    progress=None,
) -> dict:
    """Mirror `version` from `sources` into root/vNNNNNN (the origin's layout, so a ShardServer on
    `root` serves it: relays chain). The manifest must verify against `public_key` (the trainer's;
    required), every shard against its sha256; a failed call leaves its partial shards for the
    next call to resume. Returns the manifest; a complete copy already there is returned at once
    if it still verifies (unless `expected_digest` is given and it differs: then it is replaced).
    With `patches`, a version published with a patch is rebuilt from the version before it when
    that is held here (patches.py), and its patch is kept to be served on either way.
    `progress(n)` is called, from the download threads too, with the length of every chunk of
    the version written here (shards, patch, rebuilt shards): a relay lists the sum in GET
    /versions so that its clients can tell a copy coming in from a claim (_prefer_relays)."""
    # A mirror of an unsigned version would be served on to clients that then refuse it (or,
    # worse, to a chained relay): a relay holds only what the trainer signed.
    vname, sources = _checked_request(
        version, public_key, sources, "mirroring", "relays never mirror versions they cannot verify"
    )
    root = Path(root)
    vdir = root / vname
    if (vdir / "manifest.json").is_file():
        try:
            held = load_manifest_file(vdir / "manifest.json")
            if expected_digest is None or manifest_digest(held) == expected_digest:
                verify_manifest(held, public_key, version)
                return held
        except BroadcastError as e:  # from before the key was required, or damaged: fetched again
            log(f"{vname}: the copy in {vdir} does not verify ({e}); replacing it")
        remove_dir(vdir)
    scores = SourceScores() if scores is None else scores
    manifest = fetch_manifest(
        version,
        scores.order(sources),
        public_key=public_key,
        timeout_s=timeout_s,
        expected_digest=expected_digest,
        scores=scores,
    )
    progress = _capped(progress, manifest["total_size"])
    kw = dict(scores=scores, parallel=parallel, timeout_s=timeout_s, log=log)
    if not patches:
        return _mirror(version, manifest, sources, root, progress=progress, **kw)
    # Holding the version before it, a relay fetches the patch and rebuilds the shards; otherwise
    # the shards, and then the patch anyway, to serve it on to its clients. All of it inside the
    # temp folder that becomes the version's, so the patch goes to disk as it arrives.
    base = held_base(root, version, "manifest.json")

    def build(tmp: Path) -> None:
        shards = tmp / "shards"
        d = fetch_patch(
            manifest,
            base[1] if base else None,
            scores.order(sources),
            scores,
            public_key=public_key,
            timeout_s=timeout_s,
            log=log,
            dest=tmp / PATCH_BIN,
            progress=progress,
        )
        if d is not None and base is not None:
            _clear(shards)  # a partial download of this version: not needed now
            try:
                rebuild_shards(tmp / PATCH_BIN, base[0], base[1], manifest, shards, progress)
                (tmp / PATCH_JSON).write_bytes(json.dumps(d, sort_keys=True).encode())
                return
            except Exception as e:  # noqa: BLE001 - a patch is only a shortcut: any failure means the shards
                log(f"{vname}: the patch did not rebuild it ({type(e).__name__}: {e}); fetching its shards")
                _clear(shards)
                d = None  # not served on either: it did not rebuild here
        download_shards(manifest, sources, shards, progress=progress, **kw)
        if d is None:
            (tmp / PATCH_BIN).unlink(missing_ok=True)  # none, or a partial one of an earlier try
        else:
            (tmp / PATCH_JSON).write_bytes(json.dumps(d, sort_keys=True).encode())

    return _mirror(version, manifest, sources, root, build=build, **kw)


def _capped(progress, total: int):
    """`progress`, told of at most `total` bytes in all: a relay's figure for a version stays within
    the size its clients know from the signed manifest (a patch and the shards rebuilt from it, or
    a shard fetched again, would count twice), so that they can take a figure above it for the lie
    it is (relay_window)."""
    if progress is None:
        return None
    lock, told = threading.Lock(), [0]

    def add(n: int) -> None:
        with lock:
            n = max(0, min(n, total - told[0]))
            told[0] += n
        if n:
            progress(n)

    return add


def _clear(folder: Path) -> None:
    for p in folder.iterdir():
        p.unlink()


def _listing(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file()), key=lambda p: p.name)


def _folder_matches(folder: Path, manifest: dict) -> bool:
    """The folder holds exactly the manifest's files with their sizes and sha256 (re-hashed)."""
    try:
        paths = _listing(folder)
        if [p.name for p in paths] != sorted(f["name"] for f in manifest["files"]):
            return False
        want = {f["name"]: (f["size"], f["sha256"]) for f in manifest["files"]}
        return all(p.stat().st_size == want[p.name][0] and sha256_file(p) == want[p.name] for p in paths)
    except OSError:
        return False


def _assemble(manifest: dict, shard_dir: Path, out: Path) -> str | None:
    """Rebuild the files from the shards into `out`; None, or the name of a file that could not be
    rebuilt (a shard shorter than the manifest says).

    The files are not hashed again here: every shard was checked against the signed manifest as
    it arrived, and a file is the concatenation of its shards' bytes. (A cached folder is
    re-checked against the files' sha256 before it is reused, in _folder_matches.) The bytes are
    copied inside the kernel where the OS allows (copy_file_range), since on a fast link this
    copy costs as much as the download.
    """
    shard_size = manifest["shard_size"]
    for f in manifest["files"]:
        pos, end = f["offset"], f["offset"] + f["size"]
        with open(out / f["name"], "wb") as dst:
            while pos < end:
                i = pos // shard_size
                n = min(end, (i + 1) * shard_size) - pos
                with open(shard_dir / f"{i:05d}", "rb") as src:
                    if os.fstat(src.fileno()).st_size < pos - i * shard_size + n:
                        return f["name"]
                    _copy_range(src, dst, pos - i * shard_size, n)
                pos += n
    return None


def _copy_range(src, dst, offset: int, n: int) -> None:
    """Append n bytes of src from offset to dst."""
    copy = getattr(os, "copy_file_range", None)
    if copy is not None:
        dst.flush()
        left, off = n, offset
        try:
            while left:
                done = copy(src.fileno(), dst.fileno(), left, off)
                if done <= 0:
                    break
                left -= done
                off += done
            if not left:
                dst.seek(0, os.SEEK_END)
                return
        except OSError:
            pass  # not supported between these files: fall back to a plain copy of what is left
        offset, n = off, left
        dst.seek(0, os.SEEK_END)
    src.seek(offset)
    while n:
        chunk = src.read(min(CHUNK, n))
        if not chunk:
            raise OSError(f"shard {src.name} ended early")
        dst.write(chunk)
        n -= len(chunk)


RELAY_STALL_S = 10.0  # see fetch_version's relay_stall_s


def relay_window(
    seen: dict[int, int] | None,
    until: float,
    listed: dict[int, int | None],
    *,
    version: int,
    now: float,
    stall_s: float,
    delivered: bool,
    total_size: int | None = None,
    penalized: bool = False,
) -> tuple[dict[int, int], float] | None:
    """One poll of a relay's "incoming" list while a worker waits for `version`: the relay's new
    (figures seen, time until which it is waited for), or None while it has listed no copy of
    `version` or older.

    `seen` (None before such a listing) holds the largest progress figure seen per version, and
    `until` when the relay stops being waited for unless its copy shows progress. Relays are
    untrusted and "incoming" costs them nothing to say, so it is believed only while it shows
    progress: each poll on which a figure grows moves `until` to now + stall_s. The first listing
    opens a window of stall_s if the relay gives a figure (a relay of this release) or has
    delivered to this worker before (relays of older releases give none); otherwise the relay is
    not waited for at all. A relay past its window stays dropped for the rest of the wait (the
    caller stops polling it), so listing, unlisting and relisting does not restart its clock.

    No window at all (closed now) for a relay `penalized` in the worker's SourceScores (it failed
    recently, or made this worker wait for nothing before), nor for one whose figure for `version`
    is above its `total_size` (from the signed manifest, when known): a lie."""
    mine = {v: n for v, n in listed.items() if v <= version}
    lying = total_size is not None and (mine.get(version) or 0) > total_size
    if penalized or lying:
        return None if seen is None and not mine else (dict(seen or {}), now)
    if seen is None:
        if not mine:
            return None
        figures = {v: n for v, n in mine.items() if n is not None}
        return figures, now + stall_s if figures or delivered else now
    grew = False
    figures = dict(seen)
    for v, n in mine.items():
        if n is not None and n > figures.get(v, 0):
            figures[v], grew = n, True
    return figures, (now + stall_s if grew else until)


def _prefer_relays(
    version: int,
    sources: list[str],
    scores,
    *,
    public_key: str,
    timeout_s: float,
    expected_digest: str | None,
    wait_s: float,
    max_wait_s: float,
    stall_s: float,
    known: dict | None = None,
) -> tuple[dict, list[str]]:
    """(the manifest, the sources to download its shards from), relays first.

    `sources` is [relays..., origin]. A worker learns of a version from its lease as soon as the
    trainer publishes it, usually before the relays have mirrored it (they poll every 0.5 s), and
    went straight to the origin: in hand-started runs 36 of 37 downloads came from it (issue 18).
    So the relays are asked again for up to `wait_s` before the origin is, and then, up to
    `max_wait_s` in all, while a relay lists this version or an older one as incoming and its copy
    grows (it is mirroring them: over a narrow link that takes longer than `wait_s`, and fetching
    from the origin too would load that link twice). Each relay is waited for only while its
    progress figures grow within `stall_s` (relay_window): a relay that lists versions as
    incoming and never brings them costs a worker `wait_s` (+ `stall_s` if it gives a figure or
    delivered before), not `max_wait_s`. When a relay has the version, its shards come from the
    relays, the origin only if they all fail.

    Relays are untrusted, so every request to them ends by start + `max_wait_s` however slowly
    they answer; a relay that fails a request, or was waited for and did not bring the version,
    is marked bad in `scores` and, while penalized, neither asked first nor waited for. `known`
    (the manifest of this version, verified: the worker has it from the orchestrator) bounds a
    relay's manifest to about its size, and is used as is when the version comes from the origin."""
    vname = version_name(version)

    def from_all() -> dict:
        # Best first: a relay that just failed comes after the origin.
        if known is not None:
            return known
        return fetch_manifest(
            version,
            scores.order(sources),
            public_key=public_key,
            timeout_s=timeout_s,
            expected_digest=expected_digest,
            scores=scores,
        )

    relays = [r for r in sources[:-1] if not scores.penalized(r)]
    if not relays:
        return from_all(), sources
    start = time.monotonic()
    deadline = start + max_wait_s
    limit = MAX_MANIFEST_BYTES if known is None else 2 * len(manifest_bytes(known)) + 4096
    windows: dict[str, tuple[dict[int, int], float]] = {}
    waited: set[str] = set()  # relays that had a window: each one made this worker wait
    while True:
        try:
            manifest = fetch_manifest(
                version,
                scores.order(relays),
                public_key=public_key,
                timeout_s=timeout_s,
                expected_digest=expected_digest,
                scores=scores,
                deadline=deadline,
                limit=limit,
            )
            return manifest, relays
        except BroadcastError as e:
            # Wait only while every relay says "not here yet" (404); a relay that is down, slow or
            # lying is no reason to wait: the others and the origin are tried at once.
            if str(e).count("HTTP 404") < len(relays):
                break
        now = time.monotonic()
        if now >= deadline:
            break
        if now >= start + wait_s:
            for r in relays:
                if r in windows and windows[r][1] <= now:
                    continue  # dropped: its copy showed no progress for stall_s
                seen, until = windows.get(r, (None, 0.0))
                w = relay_window(
                    seen,
                    until,
                    incoming(r, timeout_s, deadline, scores),
                    version=version,
                    now=now,
                    stall_s=stall_s,
                    delivered=scores.delivered(r),
                    total_size=None if known is None else known["total_size"],
                    penalized=scores.penalized(r),
                )
                if w is not None:
                    windows[r] = w
                    if w[1] > now:
                        waited.add(r)
            if not any(until > now for _, until in windows.values()):
                break
        time.sleep(0.25)
        if time.monotonic() >= deadline:
            break
    # The version comes from elsewhere: the relays that made this worker wait for it are not
    # waited for again while penalized (one that fakes growing figures cost max_wait_s each time).
    for r in waited:
        scores.bad(r, f"listed {vname} as incoming and did not bring it within the wait")
    return from_all(), sources


def fetch_version(
    version: int,
    sources: list[str],
    dest_root,
    *,
    public_key: str,
    scores=None,
    keep: int = 2,
    parallel: int = 4,
    timeout_s: float = 10.0,
    log=lambda msg: None,
    expected_digest: str | None = None,
    relay_wait_s: float = 5.0,
    relay_wait_max_s: float = 120.0,
    relay_stall_s: float = RELAY_STALL_S,
    patches: bool = True,
    manifest: dict | None = None,
) -> Path:
    """Fetch policy `version` from `sources` (relays and/or the origin) into dest_root/vNNNNNN, an
    HF folder ready for from_pretrained, and return that path.

    The manifest must be signed by `public_key` (the trainer's; required). Shards are mirrored into
    dest_root/.shards/ (a failed call leaves them there for the next call to resume), the files
    rebuilt in a temp folder and checked against the manifest's sha256, the folder renamed into
    place whole, the shard copy deleted, and only the newest `keep` versions (plus this one) kept.
    A folder already there with the manifest's file hashes is returned without downloading.
    `expected_digest` (manifest_digest of the manifest the orchestrator announced) skips sources
    holding another publication of the same version number. The last source is the origin: it
    is used only when no relay has the version after `relay_wait_s`, or, up to `relay_wait_max_s`
    in all, while a relay lists it (or an older one) as incoming and the bytes it reports for them
    grow at least once every `relay_stall_s` (`_prefer_relays`; 10 s by default, above the 8 s a
    256 KiB chunk takes at the slowest rate a source is allowed, MIN_RATE). With
    `patches`, a version published with a patch is rebuilt from the version before it when that
    is held here, the full download being the fallback for every failure (patches.py).
    `manifest`, the version's signed manifest when the caller has it (a worker has it from the
    orchestrator), is used once it verifies (and has `expected_digest`, if given): then the
    relays' copies are bounded by its size and the origin is not asked for it."""
    vname, sources = _checked_request(
        version, public_key, sources, "fetching", "workers never accept unsigned versions"
    )
    if not is_int(keep) or keep < 0:
        raise BroadcastError(f"keep must be a non-negative int, got {keep!r}")
    scores = SourceScores() if scores is None else scores
    dest_root = Path(dest_root)
    dest = dest_root / vname
    known = None
    if manifest is not None:
        try:
            verify_manifest(manifest, public_key, version)
            if expected_digest is None or manifest_digest(manifest) == expected_digest:
                known, expected_digest = manifest, manifest_digest(manifest)
        except BroadcastError as e:
            log(f"{vname}: the manifest given does not verify ({e}); asking the sources for it")

    def finish(installed: dict) -> Path:
        clean_temps(dest_root)
        clean_temps(dest_root / ".shards", below=version)  # partials of older versions will not be resumed
        versions = sorted(
            int(m.group(1)) for p in dest_root.iterdir() if (m := VERSION_DIR.fullmatch(p.name)) and p.is_dir()
        )
        # An adapter's base stays beside it (fetch_base puts it there) however old it is.
        base = installed.get("base", {}).get("version")
        remove_old_versions(dest_root, versions, keep, lambda v: v in (version, base))
        return dest

    # A version number can be republished with other weights (a trainer resumed from an older
    # checkpoint), so a folder already here is trusted without asking the sources only when the
    # caller names the publication it wants (expected_digest) and the folder is that one.
    if expected_digest is not None and (dest / INSTALLED_MANIFEST).is_file():
        try:
            held_manifest = load_manifest_file(dest / INSTALLED_MANIFEST)
            verify_manifest(held_manifest, public_key, version)
            if manifest_digest(held_manifest) == expected_digest and _folder_matches(dest, held_manifest):
                return finish(held_manifest)
        except BroadcastError:
            pass
    # Otherwise the sources' current signed manifest says what the version is.
    manifest, shard_sources = _prefer_relays(
        version,
        sources,
        scores,
        public_key=public_key,
        timeout_s=timeout_s,
        expected_digest=expected_digest,
        wait_s=relay_wait_s,
        max_wait_s=relay_wait_max_s,
        stall_s=relay_stall_s,
        known=known,
    )
    if dest.is_dir() and _folder_matches(dest, manifest):
        try:
            atomic_write(dest / INSTALLED_MANIFEST, manifest_bytes(manifest))
        except OSError:
            pass
        return finish(manifest)

    # The patch from where the shards would come: the relays when one of them has the version
    # (they mirror its patch with it), so the origin is not asked for patches it would also serve.
    origin = sources[-1] if shard_sources != sources else None
    kw = dict(scores=scores, public_key=public_key, timeout_s=timeout_s, log=log, last_resort=origin)
    if patches and _from_patch(manifest, scores.order(shard_sources), dest_root, **kw):
        return finish(manifest)

    shard_root = dest_root / ".shards"
    held = shard_root / vname
    if held.is_dir():  # a complete shard copy from an interrupted call: usable only if it is this publication
        try:
            same = manifest_digest(load_manifest_file(held / "manifest.json")) == manifest_digest(manifest)
        except BroadcastError:
            same = False
        if not same:
            remove_dir(held)
    try:
        # From the relays first, each tried once per shard; what they fail to serve comes from
        # every source, the origin included (the shards already fetched are kept and resumed).
        _mirror(
            version,
            manifest,
            shard_sources,
            shard_root,
            scores=scores,
            parallel=parallel,
            timeout_s=timeout_s,
            log=log,
            tries_per_shard=len(shard_sources) if shard_sources != sources else None,
        )
    except BroadcastError:
        if shard_sources == sources:
            raise
        log(f"{vname}: the relays failed to serve its shards; fetching the rest from every source")
        _mirror(version, manifest, sources, shard_root, scores=scores, parallel=parallel, timeout_s=timeout_s, log=log)

    tmp = dest_root / temp_name("tmp", vname)
    tmp.mkdir()
    try:
        try:
            bad = _assemble(manifest, held / "shards", tmp)
        except FileNotFoundError:
            # Another fetcher of this version in dest_root finished and deleted the shard copy.
            if dest.is_dir() and _folder_matches(dest, manifest):
                return finish(manifest)
            raise BroadcastError(
                f"fetching {vname}: the shard copy in {held} vanished while rebuilding the files "
                "(a concurrent fetch into the same dest_root?); try again"
            ) from None
        except OSError as e:
            raise BroadcastError(
                f"fetching {vname}: cannot rebuild the files in {dest_root}: {e}; check free space and permissions"
            ) from e
        if bad is not None:
            remove_dir(held)
            raise BroadcastError(
                f"fetching {vname}: file {bad!r} rebuilt from verified shards has the wrong sha256 "
                "(the shard copy was damaged on disk, or the trainer published an inconsistent "
                "manifest); the shard copy was deleted, try again"
            )
        _put_in_place(tmp, dest, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_dir(held)
    log(f"{vname}: installed in {dest}")
    return finish(manifest)


def _put_in_place(tmp: Path, dest: Path, manifest: dict) -> None:
    """Rename the rebuilt folder `tmp` to `dest` whole, unless a concurrent fetch put the same
    version there first (then that copy stays: its caller may be loading it)."""
    (tmp / INSTALLED_MANIFEST).write_bytes(manifest_bytes(manifest))
    if dest.is_dir() and _folder_matches(dest, manifest):
        return
    if dest.exists():
        remove_dir(dest)  # a stale or damaged copy: moved aside whole, then the new one goes in
    try:
        os.rename(tmp, dest)
    except OSError:
        if not (dest.is_dir() and _folder_matches(dest, manifest)):  # else: another fetcher won the race
            raise BroadcastError(
                f"fetching {version_name(manifest['version'])}: cannot rename the rebuilt folder to {dest}; "
                "remove it and try again"
            ) from None


def _from_patch(
    manifest: dict, sources: list[str], dest_root: Path, *, scores, public_key, timeout_s, log, last_resort
) -> bool:
    """Build the version's folder from the one before it (held in dest_root) and its patch; True
    if it is in place. False, having logged why, when there is no such version or patch, or the
    patch does not rebuild files matching the signed manifest: the caller fetches the shards."""
    version = manifest["version"]
    vname = version_name(version)
    base = held_base(dest_root, version, INSTALLED_MANIFEST)
    if base is None:
        return False
    tmp = dest_root / temp_name("tmp", vname)
    patch = tmp / ".patch.bin"  # a dotfile: not one of the version's files (flat, plain names)
    try:
        tmp.mkdir()
        d = fetch_patch(
            manifest,
            base[1],
            sources,
            scores,
            public_key=public_key,
            timeout_s=timeout_s,
            log=log,
            dest=patch,
            last_resort=last_resort,
        )
        if d is None:
            return False
        rebuild_folder(patch, base[0], base[1], manifest, tmp)
        patch.unlink()
        _put_in_place(tmp, dest_root / vname, manifest)
    except Exception as e:  # noqa: BLE001 - a patch is only a shortcut: any failure means the shards
        log(f"{vname}: the patch did not rebuild it ({type(e).__name__}: {e}); fetching its shards")
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(
        f"{vname}: installed from {version_name(base[1]['version'])} and a patch of {d['size']} bytes "
        f"({d['size'] / max(manifest['total_size'], 1):.1%} of the version)"
    )
    return True
