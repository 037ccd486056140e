"""Weight patches: a policy version as the bytes that changed since the version before it
(docs/broadcast.md, "Patches"). Pure functions: bytes in, bytes out; no files, no network.

Between two consecutive versions most low-precision weights do not change at all: an AdamW step
of size lr moves a bfloat16 weight w only when |lr * update| is at least half of w's last place
(2^-8 |w|), so with lr 1e-5 and |w| ~ 0.02 most elements keep their bits. A patch records, per
tensor of a safetensors file, the changed elements only (their positions as gaps and their new
values) or, where most of a tensor changed, the XOR of old and new bytes, each zlib-compressed.
float32 weights all change in their low bits every step, so their patches are XOR-dense and save
little; the publisher drops a patch that is not clearly smaller than the version.

A patch is only a faster way to the same bytes: the receiver applies it to the version it holds,
then checks every rebuilt file against the sha256 in the version's signed manifest, and falls
back to the full download on any mismatch. The patch's descriptor (`patch.json`: which version,
against which base by content digest, its size and sha256) is signed by the trainer like a
manifest, so a relay cannot make anyone download or decompress more than the trainer published.

Layout of a patch (`patch.bin`): MAGIC, the header's length (u32 little-endian), the header (JSON),
then the compressed sections in the header's order. The header lists every file of the new
version in name order, each as one of
    {"name", "op": "same"}                   identical to the base's file of that name
    {"name", "op": "full", "size", "z"}      the file, zlib-compressed (z bytes)
    {"name", "op": "spans", "size", "spans"} same length as the base's; `spans` cover it in order:
        [length, itemsize, "same"]                       unchanged
        [length, itemsize, "xor", z]                     new = old XOR zlib-inflate(z bytes)
        [length, itemsize, "sparse", count, width, zi, zv]  `count` elements changed: their index
            gaps (first index + 1, then differences) as `width`-byte integers in zi compressed
            bytes, their new values (count * itemsize bytes) in zv compressed bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Callable, Iterable

import numpy as np

from swarmrl.protocol.manifest import BroadcastError, canonical, check_public_key, content_digest, is_int, version_name

MAGIC = b"SWPATCH1"
FORMAT = "swarmrl-patch/1"
MAX_HEADER_BYTES = 16 << 20
LEVEL = 1  # zlib level: the index gaps and XOR zeros compress as well at 1 as at 6, several times faster
SPARSE_BELOW = 0.25  # share of a tensor's elements changed under which it is stored sparse (else XOR)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# safetensors dtype -> bytes per element
_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
_DESCRIPTOR_FIELDS = {"format", "version", "base", "base_content", "content", "size", "sha256", "public_key"}


class PatchError(BroadcastError):
    """A patch that cannot be applied (malformed, or not for the files at hand): fetch the full version."""


# ---- encoding -----------------------------------------------------------------------------------


def _safetensors_spans(data: bytes) -> list[tuple[int, int]] | None:
    """(length, itemsize) spans covering a safetensors file in order: the header as bytes, then
    each tensor at its element size, any gap between tensors as bytes. None if `data` is not one."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        return None
    try:
        header = json.loads(data[8 : 8 + n])
        tensors = sorted(
            (v["data_offsets"][0], v["data_offsets"][1], _ITEMSIZE[v["dtype"]])
            for k, v in header.items()
            if k != "__metadata__"
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    spans, pos, start = [(8 + n, 1)], 0, 8 + n
    for a, b, item in tensors:
        if not (is_int(a) and is_int(b) and pos <= a <= b and (b - a) % item == 0):
            return None
        if a > pos:
            spans.append((a - pos, 1))
        if b > a:
            spans.append((b - a, item))
        pos = b
    if start + pos > len(data):
        return None
    if start + pos < len(data):
        spans.append((len(data) - start - pos, 1))
    return spans


def _encode_span(old: memoryview, new: memoryview, item: int, sections: list[bytes]) -> list:
    a = np.frombuffer(old, dtype=_UINT[item])
    b = np.frombuffer(new, dtype=_UINT[item])
    changed = np.flatnonzero(a != b)
    length = len(new)
    if len(changed) == 0:
        return [length, item, "same"]
    if len(changed) >= SPARSE_BELOW * len(a):
        z = zlib.compress(np.bitwise_xor(a, b).tobytes(), LEVEL)
        sections.append(z)
        return [length, item, "xor", len(z)]
    gaps = np.diff(changed, prepend=-1)
    top = int(gaps.max())
    width = next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
    zi = zlib.compress(gaps.astype(_UINT[width]).tobytes(), LEVEL)
    zv = zlib.compress(b[changed].tobytes(), LEVEL)
    sections += [zi, zv]
    return [length, item, "sparse", len(changed), width, len(zi), len(zv)]


def encode_patch(
    names: Iterable[str],
    read_new: Callable[[str], bytes],
    read_base: Callable[[str], bytes | None],
    max_bytes: int | None = None,
) -> bytes | None:
    """The patch turning the base version's files into the new version's `names` (read one file
    at a time); None as soon as it would exceed `max_bytes` (not worth publishing)."""
    files: list[dict] = []
    sections: list[bytes] = []
    total = 0
    for name in sorted(names):
        new, old = read_new(name), read_base(name)
        before = len(sections)
        if old is not None and old == new:
            files.append({"name": name, "op": "same"})
        elif old is not None and len(old) == len(new) and (spans := _safetensors_spans(new)) is not None:
            out, pos, vo, vn = [], 0, memoryview(old), memoryview(new)
            for length, item in spans:
                out.append(_encode_span(vo[pos : pos + length], vn[pos : pos + length], item, sections))
                pos += length
            files.append({"name": name, "op": "spans", "size": len(new), "spans": out})
        else:
            sections.append(zlib.compress(new, LEVEL))
            files.append({"name": name, "op": "full", "size": len(new), "z": len(sections[-1])})
        total += sum(len(s) for s in sections[before:])
        if max_bytes is not None and total > max_bytes:
            return None
    header = json.dumps({"files": files}, separators=(",", ":")).encode()
    blob = MAGIC + struct.pack("<I", len(header)) + header + b"".join(sections)
    return None if max_bytes is not None and len(blob) > max_bytes else blob


# ---- decoding -----------------------------------------------------------------------------------


def _inflate(data: memoryview, want: int, what: str) -> bytes:
    """Exactly `want` bytes out of zlib stream `data`, never more (a bomb stops at `want`)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, want)
    except zlib.error as e:
        raise PatchError(f"{what}: bad compressed data ({e})") from None
    if len(out) != want or d.unconsumed_tail or not d.eof or d.unused_data:
        raise PatchError(f"{what}: compressed data does not hold exactly {want} bytes")
    return out


class _Reader:
    def __init__(self, blob: bytes, start: int):
        self.view, self.pos = memoryview(blob), start

    def take(self, n, what: str) -> memoryview:
        if not is_int(n) or n < 0 or self.pos + n > len(self.view):
            raise PatchError(f"{what}: section of {n!r} bytes runs past the end of the patch")
        out = self.view[self.pos : self.pos + n]
        self.pos += n
        return out


def patch_files(blob: bytes) -> list[dict]:
    """The header's file list, checked for shape (names, ops, sizes); PatchError if malformed."""
    if len(blob) < len(MAGIC) + 4 or blob[: len(MAGIC)] != MAGIC:
        raise PatchError(f"not a swarmrl patch (expected it to start with {MAGIC!r})")
    (n,) = struct.unpack("<I", blob[len(MAGIC) : len(MAGIC) + 4])
    if n > MAX_HEADER_BYTES or len(MAGIC) + 4 + n > len(blob):
        raise PatchError(f"patch header of {n} bytes runs past the end of the patch")
    try:
        files = json.loads(blob[len(MAGIC) + 4 : len(MAGIC) + 4 + n])["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise PatchError(f"patch header is not valid JSON with a files list ({e})") from None
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in files):
        raise PatchError("patch header: files must be a list of objects with a name")
    return files


def apply_patch(blob: bytes, read_base: Callable[[str], bytes | None], write: Callable[[str, bytes], None]) -> None:
    """Rebuild the new version's files from the base's (`read_base(name)`) and the patch, passing
    each to `write(name, data)` in name order. PatchError for anything malformed or for a base that
    lacks a file the patch needs; the caller checks the written files' sha256 against the manifest."""
    files = patch_files(blob)
    (n,) = struct.unpack("<I", blob[len(MAGIC) : len(MAGIC) + 4])
    r = _Reader(blob, len(MAGIC) + 4 + n)
    for f in files:
        name, op = f["name"], f.get("op")
        if op == "full":
            size = f.get("size")
            if not is_int(size) or size < 0:
                raise PatchError(f"patch header: {name!r} has a bad size {size!r}")
            write(name, _inflate(r.take(f.get("z"), name), size, name))
            continue
        old = read_base(name)
        if old is None:
            raise PatchError(f"the patch needs the base's {name!r}, which the base version lacks")
        if op == "same":
            write(name, old)
        elif op == "spans":
            write(name, _apply_spans(f, old, r))
        else:
            raise PatchError(f"patch header: {name!r} has an unknown op {op!r}")
    if r.pos != len(blob):
        raise PatchError(f"{len(blob) - r.pos} bytes after the last section of the patch")


def _apply_spans(f: dict, old: bytes, r: _Reader) -> bytes:
    name, size, spans = f["name"], f.get("size"), f.get("spans")
    if size != len(old) or not isinstance(spans, list):
        raise PatchError(f"patch of {name!r} is for a file of {size!r} bytes; the base's has {len(old)}")
    out, pos = bytearray(old), 0
    for s in spans:
        if not (isinstance(s, list) and len(s) >= 3 and is_int(s[0]) and s[0] >= 0 and s[1] in _UINT):
            raise PatchError(f"patch of {name!r}: bad span {str(s)[:80]}")
        length, item, kind = s[0], s[1], s[2]
        if pos + length > size or length % item:
            raise PatchError(f"patch of {name!r}: span of {length} bytes at {pos} does not fit the file")
        seg = np.frombuffer(out, dtype=_UINT[item], count=length // item, offset=pos)
        if kind == "xor" and len(s) == 4:
            seg ^= np.frombuffer(_inflate(r.take(s[3], name), length, name), dtype=_UINT[item])
        elif kind == "sparse" and len(s) == 7 and is_int(s[3]) and 0 < s[3] <= length // item and s[4] in _UINT:
            count, width = s[3], s[4]
            gaps = np.frombuffer(_inflate(r.take(s[5], name), count * width, name), dtype=_UINT[width])
            values = np.frombuffer(_inflate(r.take(s[6], name), count * item, name), dtype=_UINT[item])
            if gaps.min() < 1 or gaps.max() > len(seg):  # each gap in 1..n: the sum fits an int64
                raise PatchError(f"patch of {name!r}: element positions must increase within the span")
            index = np.cumsum(gaps.astype(np.int64)) - 1  # gaps >= 1 keeps it increasing and >= 0
            if index[-1] >= len(seg):
                raise PatchError(f"patch of {name!r}: an element position is past the end of its span")
            seg[index] = values
        elif kind != "same" or len(s) != 3:
            raise PatchError(f"patch of {name!r}: bad span {str(s)[:80]}")
        pos += length
    if pos != size:
        raise PatchError(f"patch of {name!r}: spans cover {pos} of {size} bytes")
    return bytes(out)


# ---- the signed descriptor ----------------------------------------------------------------------


def sign_descriptor(key, version: int, base: int, base_manifest: dict, manifest: dict, blob: bytes) -> dict:
    """patch.json: the trainer's signed statement that `blob` turns `base` (by content digest)
    into `version` (by content digest), with the blob's size and sha256."""
    d = {
        "format": FORMAT,
        "version": version,
        "base": base,
        "base_content": content_digest(base_manifest),
        "content": content_digest(manifest),
        "size": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "public_key": key.public_key().public_bytes_raw().hex(),
    }
    d["signature"] = key.sign(canonical(d)).hex()
    return d


def verify_descriptor(d, public_key: str, manifest: dict) -> dict:
    """`d` if it is a patch descriptor for `manifest`'s version and content, signed by
    `public_key`; PatchError otherwise (the caller downloads the full version instead)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    v = manifest["version"]
    where = f"patch of policy {version_name(v)}"
    pk = check_public_key(public_key, f"verifying the {where}")
    if not isinstance(d, dict) or set(d) != _DESCRIPTOR_FIELDS | {"signature"} or d["format"] != FORMAT:
        raise PatchError(f"{where}: the descriptor is not a {FORMAT} object with exactly the expected fields")
    if d["version"] != v or not is_int(d["base"]) or not 0 <= d["base"] < v:
        raise PatchError(f"{where}: descriptor names version {d['version']!r} and base {d['base']!r}")
    if not is_int(d["size"]) or d["size"] <= 0 or d["public_key"] != pk:
        raise PatchError(f"{where}: bad size or not signed by the configured trainer key")
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(pk)).verify(bytes.fromhex(str(d["signature"])), canonical(d))
    except (ValueError, InvalidSignature):
        raise PatchError(f"{where}: bad signature on the descriptor; the source altered it") from None
    if d["content"] != content_digest(manifest):
        raise PatchError(f"{where}: the descriptor is for other content than the signed manifest")
    return d
