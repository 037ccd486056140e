"""Broadcasting policy versions from the trainer, through untrusted relays, to untrusted workers.

A policy version is a Hugging Face model folder (config.json, model.safetensors, tokenizer files:
flat, plain file names). The trainer (the *origin*) publishes it into a broadcast root as

    root/v000003/manifest.json     what the version is, signed with the trainer's ed25519 key
    root/v000003/shards/00000      the folder's files, concatenated in name order and cut into
    root/v000003/shards/00001      fixed-size shards (the last one shorter)
    ...

and serves that root with a `ShardServer` (plain HTTP, Range requests). Relays mirror versions
from the origin or from other relays (`mirror_version`) into the same layout and serve them the
same way, so relays chain. Workers and validators call `fetch_version`, which downloads the
shards from whichever sources are fastest, in parallel, and rebuilds the HF folder.

Nothing between the trainer and the client is trusted: the client accepts only a manifest signed
by the configured trainer public key (`verify_manifest`), checks every shard's sha256 as it
arrives (a relay that serves a bad shard is scored down and the shard is fetched elsewhere), and
renames the rebuilt folder into place whole (a cached folder is re-checked against the files'
sha256 before it is reused).

Everything is written into a temp folder (name starting with '.') and renamed into place, so a
version folder exists only when complete. Standard library HTTP only (`http.server`,
`http.client`); signatures with the `cryptography` package, as in `swarmrl.protocol.signing`.

Modules: publish (the origin writes versions), origin (`ShardServer`), download (manifests and
shards from the fastest sources), install (`mirror_version` for relays, `fetch_version`), policy
(`fetch_policy`, what workers and validators load: a version and, for a LoRA adapter, its base
through `fetch_base`), common (shared helpers). The manifest itself, its schema and its
signature check, is part of the protocol: swarmrl/protocol/manifest.py.
"""

from swarmrl.protocol.manifest import BroadcastError
from swarmrl.transport.broadcast.common import INSTALLED_MANIFEST
from swarmrl.transport.broadcast.download import SourceScores, download_shards, fetch_manifest, list_versions
from swarmrl.transport.broadcast.install import fetch_version, mirror_version
from swarmrl.transport.broadcast.origin import ShardRequestHandler, ShardServer
from swarmrl.transport.broadcast.policy import fetch_base, fetch_policy
from swarmrl.transport.broadcast.publish import (
    prune_versions,
    publish_version,
    published_manifest,
    read_versions,
    unpublish_version,
)

__all__ = [
    "BroadcastError",
    "INSTALLED_MANIFEST",
    "ShardRequestHandler",
    "ShardServer",
    "SourceScores",
    "download_shards",
    "fetch_base",
    "fetch_policy",
    "fetch_manifest",
    "fetch_version",
    "list_versions",
    "mirror_version",
    "prune_versions",
    "publish_version",
    "published_manifest",
    "read_versions",
    "unpublish_version",
]
