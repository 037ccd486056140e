"""A model named by a local folder or a Hugging Face Hub id, as the folder to load it from.

`model.path = "HuggingFaceTB/SmolLM2-135M-Instruct"` (optionally with `model.revision`, a branch,
tag or commit) is resolved through `huggingface_hub`: its cache first (HF_HUB_CACHE / HF_HOME),
downloading only when the hub is reachable and HF_HUB_OFFLINE is not set. `swarmrl rl` pins the
commit the id resolved to in the run's config.toml and in the signed manifest of every version,
so a resumed run, the trainer and anyone checking a version know which weights it started from;
workers never read the Hub (they get the weights from the run's broadcast).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from swarmrl.errors import SwarmrlError

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubError(SwarmrlError, ValueError):
    """A model id that cannot be resolved here; the message names the id, the cache and the fix."""


@dataclass(frozen=True)
class Resolved:
    folder: Path
    repo_id: str | None = None  # None: a local folder
    commit: str | None = None  # the Hub commit the id (and revision) resolved to

    @property
    def source(self) -> dict | None:
        """What a version's manifest records of where its weights came from (None: a local folder)."""
        return {"hub_id": self.repo_id, "revision": self.commit} if self.repo_id else None


def hub_source(cfg) -> dict | None:
    """What a run's versions sign of the Hub model it started from: `model.path` as a Hub id and
    the commit `swarmrl rl` pinned in `model.revision` (None for a local folder or the built-in
    model, or before the revision is pinned)."""
    path, revision = cfg.model.path, cfg.model.revision
    if path and revision and COMMIT.match(revision) and is_hub_id(path):
        return {"hub_id": path, "revision": revision}
    return None


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hub id (ORG/NAME) and is not a folder that exists here."""
    return bool(_REPO_ID.match(path)) and not Path(path).exists()


def resolve(path: str, revision: str | None = None, *, what: str = "model.path") -> Resolved:
    """The folder of `path`: itself when it is a folder here, else the Hub id's snapshot; `what`
    names the setting in errors (`--model` for the commands that take one)."""
    if Path(path).expanduser().is_dir():
        if revision:
            raise HubError(f"model.revision {revision!r} is for a Hub id; {what} {path} is a local folder")
        return Resolved(Path(path).expanduser())
    if not _REPO_ID.match(path):
        raise HubError(
            f"{what} {path!r} is not a folder here, nor a Hugging Face Hub id (ORG/NAME, e.g. "
            "HuggingFaceTB/SmolLM2-135M-Instruct): pass a Hugging Face checkpoint folder or a Hub id"
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE
    at = f"{what} {path}@{revision}" if revision else f"{what} {path}"
    try:
        folder = Path(snapshot_download(path, revision=revision))
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise HubError(f"{at}: the Hub has no such model or revision ({type(e).__name__})") from None
    except LocalEntryNotFoundError:
        how = (
            "HF_HUB_OFFLINE is set: unset it to download, or download it where the hub is reachable"
            if offline
            else "the hub could not be reached: download it where it can be"
        )
        raise HubError(
            f"{at} is not in the Hugging Face cache {cache} and {how} "
            f"(`hf download {path}{' --revision ' + revision if revision else ''}`), or give a local folder"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{at}: {type(e).__name__}: {e}") from None
    if not (folder / "config.json").is_file():
        raise HubError(f"{at}: its snapshot {folder} has no config.json: not a Hugging Face model")
    commit = folder.name if COMMIT.match(folder.name) else None
    return Resolved(folder, path, commit)
