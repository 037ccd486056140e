"""Weight patches: a policy version as the bytes that changed since the version before it
(docs/broadcast.md, "Patches"). No files, no network: bytes in and out, or callables that read
and take them a chunk at a time.

Between two consecutive versions most low-precision weights do not change at all: an AdamW step
of size lr moves a bfloat16 weight w only when |lr * update| is at least half of w's last place
(2^-8 |w|), so with lr 1e-5 and |w| ~ 0.02 most elements keep their bits. A patch records, per
tensor of a safetensors file, the changed elements only (their positions as gaps and their new
values) or, where most of a tensor changed, the XOR of old and new bytes, each zlib-compressed.
float32 weights all change in their low bits every step, so their patches are XOR-dense and save
little; the publisher drops a patch that is not clearly smaller than the version.

A patch is only a faster way to the same bytes: the receiver applies it to the version it holds
as a stream (`patch_chunks`: a few CHUNKs in memory, every declared size checked against the
version's signed manifest first), checks every rebuilt file against the sha256 in that manifest
as it is written, and falls back to the full download on any mismatch or malformed patch. The
patch's descriptor (`patch.json`: which version, against which base by content digest, its size
and sha256) is signed by the trainer like a manifest, so a relay cannot make anyone download or
decompress more than the trainer published.

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
from collections.abc import Callable, Iterable, Iterator

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
#
# A patch is applied as a stream (`patch_chunks`): the patch, the base's files and the rebuilt
# files are read and written CHUNK bytes at a time through callables, so installing a version
# holds a few chunks in memory, never a tensor or a file (the in-memory `apply_patch` held the
# base's file, a copy being patched and the result: 3x the file). Before a byte of any section is
# read, every size the header declares is checked against the sizes the caller was given (the
# signed manifest's) and the base's, and every section placed inside the patch (`plan_patch`):
# the header only says how the trainer's bytes are laid out, never how much to allocate.

CHUNK = 1 << 18  # bytes: the unit a patch is read, inflated, patched and written in

Reader = Callable[[int, int], bytes]  # (offset, n) -> up to n bytes of the patch from offset


def _header(read_patch: Reader, patch_size: int) -> tuple[list[dict], int]:
    """The header's file list, checked for shape (names, ops), and where the sections start."""
    head = read_patch(0, len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise PatchError(f"not a swarmrl patch (expected it to start with {MAGIC!r})")
    (n,) = struct.unpack("<I", head[len(MAGIC) :])
    start = len(MAGIC) + 4 + n
    if n > MAX_HEADER_BYTES or start > patch_size:
        raise PatchError(f"patch header of {n} bytes runs past the end of the patch")
    raw = read_patch(len(MAGIC) + 4, n)
    try:
        files = json.loads(raw)["files"] if len(raw) == n else None
    except (ValueError, KeyError, TypeError) as e:
        raise PatchError(f"patch header is not valid JSON with a files list ({e})") from None
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in files):
        raise PatchError("patch header: files must be a list of objects with a name")
    return files, start


def patch_files(blob: bytes) -> list[dict]:
    """The header's file list, checked for shape (names, ops, sizes); PatchError if malformed."""
    return _header(lambda offset, n: blob[offset : offset + n], len(blob))[0]


def plan_patch(
    files: list[dict], start: int, patch_size: int, sizes: dict[str, int], base_size: Callable[[str], int | None]
) -> list[tuple]:
    """The steps that rebuild the files, from the header's `files` (sections from byte `start` of a
    patch of `patch_size` bytes), after checking every declared size against `sizes` (name ->
    size: the signed manifest's; the header must list exactly these names, in name order) and,
    for files patched from the base, against `base_size(name)` (None: the base lacks it). Nothing
    is read or allocated here, so a header declaring 2^63 bytes, or 64 MiB for a 1 MiB file, is
    refused before it costs anything. A step is (name, op, size, arg): "full" with its section
    (offset, length), "same" with None, "spans" with a list of (kind, length, itemsize,
    *sections). PatchError naming the first thing that does not fit."""
    names = [f["name"] for f in files]
    if names != sorted(sizes):
        extra = sorted(set(names) - set(sizes))
        if extra:
            raise PatchError(f"the patch writes {extra[0]!r}, which the signed manifest does not list")
        raise PatchError("the patch does not rebuild every file the signed manifest lists, once each, in name order")
    pos = start

    def section(z, what: str) -> tuple[int, int]:
        nonlocal pos
        if not is_int(z) or z < 0 or pos + z > patch_size:
            raise PatchError(f"{what}: section of {z!r} bytes runs past the end of the patch")
        pos += z
        return pos - z, z

    steps: list[tuple] = []
    for f in files:
        name, op, size, declared = f["name"], f.get("op"), sizes[f["name"]], f.get("size")
        if op == "full":
            if not is_int(declared) or declared != size:
                raise PatchError(f"patch header: {name!r} declares {declared!r} bytes; the signed manifest says {size}")
            steps.append((name, op, size, section(f.get("z"), name)))
            continue
        if op not in ("same", "spans"):
            raise PatchError(f"patch header: {name!r} has an unknown op {str(op)[:40]!r}")
        have = base_size(name)
        if have is None:
            raise PatchError(f"the patch needs the base's {name!r}, which the base version lacks")
        if op == "same":
            if have != size:
                raise PatchError(f"{name!r}: the patch keeps the base's {have} bytes; the signed manifest says {size}")
            steps.append((name, op, size, None))
            continue
        if not is_int(declared) or declared != have or not isinstance(f.get("spans"), list):
            raise PatchError(f"patch of {name!r} is for a file of {declared!r} bytes; the base's has {have}")
        if declared != size:
            raise PatchError(f"patch of {name!r} is for a file of {declared} bytes; the signed manifest says {size}")
        plan: list[tuple] = []
        at = 0
        for s in f["spans"]:
            ok = isinstance(s, list) and len(s) >= 3 and is_int(s[0]) and s[0] >= 0 and is_int(s[1]) and s[1] in _UINT
            if not ok:
                raise PatchError(f"patch of {name!r}: bad span {str(s)[:80]}")
            length, item, kind = s[0], s[1], s[2]
            if at + length > size or length % item:
                raise PatchError(f"patch of {name!r}: span of {length} bytes at {at} does not fit the file")
            if kind == "same" and len(s) == 3:
                plan.append((kind, length, item))
            elif kind == "xor" and len(s) == 4:
                plan.append((kind, length, item, section(s[3], name)))
            elif kind == "sparse" and len(s) == 7 and is_int(s[3]) and 0 < s[3] <= length // item:
                if not (is_int(s[4]) and s[4] in _UINT):
                    raise PatchError(f"patch of {name!r}: bad span {str(s)[:80]}")
                plan.append((kind, length, item, s[3], s[4], section(s[5], name), section(s[6], name)))
            else:
                raise PatchError(f"patch of {name!r}: bad span {str(s)[:80]}")
            at += length
        if at != size:
            raise PatchError(f"patch of {name!r}: spans cover {at} of {size} bytes")
        steps.append((name, op, size, plan))
    if pos != patch_size:
        raise PatchError(f"{patch_size - pos} bytes after the last section of the patch")
    return steps


class _Inflater:
    """Exactly `want` bytes out of the zlib stream in the patch's section (offset, length), in the
    pieces asked for: at most `chunk` compressed bytes held, never more output than asked (a bomb
    stops at `want`)."""

    def __init__(self, read_patch: Reader, section: tuple[int, int], want: int, chunk: int, what: str):
        self.read_patch, self.chunk, self.what, self.want = read_patch, chunk, what, want
        self.pos, self.end = section[0], section[0] + section[1]
        self.d = zlib.decompressobj()
        self.tail = b""  # compressed bytes read but not yet inflated

    def _short(self) -> PatchError:
        return PatchError(f"{self.what}: compressed data does not hold exactly {self.want} bytes")

    def _inflate(self, limit: int) -> bytes:
        if not self.tail:
            n = min(self.chunk, self.end - self.pos)
            if n <= 0:
                raise self._short()  # the stream is not finished at its section's end
            self.tail = self.read_patch(self.pos, n)
            if len(self.tail) != n:
                raise PatchError(f"{self.what}: the patch ends inside a section")
            self.pos += n
        try:
            out = self.d.decompress(self.tail, limit)
        except zlib.error as e:
            raise PatchError(f"{self.what}: bad compressed data ({e})") from None
        self.tail = self.d.unconsumed_tail
        return out

    def read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            if self.d.eof:
                raise self._short()
            out += self._inflate(n - len(out))
        return bytes(out)

    def finish(self) -> None:
        """PatchError unless the stream ended right after the bytes read, at its section's end."""
        while not self.d.eof:
            if self._inflate(1):
                raise self._short()
        if self.d.unused_data or self.tail or self.pos != self.end:
            raise self._short()


def _base(read_base: Callable[[str, int, int], bytes], name: str, offset: int, n: int) -> bytes:
    data = read_base(name, offset, n)
    if len(data) != n:
        raise PatchError(f"the base's {name!r} ended at byte {offset + len(data)} while being patched")
    return data


def _pieces(step: tuple, read_patch: Reader, read_base, chunk: int) -> Iterator[bytes]:
    """The file one step of plan_patch rebuilds, in pieces of at most `chunk` bytes."""
    name, op, size, arg = step
    if op == "full":
        inflater = _Inflater(read_patch, arg, size, chunk, name)
        for at in range(0, size, chunk):
            yield inflater.read(min(chunk, size - at))
        inflater.finish()
        return
    spans = [("same", size, 1)] if op == "same" else arg
    pos = 0
    for kind, length, item, *sections in spans:
        if kind == "same":
            for at in range(0, length, chunk):
                yield _base(read_base, name, pos + at, min(chunk, length - at))
        elif kind == "xor":  # XOR is bytewise: the element size does not matter here
            inflater = _Inflater(read_patch, sections[0], length, chunk, name)
            for at in range(0, length, chunk):
                n = min(chunk, length - at)
                old = np.frombuffer(_base(read_base, name, pos + at, n), dtype=np.uint8)
                yield (old ^ np.frombuffer(inflater.read(n), dtype=np.uint8)).tobytes()
            inflater.finish()
        else:
            yield from _sparse(name, pos, length, item, sections, read_patch, read_base, chunk)
        pos += length


def _sparse(name, pos, length, item, sections, read_patch, read_base, chunk) -> Iterator[bytes]:
    """A sparse span: the base's elements with `count` of them replaced, a window of the span at a
    time; the changed positions are decoded a batch at a time, never all at once."""
    count, width, zi, zv = sections
    m, dtype = length // item, _UINT[item]
    gaps_in = _Inflater(read_patch, zi, count * width, chunk, name)
    values_in = _Inflater(read_patch, zv, count * item, chunk, name)
    batch, per = max(1, chunk // 8), max(1, chunk // item)  # positions decoded (int64) / elements written at once
    index, values = np.empty(0, dtype=np.int64), np.empty(0, dtype=dtype)
    last, left, done = -1, count, 0
    while done < m:
        end = min(done + per, m)
        while left and (len(index) == 0 or index[-1] < end):
            k = min(left, batch)
            gaps = np.frombuffer(gaps_in.read(k * width), dtype=_UINT[width])
            if gaps.min() < 1 or gaps.max() > m:  # each gap in 1..m: positions increase, sums fit an int64
                raise PatchError(f"patch of {name!r}: element positions must increase within the span")
            more = last + np.cumsum(gaps, dtype=np.int64)
            if more[-1] >= m:
                raise PatchError(f"patch of {name!r}: an element position is past the end of its span")
            last, left = int(more[-1]), left - k
            index = np.concatenate((index, more))
            values = np.concatenate((values, np.frombuffer(values_in.read(k * item), dtype=dtype)))
        cut = int(np.searchsorted(index, end))
        window = np.frombuffer(bytearray(_base(read_base, name, pos + done * item, (end - done) * item)), dtype=dtype)
        window[index[:cut] - done] = values[:cut]
        yield window.tobytes()
        index, values, done = index[cut:], values[cut:], end
    gaps_in.finish()
    values_in.finish()


def patch_chunks(
    read_patch: Reader,
    patch_size: int,
    want: dict[str, tuple[int, str | None]],
    base_size: Callable[[str], int | None],
    read_base: Callable[[str, int, int], bytes],
    chunk: int = CHUNK,
) -> Iterator[tuple[str, bytes | None]]:
    """The new version's files rebuilt from the base's and the patch, as (name, piece) pairs in
    name order, each file's pieces (at most `chunk` bytes) followed by (name, None) once its size
    and sha256 match `want` (name -> (size, sha256 hex or None for no check): the signed
    manifest's). `read_patch(offset, n)` reads the patch of `patch_size` bytes, `base_size(name)`
    and `read_base(name, offset, n)` the base's files. Every declared size is checked before
    anything is read (`plan_patch`), and anything malformed, whatever it trips over, is a
    PatchError (the caller fetches the full version); OSError from the callables passes through."""
    try:
        files, start = _header(read_patch, patch_size)
        steps = plan_patch(files, start, patch_size, {k: v[0] for k, v in want.items()}, base_size)
        for step in steps:
            name, size = step[0], step[2]
            h, got = hashlib.sha256(), 0
            for piece in _pieces(step, read_patch, read_base, chunk):
                h.update(piece)
                got += len(piece)
                yield name, piece
            digest = want[name][1]
            if got != size or (digest is not None and h.hexdigest() != digest):
                raise PatchError(f"{name!r} rebuilt from the patch does not match the signed manifest")
            yield name, None
    except (PatchError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - a malformed patch must never escape as anything but a PatchError
        raise PatchError(f"malformed patch ({type(e).__name__}: {str(e)[:200]})") from e


def apply_patch(blob: bytes, read_base: Callable[[str], bytes | None], write: Callable[[str, bytes], None]) -> None:
    """Rebuild the new version's files from the base's (`read_base(name)`) and the patch, in memory,
    passing each to `write(name, data)` in name order; sizes as the header declares them, no
    sha256 check. For tests and benchmarks: an install streams (`patch_chunks`, sizes and sha256
    from the signed manifest). PatchError for anything malformed or a base lacking a file."""
    files = patch_files(blob)
    bases: dict[str, bytes | None] = {}

    def base(name: str) -> bytes | None:
        if name not in bases:
            bases[name] = read_base(name)
        return bases[name]

    want: dict[str, tuple[int, str | None]] = {}
    for f in files:
        old = base(f["name"]) if f.get("op") == "same" else None
        size = f.get("size") if f.get("op") != "same" else (0 if old is None else len(old))
        if not is_int(size) or size < 0:
            raise PatchError(f"patch header: {f['name']!r} has a bad size {str(size)[:40]!r}")
        want[f["name"]] = (size, None)
    out = bytearray()
    for name, piece in patch_chunks(
        lambda offset, n: blob[offset : offset + n],
        len(blob),
        want,
        lambda name: None if base(name) is None else len(base(name)),  # type: ignore[arg-type]
        lambda name, offset, n: base(name)[offset : offset + n],  # type: ignore[index]
    ):
        if piece is None:
            write(name, bytes(out))
            out.clear()
        else:
            out += piece


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
