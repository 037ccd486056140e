"""The policy-version manifest: what a published version is, and the checks every receiver
runs on one before trusting a byte of it (docs/protocol.md, "Policy versions").

A manifest names the version, its parent, the HF folder's files (name, size, sha256) and the
shards they are cut into (size, sha256), and carries the trainer's ed25519 signature over its
canonical JSON (`canonical`: sorted keys, no spaces, without the signature). `manifest_digest` is
the sha256 of that canonical JSON: the identity of a version's content, which workers and
validators compare.

A LoRA run's later versions are adapters (trainer.lora): their manifest also carries `base`, the
version the adapter applies to and that version's `content_digest` (the sha256 of its files list:
names, sizes and sha256s, so a republished base with the same bytes keeps its digest). The field
is signed with the rest, so no relay can point an adapter at other weights; a receiver merges
the adapter only into a base whose signed manifest has that content digest. Full versions carry
no `base` field, and their manifests are unchanged. A run that started from a Hub model id also
signs `source` into every version: the id and the commit it resolved to. Pure functions: no files, no network
(swarmrl.transport.broadcast does those)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import TypeGuard

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from swarmrl.errors import SwarmrlError

FORMAT = "swarmrl-broadcast/1"
MAX_SHARDS = 100_000  # shard names have five digits

# A "plain" file name: what HF writes. Safe as a path component, needs no URL quoting.
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", re.ASCII)
_HEX64 = re.compile(r"[0-9a-f]{64}", re.ASCII)
_HEX128 = re.compile(r"[0-9a-f]{128}", re.ASCII)
_COMMIT = re.compile(r"[0-9a-f]{40}", re.ASCII)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}", re.ASCII)

_FIELDS = {
    "format",
    "version",
    "parent",
    "created",
    "model_config",
    "files",
    "shard_size",
    "total_size",
    "shards",
    "public_key",
}


class BroadcastError(SwarmrlError, RuntimeError):
    """A version could not be published, served, verified or fetched; the message says why and what to do."""


# ---- small helpers ------------------------------------------------------------------------------


def version_name(version: int) -> str:
    """The name of a version's folder and of the version in messages: 3 -> v000003."""
    return f"v{version:06d}"


def is_int(x: object) -> TypeGuard[int]:
    """An int and not a bool (JSON's true is no version number or size)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_version(version, what: str = "version") -> None:
    """BroadcastError unless `version` is an int in 0..999999; `what` names it in the message."""
    if not is_int(version) or not 0 <= version <= 999_999:
        raise BroadcastError(f"{what} must be an int in 0..999999, got {version!r}")


def is_plain_name(name) -> bool:
    """A plain file name (letters, digits, '.', '_', '-'; no '..', not starting with '.'): safe
    as a path component, needs no URL quoting."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and ".." not in name


def check_public_key(public_key, who: str) -> str:
    """`public_key` if it is an ed25519 public key as 64 lowercase hex characters; else
    BroadcastError, the message starting with `who`."""
    if not isinstance(public_key, str) or not _HEX64.fullmatch(public_key):
        raise BroadcastError(
            f"{who}: public_key must be the trainer's ed25519 public key as 64 lowercase hex characters "
            f"(auth.public_key_hex; <run-dir>/trainer.pub), got {str(public_key)[:80]!r}"
        )
    return public_key


# ---- manifests ----------------------------------------------------------------------------------


def canonical(manifest: dict) -> bytes:
    """The signed bytes: the manifest without "signature", sorted keys, no spaces, utf-8."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def manifest_digest(manifest: dict) -> str:
    """sha256 hex of canonical(manifest): one digest naming a published version's content."""
    return hashlib.sha256(canonical(manifest)).hexdigest()


def content_digest(manifest: dict) -> str:
    """sha256 hex of a version's files (name, size, sha256 each, in name order): what the version
    holds, independent of when and how it was published. An adapter version names its base by it."""
    files = sorted(
        ({"name": f["name"], "size": f["size"], "sha256": f["sha256"]} for f in manifest["files"]),
        key=lambda f: f["name"],
    )
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def check_source(source, bad) -> None:
    """Raises bad(message) unless `source` names the Hub model a run started from: exactly
    `hub_id` (ORG/NAME) and `revision` (the 40-hex commit it resolved to)."""
    if not isinstance(source, dict) or set(source) != {"hub_id", "revision"}:
        raise bad("source must be an object with exactly hub_id and revision (the Hub model the run started from)")
    if not isinstance(source["hub_id"], str) or not _REPO_ID.fullmatch(source["hub_id"]):
        raise bad(f"source.hub_id must be a Hub id (ORG/NAME), got {source['hub_id']!r}")
    if not isinstance(source["revision"], str) or not _COMMIT.fullmatch(source["revision"]):
        raise bad(f"source.revision must be a 40-hex commit, got {source['revision']!r}")


def check_base(base, version, bad) -> None:
    """Raises bad(message) unless `base` is an adapter version's base field: exactly `version`
    (below the adapter's own `version`) and `digest` (the base's content_digest)."""
    if not isinstance(base, dict) or set(base) != {"version", "digest"}:
        raise bad("base must be an object with exactly version and digest (the adapter's base model)")
    if not is_int(base["version"]) or not 0 <= base["version"] < version:
        raise bad(f"base.version must be an int below the version itself ({version}), got {base['version']!r}")
    if not isinstance(base["digest"], str) or not _HEX64.fullmatch(base["digest"]):
        raise bad("base.digest must be 64 lowercase hex characters (the base version's content_digest)")


def describe_manifest(manifest, version: int | None) -> str:
    """How messages name a manifest: "manifest of policy v000003" when its version is known."""
    if version is not None:
        return f"manifest of policy {version_name(version)}"
    v = manifest.get("version") if isinstance(manifest, dict) else None
    return f"manifest of policy {version_name(v)}" if is_int(v) and 0 <= v <= 999_999 else "manifest"


def check_manifest_shape(manifest, where: str) -> None:
    """Well-formedness only (no signature): every field, types, and internal consistency."""

    def bad(msg: str) -> BroadcastError:
        return BroadcastError(f"{where}: {msg}; the source is misconfigured or malicious, use another source")

    if not isinstance(manifest, dict):
        raise bad(f"not a JSON object ({type(manifest).__name__})")
    if "format" in manifest and manifest["format"] != FORMAT:
        raise BroadcastError(
            f"{where}: format is {manifest['format']!r}, expected {FORMAT!r}; the sender runs an "
            "incompatible swarmrl version (upgrade both sides)"
        )
    missing = sorted(_FIELDS - set(manifest))
    if missing:
        raise bad(f"missing field(s) {', '.join(missing)}: not a {FORMAT} manifest")
    unknown = sorted(set(manifest) - _FIELDS - {"signature", "base", "source"})
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(str, unknown))}")
    v, parent = manifest["version"], manifest["parent"]
    if not is_int(v) or not 0 <= v <= 999_999:
        raise bad(f"version must be an int in 0..999999, got {v!r}")
    if parent is not None and (not is_int(parent) or not 0 <= parent <= 999_999):
        raise bad(f"parent must be null or an int in 0..999999, got {parent!r}")
    if "base" in manifest:
        check_base(manifest["base"], v, bad)
    if "source" in manifest:
        check_source(manifest["source"], bad)
    created = manifest["created"]
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created):
        raise bad(f"created must be a unix time (a number), got {created!r}")
    if not isinstance(manifest["model_config"], dict):
        raise bad("model_config must be a JSON object (the parsed config.json)")
    if not (isinstance(manifest["public_key"], str) and _HEX64.fullmatch(manifest["public_key"])):
        raise bad("public_key must be 64 lowercase hex characters")
    shard_size, total = manifest["shard_size"], manifest["total_size"]
    if not is_int(shard_size) or shard_size <= 0:
        raise bad(f"shard_size must be a positive int, got {shard_size!r}")
    if not is_int(total) or total < 0:
        raise bad(f"total_size must be a non-negative int, got {total!r}")
    files = manifest["files"]
    if not isinstance(files, list) or not files:
        raise bad("files must be a non-empty list")
    offset = 0
    names = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict) or set(f) != {"name", "offset", "size", "sha256"}:
            raise bad(f"files[{i}] must be an object with exactly name, offset, size, sha256")
        if not is_plain_name(f["name"]):
            raise bad(
                f"files[{i}] has a bad name {f['name']!r} (plain names only: letters, digits, '.', '_', '-'; "
                "no '..', not starting with '.')"
            )
        if f["name"] in names:
            raise bad(f"file {f['name']!r} is listed twice")
        names.add(f["name"])
        if not is_int(f["size"]) or f["size"] < 0:
            raise bad(f"size of {f['name']!r} must be a non-negative int, got {f['size']!r}")
        if f["offset"] != offset or not is_int(f["offset"]):
            raise bad(f"offset of {f['name']!r} is {f['offset']!r}, expected {offset} (files are contiguous from 0)")
        if not isinstance(f["sha256"], str) or not _HEX64.fullmatch(f["sha256"]):
            raise bad(f"sha256 of {f['name']!r} must be 64 lowercase hex characters")
        offset += f["size"]
    if offset != total:
        raise bad(f"the files add up to {offset} bytes but total_size is {total}")
    shards = manifest["shards"]
    n = -(-total // shard_size)
    if not isinstance(shards, list) or len(shards) != n:
        raise bad(f"shards must be a list of {n} entries ({total} bytes in shards of {shard_size})")
    if n > MAX_SHARDS:
        raise bad(f"{n} shards, more than the {MAX_SHARDS} shard names allow")
    for i, s in enumerate(shards):
        want = shard_size if i < n - 1 else total - (n - 1) * shard_size
        if not isinstance(s, dict) or set(s) != {"size", "sha256"}:
            raise bad(f"shards[{i}] must be an object with exactly size and sha256")
        if s["size"] != want or not is_int(s["size"]):
            raise bad(f"shards[{i}] has size {s['size']!r}, expected {want}")
        if not isinstance(s["sha256"], str) or not _HEX64.fullmatch(s["sha256"]):
            raise bad(f"sha256 of shards[{i}] must be 64 lowercase hex characters")


def verify_manifest(manifest, public_key: str, version: int | None = None) -> None:
    """BroadcastError unless `manifest` is well formed, names `public_key`, carries a valid signature
    by that key, and (when given) is for `version`."""
    if version is not None:
        check_version(version)
    where = describe_manifest(manifest, version)
    pk = check_public_key(public_key, f"verifying the {where}")
    check_manifest_shape(manifest, where)
    sig = manifest.get("signature")
    if sig is None or sig == "":
        raise BroadcastError(
            f"{where}: unsigned (no 'signature' field); only manifests signed by the trainer key "
            f"{pk[:16]}... are accepted: refuse it, the source is misconfigured or malicious"
        )
    if not isinstance(sig, str) or not _HEX128.fullmatch(sig):
        raise BroadcastError(
            f"{where}: the signature must be 128 lowercase hex characters; refuse it and use another source"
        )
    if manifest["public_key"] != pk:
        raise BroadcastError(
            f"{where}: signed by key {manifest['public_key']}, not the configured trainer key {pk}; "
            "if the trainer's key changed, configure the new one (<run-dir>/trainer.pub), "
            "otherwise the source is forging versions"
        )
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(pk)).verify(bytes.fromhex(sig), canonical(manifest))
    except ValueError:
        raise BroadcastError(
            f"{where}: the configured trainer key {pk} is not a valid ed25519 public key; check <run-dir>/trainer.pub"
        ) from None
    except InvalidSignature:
        raise BroadcastError(
            f"{where}: bad signature: the manifest was altered after the trainer signed it (or "
            "signed by another key); refuse it and use another source"
        ) from None
    if version is not None and manifest["version"] != version:
        raise BroadcastError(
            f"{where}: the manifest is for {version_name(manifest['version'])}, "
            f"not {version_name(version)}; "
            "the source serves the wrong version, use another source"
        )


def same_content(a: dict, b: dict) -> bool:
    """Same version, same bytes, same signer: all but the time of publishing and the signature."""

    def strip(m):
        return {k: v for k, v in m.items() if k not in ("created", "signature")}

    return json.dumps(strip(a), sort_keys=True) == json.dumps(strip(b), sort_keys=True)
