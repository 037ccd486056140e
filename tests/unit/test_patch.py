"""Weight patches (swarmrl/protocol/patch.py): encoding, applying, and refusing what does not fit."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save

from swarmrl.protocol.patch import (
    CHUNK,
    MAGIC,
    PatchError,
    apply_patch,
    encode_patch,
    patch_chunks,
    patch_files,
    sign_descriptor,
    verify_descriptor,
)
from swarmrl.protocol.signing import public_key_hex

KEY = Ed25519PrivateKey.generate()


def weights(seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(300, 64, generator=g) * 0.02).to(dtype),
        "layer.0.weight": (torch.randn(64, 64, generator=g) * 0.02).to(dtype),
        "norm.weight": torch.ones(64, dtype=dtype),
    }


def step(w: dict[str, torch.Tensor], lr: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """One signed-gradient update of size lr in float32, cast back: what a training step publishes."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() - lr * torch.randn(v.shape, generator=g).sign()).to(v.dtype) for k, v in w.items()}


def roundtrip(old: dict[str, bytes], new: dict[str, bytes], **kw) -> tuple[bytes, dict[str, bytes]]:
    blob = encode_patch(new, new.__getitem__, old.get, **kw)
    out: dict[str, bytes] = {}
    apply_patch(blob, old.get, out.__setitem__)
    return blob, out


def test_a_hand_checked_patch_of_one_changed_element():
    old_t = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.int16)
    new_t = torch.tensor([1, 9, 3, 4, 5, 6, 7, 8], dtype=torch.int16)
    old, new = {"model.safetensors": save({"w": old_t})}, {"model.safetensors": save({"w": new_t})}
    blob, out = roundtrip(old, new)
    assert out == new
    (f,) = patch_files(blob)
    assert f["op"] == "spans"
    header, tensor = f["spans"]
    assert header[1:] == [1, "same"]  # the safetensors header: same bytes
    # 8 elements of 2 bytes, one changed (index 1: the gap from -1 is 2), stored in 1-byte gaps
    assert tensor[:5] == [16, 2, "sparse", 1, 1]
    gaps_z, values_z = tensor[5], tensor[6]
    sections = blob[-(gaps_z + values_z) :]
    assert zlib.decompress(sections[:gaps_z]) == bytes([2])
    assert zlib.decompress(sections[gaps_z:]) == struct.pack("<h", 9)


def test_bf16_steps_patch_to_a_fraction_and_rebuild_bit_exactly():
    w0 = weights()
    w1 = step(w0, lr=1e-5)
    old, new = {"model.safetensors": save(w0)}, {"model.safetensors": save(w1)}
    changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(w0.values(), w1.values()))
    total = sum(v.numel() for v in w0.values())
    assert 0 < changed < total // 4  # lr 1e-5 on weights ~0.02 moves few bf16 values (the norm's 1.0 none)
    blob, out = roundtrip(old, new)
    assert out == new
    assert len(blob) < 0.5 * len(new["model.safetensors"])


def test_float32_steps_change_everything_and_are_stored_as_xor():
    w0 = weights(dtype=torch.float32)
    w1 = step(w0, lr=1e-5)
    old, new = {"model.safetensors": save(w0)}, {"model.safetensors": save(w1)}
    blob, out = roundtrip(old, new)
    assert out == new
    kinds = [s[2] for s in patch_files(blob)[0]["spans"]]
    assert kinds == ["same", "xor", "xor", "xor"]  # the header, then every tensor (the norm's 1.0 too)
    assert encode_patch(new, new.__getitem__, old.get, max_bytes=len(blob) - 1) is None  # too big: dropped


def test_same_new_and_resized_files():
    w0 = weights()
    old = {"config.json": b'{"a": 1}', "model.safetensors": save(w0), "gone.txt": b"x"}
    new = {
        "config.json": b'{"a": 1}',  # same
        "model.safetensors": save({**w0, "extra": torch.zeros(3)}),  # another header: stored whole
        "tokenizer.json": b'{"vocab": {}}',  # new
    }
    blob, out = roundtrip(old, new)
    assert out == new
    assert [(f["name"], f["op"]) for f in patch_files(blob)] == [
        ("config.json", "same"),
        ("model.safetensors", "full"),
        ("tokenizer.json", "full"),
    ]


def sparse_patch() -> tuple[dict, dict, bytes]:
    w0 = weights()
    old, new = {"model.safetensors": save(w0)}, {"model.safetensors": save(step(w0, lr=1e-5))}
    return old, new, encode_patch(new, new.__getitem__, old.get)


def rebuild(blob: bytes, old: dict) -> dict:
    out: dict[str, bytes] = {}
    apply_patch(blob, old.get, out.__setitem__)
    return out


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-5],  # truncated
        lambda b: b + b"\0",  # trailing bytes
        lambda b: b"NOTAPTCH" + b[8:],  # not a patch
        lambda b: b[:-40] + bytes([b[-40] ^ 0xFF]) + b[-39:],  # a flipped byte in a compressed section
        lambda b: b[:8] + struct.pack("<I", 1 << 30) + b[12:],  # a header longer than the patch
    ],
    ids=["truncated", "trailing", "magic", "flipped", "header-length"],
)
def test_a_damaged_patch_is_refused(damage):
    old, _, blob = sparse_patch()
    with pytest.raises(PatchError):
        rebuild(damage(blob), old)


def with_header(blob: bytes, edit) -> bytes:
    (n,) = struct.unpack("<I", blob[8:12])
    header = json.loads(blob[12 : 12 + n])
    edit(header["files"])
    h = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(h)) + h + blob[12 + n :]


def test_a_patch_cannot_inflate_past_what_its_header_says_or_write_out_of_place():
    old, new, blob = sparse_patch()
    spans = patch_files(blob)[0]["spans"]
    i = next(i for i, s in enumerate(spans) if s[2] == "sparse")

    def fewer(files):  # claims fewer changed elements than its sections hold: a bomb stops at the claim
        files[0]["spans"][i][3] -= 1

    with pytest.raises(PatchError, match="does not hold exactly"):
        rebuild(with_header(blob, fewer), old)

    # Positions past the span's end, encoded consistently: refused before any write.
    data_len = len(old["model.safetensors"]) - spans[0][0]
    bad_gaps = zlib.compress(np.array([data_len // 2, 1], dtype=np.uint32).tobytes())  # indices n-1 and n
    values = zlib.compress(b"\0" * 4)
    h = json.dumps(
        {
            "files": [
                {
                    "name": "model.safetensors",
                    "op": "spans",
                    "size": len(old["model.safetensors"]),
                    "spans": [[spans[0][0], 1, "same"], [data_len, 2, "sparse", 2, 4, len(bad_gaps), len(values)]],
                }
            ]
        }
    ).encode()
    forged = MAGIC + struct.pack("<I", len(h)) + h + bad_gaps + values
    with pytest.raises(PatchError, match="past the end"):
        rebuild(forged, old)


def test_a_patch_against_a_base_without_the_file_or_of_another_size_is_refused():
    old, _, blob = sparse_patch()
    with pytest.raises(PatchError, match="lacks"):
        rebuild(blob, {})
    with pytest.raises(PatchError, match="bytes"):
        rebuild(blob, {"model.safetensors": old["model.safetensors"] + b"\0\0"})


def test_the_descriptor_is_signed_and_names_the_content():
    manifest = {"version": 5, "files": [{"name": "a", "size": 1, "sha256": "0" * 64}]}
    base = {"version": 4, "files": [{"name": "a", "size": 1, "sha256": "1" * 64}]}
    d = sign_descriptor(KEY, 5, 4, base, manifest, b"patch")
    pub = public_key_hex(KEY)
    assert verify_descriptor(d, pub, manifest) is d
    with pytest.raises(PatchError, match="signature"):
        verify_descriptor({**d, "size": 6}, pub, manifest)
    with pytest.raises(PatchError, match="trainer key"):
        verify_descriptor(d, public_key_hex(Ed25519PrivateKey.generate()), manifest)
    other = {**manifest, "files": [{"name": "a", "size": 1, "sha256": "2" * 64}]}
    with pytest.raises(PatchError, match="other content"):
        verify_descriptor(d, pub, other)
    with pytest.raises(PatchError, match="names version"):
        verify_descriptor(d, pub, {**manifest, "version": 6})


# ---- streaming (patch_chunks): what an install runs -----------------------------------------------


def stream(blob: bytes, old: dict[str, bytes], want: dict[str, tuple[int, str | None]], chunk: int = CHUNK, reads=None):
    """patch_chunks over in-memory bytes: the files rebuilt, and the largest piece seen."""
    reads = [] if reads is None else reads

    def read_patch(offset: int, n: int) -> bytes:
        reads.append((offset, n))
        return blob[offset : offset + n]

    out: dict[str, bytearray] = {}
    largest = 0
    for name, piece in patch_chunks(
        read_patch,
        len(blob),
        want,
        lambda name: len(old[name]) if name in old else None,
        lambda name, offset, n: old[name][offset : offset + n],
        chunk=chunk,
    ):
        out.setdefault(name, bytearray())
        if piece is not None:
            out[name] += piece
            largest = max(largest, len(piece))
    return {k: bytes(v) for k, v in out.items()}, largest


def signed(files: dict[str, bytes]) -> dict[str, tuple[int, str | None]]:
    return {k: (len(v), hashlib.sha256(v).hexdigest()) for k, v in files.items()}


@pytest.mark.parametrize("chunk", [7, 64, 4096, CHUNK])
def test_streaming_rebuilds_every_op_bit_exactly_in_pieces_of_at_most_a_chunk(chunk):
    """Sparse, XOR, same and full, over windows and position batches of every size: small chunks
    cut the spans, the changed positions and the compressed sections at many places."""
    w0, f32 = weights(), weights(dtype=torch.float32)
    old = {"config.json": b'{"a": 1}', "model.safetensors": save(w0), "f32.safetensors": save(f32)}
    new = {
        "config.json": b'{"a": 1}',
        "model.safetensors": save(step(w0, lr=1e-5)),  # sparse
        "f32.safetensors": save(step(f32, lr=1e-5)),  # xor
        "tokenizer.json": b'{"vocab": {}}' * 50,  # full
    }
    blob = encode_patch(new, new.__getitem__, old.get)
    assert {f["op"] for f in patch_files(blob)} == {"same", "spans", "full"}
    assert {s[2] for f in patch_files(blob) if f["op"] == "spans" for s in f["spans"]} == {"same", "sparse", "xor"}
    got, largest = stream(blob, old, signed(new), chunk=chunk)
    assert got == new and largest <= chunk


def test_a_declared_size_other_than_the_manifests_is_refused_before_any_section_is_read():
    old, new, blob = sparse_patch()
    files = signed(new)
    (n,) = struct.unpack("<I", blob[8:12])
    for edit, match in [
        (lambda fs: fs[0].update(op="full", size=64 << 20, z=len(blob) - 12 - n), "the signed manifest says"),
        (lambda fs: fs[0].update(op="full", size=2**63, z=len(blob) - 12 - n), "the signed manifest says"),
        (lambda fs: fs[0].update(size=fs[0]["size"] + 2), "the base's has"),
    ]:
        forged = with_header(blob, edit)
        (m,) = struct.unpack("<I", forged[8:12])
        reads: list[tuple[int, int]] = []
        with pytest.raises(PatchError, match=match):
            stream(forged, old, files, reads=reads)
        assert all(offset + k <= 12 + m for offset, k in reads), reads  # the header only
    with pytest.raises(PatchError, match="does not list"):
        stream(blob, old, {"other.bin": (1, None)})
    with pytest.raises(PatchError, match="does not match the signed manifest"):
        stream(blob, old, {"model.safetensors": (files["model.safetensors"][0], "0" * 64)})


HOSTILE = [2**63, 2**64 + 1, -1, 0, 1.5, 1e308, True, None, "x", [], [[1]], {}, {"a": 1}]


def test_any_hostile_value_anywhere_in_the_header_is_a_patch_error():
    """Every field of every file and span, set to every hostile value: PatchError, and nothing else
    (an OverflowError, TypeError or struct.error escaped the fall-back to the shards before)."""
    old, new, blob = sparse_patch()
    files = signed(new)
    spans = patch_files(blob)[0]["spans"]
    tried = 0
    for key in ["op", "size", "spans", "name"]:
        for value in HOSTILE:
            forged = with_header(blob, lambda fs, k=key, v=value: fs[0].__setitem__(k, v))
            with pytest.raises(PatchError):
                stream(forged, old, files)
            tried += 1
    for i, span in enumerate(spans):
        for j in range(len(span) + 1):
            for value in HOSTILE:

                def edit(fs, i=i, j=j, v=value):
                    s = fs[0]["spans"][i]
                    s[j:] = [v, *s[j + 1 :]]

                with pytest.raises(PatchError):
                    stream(with_header(blob, edit), old, files)
                tried += 1
    assert tried > 100
