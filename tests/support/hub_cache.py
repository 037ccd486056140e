"""A Hugging Face Hub cache laid out by a test from a local model folder, as `huggingface_hub`
writes one (models--ORG--NAME/blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
refs/main), so that `model.path = "ORG/NAME"` resolves offline (HF_HUB_OFFLINE=1), with no
network and nothing fetched."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def lay_out(cache: Path, repo_id: str, folder: Path, *, branch: str = "main") -> str:
    """Put `folder`'s files into `cache` as the snapshot of `repo_id` at `branch`; returns the
    commit (40 hex, made from the files' digests, as stable as their bytes)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    digests = {}
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(path, blob)
        digests[path.name] = digest
    commit = hashlib.sha1("".join(f"{n}:{d}\n" for n, d in digests.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, digest in digests.items():
        link = snapshot / name
        if not link.exists():
            os.symlink(Path("..") / ".." / "blobs" / digest, link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return commit


def offline_env(cache: Path) -> dict[str, str]:
    """The variables that point `huggingface_hub` at `cache` and keep it off the network."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "hf-home")}
