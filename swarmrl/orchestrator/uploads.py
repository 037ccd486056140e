"""One group in pieces: POST /v1/rollouts/upload, for a group larger than one request (issue 53).

A group of 16 completions of 13,000 tokens with their proofs is about 8 MB of JSON, over the
orchestrator's default request limit, and the seed run's longest completions were 32,000 tokens.
A worker sends such a group's JSON in pieces, each a signed request of its own: (lease, slot,
offset, total, SHA-256 of the whole, the piece). The orchestrator appends each piece to a file of
the run directory (`uploads/`), so an unfinished upload costs disk, not memory, and a worker whose
connection drops asks again at the offset it was told and goes on from there (also after an
orchestrator restart: the files stay). The last piece's request checks the digest, parses the
group and submits it as POST /v1/rollouts would (the same checks, grading and verdict).

What bounds it, cheapest check first: a piece is accepted only for an open slot of an open lease
of the signing key (leases are bounded per key and per source: admission.py); a group's size at
most `orchestrator.max_group_bytes`; the unfinished bytes of one source (address) at most
`orchestrator.max_upload_bytes_per_source` (429 `uploads_full` beyond); an upload whose lease has
ended is deleted at the next piece anyone sends. Memory: one piece, and the whole group only
when it is complete (as POST /v1/rollouts holds it).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from swarmrl.orchestrator.errors import ApiError, parsed
from swarmrl.protocol.messages import GroupIn


class Uploads:
    """The unfinished uploads of a run: `<run-dir>/uploads/<lease>-<slot>.json` (what is being
    sent: key, source, total, digest, lease expiry) beside `.part` (the bytes so far). Owns the
    per-source totals, guarded by `lock`."""

    def __init__(self, run_dir: Path, max_group_bytes: int, max_source_bytes: int):
        self.root = Path(run_dir) / "uploads"
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_group_bytes, self.max_source_bytes = max_group_bytes, max_source_bytes
        self.lock = threading.Lock()
        self.by_source: dict[str, int] = {}
        for meta in self.root.glob("*.json"):  # uploads a previous process was receiving
            try:
                info = json.loads(meta.read_text())
                self.by_source[info["source"]] = self.by_source.get(info["source"], 0) + self._size(meta)
            except (OSError, ValueError, KeyError):
                self._delete(meta)

    def _part(self, meta: Path) -> Path:
        return meta.with_suffix(".part")

    def _size(self, meta: Path) -> int:
        part = self._part(meta)
        return part.stat().st_size if part.exists() else 0

    def _delete(self, meta: Path) -> int:
        """Remove an upload's files; the bytes it held."""
        size = self._size(meta)
        self._part(meta).unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
        return size

    def _drop(self, meta: Path, source: str) -> None:
        self.by_source[source] = max(0, self.by_source.get(source, 0) - self._delete(meta))

    def sweep(self, now: float) -> int:
        """Delete the uploads whose lease has ended (by the expiry last seen); how many."""
        dropped = 0
        with self.lock:
            for meta in self.root.glob("*.json"):
                try:
                    info = json.loads(meta.read_text())
                    ended = info["expires"] < now
                    source = info["source"]
                except (OSError, ValueError, KeyError):
                    ended, source = True, ""
                if ended:
                    self._drop(meta, source)
                    dropped += 1
        return dropped

    def held(self, source: str) -> int:
        with self.lock:
            return self.by_source.get(source, 0)

    def append(
        self, *, key: str, source: str, lease_id: str, slot: int, expires: float, body
    ) -> tuple[int, str | None]:
        """Add `body.data` at `body.offset`: (bytes received, the whole group's JSON once
        complete and its digest checked, else None). A piece at an offset already received is
        not written again (the reply says where to go on); one past it is refused."""
        if body.total > self.max_group_bytes:
            raise ApiError(
                413,
                "group_too_large",
                f"a group of {body.total} bytes is over orchestrator.max_group_bytes ({self.max_group_bytes})",
            )
        data = body.data.encode()
        meta = self.root / f"{lease_id}-{slot}.json"
        with self.lock:
            info = json.loads(meta.read_text()) if meta.exists() else None
            if info is not None and (
                info["key"] != key or info["total"] != body.total or info["sha256"] != body.sha256
            ):
                if body.offset != 0:
                    raise ApiError(
                        409,
                        "upload_mismatch",
                        "this slot's upload has another size or digest: start it again at offset 0",
                    )
                self._drop(meta, info["source"])
                info = None
            received = self._size(meta) if info is not None else 0
            if body.offset < received:
                return received, None  # a retry of a piece that arrived: go on from `received`
            if body.offset > received:
                raise ApiError(409, "upload_offset", f"offset {body.offset} is past the {received} bytes received")
            if received + len(data) > body.total:
                raise ApiError(422, "upload_overrun", f"{received + len(data)} bytes for an upload of {body.total}")
            if self.by_source.get(source, 0) + len(data) > self.max_source_bytes:
                raise ApiError(
                    429,
                    "uploads_full",
                    f"unfinished uploads from this address hold {self.by_source.get(source, 0)} bytes, the most "
                    f"allowed (orchestrator.max_upload_bytes_per_source); finish or let them expire",
                    retry_after=5.0,
                )
            if info is None:
                info = {"key": key, "source": source, "total": body.total, "sha256": body.sha256}
            meta.write_text(json.dumps({**info, "expires": expires}))
            with open(self._part(meta), "ab") as f:
                f.write(data)
            received += len(data)
            self.by_source[source] = self.by_source.get(source, 0) + len(data)
            if received < body.total:
                return received, None
            whole = self._part(meta).read_bytes()
            self._drop(meta, source)
        if hashlib.sha256(whole).hexdigest() != body.sha256:
            raise ApiError(
                422, "upload_digest", "the upload's bytes do not match its sha256: send it again from offset 0"
            )
        return received, whole.decode()


def parse_group(text: str, slot: int) -> GroupIn:
    """A completed upload as the group POST /v1/rollouts would have carried, parsed as strictly
    (422 naming the field); its slot must be the one it was uploaded for."""
    group = parsed(GroupIn, text.encode())
    if group.slot != slot:
        raise ApiError(
            422, "invalid_request", f"the uploaded group says slot {group.slot}; it was sent for slot {slot}"
        )
    return group
