"""What a worker or a validator loads: a policy version, and for a LoRA adapter the base it
names, both fetched with `fetch_version` and checked against the trainer's signature."""

from __future__ import annotations

from pathlib import Path

from swarmrl.protocol.manifest import BroadcastError, content_digest, manifest_digest, verify_manifest, version_name
from swarmrl.transport.broadcast.common import INSTALLED_MANIFEST, load_manifest_file
from swarmrl.transport.broadcast.install import fetch_version


def fetch_policy(
    version: int,
    manifest: dict,
    sources: list[str],
    dest_root,
    *,
    public_key: str,
    verified: set | None = None,
    **fetch,
) -> tuple[Path, Path | None]:
    """A policy version as a worker or validator loads it: `fetch_version` of the version the
    orchestrator announced (`manifest`, whose digest it must have: the relays' copies are bounded
    by it and the origin is not asked for it), then, for a LoRA adapter, `fetch_base` of the base
    it names (`verified`: fetch_base's). `fetch`: what both take (scores, keep, parallel,
    timeout_s, log). (folder, base or None). The sources are untrusted: whatever else a fetch
    raises is a BroadcastError naming the version, so that a caller has three kinds of failed load
    to handle (BroadcastError, OSError, ValueError), never a lying relay's exception type."""
    try:
        folder = fetch_version(
            version,
            sources,
            dest_root,
            public_key=public_key,
            expected_digest=manifest_digest(manifest),
            manifest=manifest,
            **fetch,
        )
        base = fetch_base(manifest, sources, dest_root, public_key=public_key, verified=verified, **fetch)
    except (BroadcastError, OSError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - the sources are untrusted: whatever a fetch raises is a failed load
        raise BroadcastError(f"fetching policy v{version} failed ({type(e).__name__}: {e})") from None
    return folder, base


def fetch_base(
    manifest: dict,
    sources: list[str],
    dest_root,
    *,
    public_key: str,
    verified: set | None = None,
    scores=None,
    keep: int = 2,
    parallel: int = 4,
    timeout_s: float = 10.0,
    log=lambda msg: None,
) -> Path | None:
    """For an adapter version (trainer.lora), the base it applies to: fetched like any version
    into dest_root/vNNNNNN, beside the adapter (where `load_policy` looks for it), and checked to
    hold exactly the files the adapter's signed manifest names by content digest. None for a
    full version.

    `manifest` is the adapter version's manifest and must verify against `public_key` (the
    trainer's): the base it names is signed with it, so a relay can neither swap the base nor
    point an adapter at other weights. A base whose content differs is refused (BroadcastError),
    never merged. `verified` (a set the caller keeps) holds content digests already checked in
    this process, so a multi-GB base is re-hashed once per process rather than once per version."""
    verify_manifest(manifest, public_key)
    base = manifest.get("base")
    if base is None:
        return None
    version, want = base["version"], base["digest"]
    where = f"policy {version_name(manifest['version'])} is a LoRA adapter for base {version_name(version)}"
    dest = Path(dest_root) / version_name(version)
    if verified is not None and want in verified and (dest / INSTALLED_MANIFEST).is_file():
        try:
            if content_digest(load_manifest_file(dest / INSTALLED_MANIFEST)) == want:
                return dest
        except (BroadcastError, KeyError, TypeError):
            pass
    path = fetch_version(
        version,
        sources,
        dest_root,
        public_key=public_key,
        scores=scores,
        keep=keep,
        parallel=parallel,
        timeout_s=timeout_s,
        log=log,
    )
    held = load_manifest_file(path / INSTALLED_MANIFEST)
    verify_manifest(held, public_key, version)
    got = content_digest(held)
    if got != want:
        raise BroadcastError(
            f"{where} with content digest {want[:16]}..., but the {version_name(version)} the sources serve (signed "
            f"by the trainer) holds other weights ({got[:16]}...): refusing to merge the adapter into it. The trainer "
            "republished its base with other weights (a new run under the same key?): fetch a version the current "
            "trainer published, or start this worker with an empty cache directory"
        )
    if verified is not None:
        verified.add(want)
    log(f"{where}: base checked ({want[:16]}...)")
    return path
