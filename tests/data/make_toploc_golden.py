"""Write tests/data/toploc_golden.json: TOPLOC proofs made by the public `toploc` package.

How the committed file was made (from the repository root, with the project's .venv: Python 3.11.7,
torch 2.13.0+cpu, numpy 2.4.6):

    PYTHONPATH=/tmp/toploc_build .venv/bin/python tests/data/make_toploc_golden.py

/tmp/toploc_build held toploc 0.1.4 (its source release, unpacked to /tmp/toploc_src/toploc-0.1.4, pip-installed
from there into that folder, its C++ extensions compiled against the same torch; `toploc.__version__` is
"0.1.4"; the JSON records the versions too). The script only calls the installed package:
`toploc.build_proofs_bytes` and `toploc.build_proofs_base64` (both with decode_batching_size=32, topk=128,
skip_prefill=True, on the list of rows of a [T, H] bf16 tensor) and, for the record,
`toploc.verify_proofs_bytes` on the same tensor. tests/test_proofs.py needs neither toploc nor this
script: it regenerates the activations from (seed, T, H) with `make_bf16` from tests/bf16_inputs.py, checks
them against the recorded sha256, and compares swarmrl.proofs.toploc with what is recorded here.

Inputs are bf16 bit patterns from a counter-based integer hash (splitmix64 over numpy uint64),
so they do not depend on any torch or numpy random generator. Every value is finite: the 15-bit
magnitude pattern is k * 1040 + r with k the (capped) count of leading zeros of one hash and r
uniform in [0, 1040), i.e. at most 30 * 1040 + 1039 = 32239 < 0x7F80, so exponents run over the
whole finite range (subnormals and zeros included) with large magnitudes rare, and the top-128 of
a chunk are spread over many exponents. About 1 value in 16 copies the magnitude of a nearby value
(with its own sign), so top-k sets contain exact ties. A seed is kept only if no chunk has a tie
*at* the top-k boundary (the 128th and 129th largest |values| equal): which of two equal values
torch.topk keeps is not specified, whereas the proof is independent of the order of the chosen
points, so ties inside the top-k are harmless and ties at its edge are avoided.

Cases: T in {1, 5, 31, 32, 33, 64, 100} x H in {128, 256}, [7, 64] and [40, 96]; then [32, 4096] and [64, 4096]
activations (131072 values per chunk, indices up to 131071) for which the reference picked a
modulus below 65497 (two of the top-128 indices are congruent mod 65497), found by trying seeds in
order; and one [32, 4096] case whose indices exceed 65497 but whose modulus is 65497.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import toploc
import torch
from toploc import build_proofs_base64, build_proofs_bytes, verify_proofs_bytes

CHUNK, TOPK, PRIME = 32, 128, 65497
OUT = Path(__file__).with_name("toploc_golden.json")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared input generator
from bf16_inputs import make_bf16  # noqa: E402


def top_magnitudes(x: torch.Tensor) -> list[np.ndarray]:
    """Sorted (descending) 15-bit magnitude patterns of each chunk of CHUNK rows."""
    out = []
    for s in range(0, x.shape[0], CHUNK):
        m = x[s : s + CHUNK].reshape(-1).view(torch.int16).numpy().astype(np.int64) & 0x7FFF
        out.append(np.sort(m)[::-1])
    return out


def boundary_tie(x: torch.Tensor) -> bool:
    return any(len(m) > TOPK and m[TOPK - 1] == m[TOPK] for m in top_magnitudes(x))


def inner_ties(x: torch.Tensor) -> int:
    return sum(TOPK - len(np.unique(m[:TOPK])) for m in top_magnitudes(x))


def record(seed: int, T: int, H: int, note: str) -> dict:
    x = make_bf16(seed, T, H)
    rows = [r for r in x]
    proofs = build_proofs_bytes(rows, CHUNK, TOPK, skip_prefill=True)
    b64 = build_proofs_base64(rows, CHUNK, TOPK, skip_prefill=True)
    assert [base64.b64decode(s) for s in b64] == proofs
    moduli = [int.from_bytes(p[:2], "big") for p in proofs]
    assert 0 not in moduli, "the reference wrote a null proof"
    ref = verify_proofs_bytes(x, proofs, CHUNK, TOPK, skip_prefill=True)
    return {
        "seed": seed,
        "T": T,
        "H": H,
        "note": note,
        "input_sha256": hashlib.sha256(x.view(torch.int16).numpy().astype("<i2").tobytes()).hexdigest(),
        "moduli": moduli,
        "inner_ties": inner_ties(x),
        "proofs_hex": [p.hex() for p in proofs],
        "proofs_base64": b64,
        # What toploc 0.1.4's own verification says about these proofs and these activations:
        # [exp_mismatches, mant_err_mean, mant_err_median] per chunk (for information only).
        "reference_verify": [[r.exp_mismatches, r.mant_err_mean, r.mant_err_median] for r in ref],
    }


def first_seed(T: int, H: int, start: int, want=lambda x: True) -> int:
    seed = start
    while boundary_tie(make_bf16(seed, T, H)) or not want(make_bf16(seed, T, H)):
        seed += 1
    return seed


def ref_moduli(x: torch.Tensor) -> list[int]:
    proofs = build_proofs_bytes([r for r in x], CHUNK, TOPK, skip_prefill=True)
    return [int.from_bytes(p[:2], "big") for p in proofs]


def main() -> None:
    torch.set_num_threads(1)
    cases = []
    for H in (128, 256):
        for T in (1, 5, 31, 32, 33, 64, 100):
            seed = first_seed(T, H, start=1000 * H + T)
            cases.append(record(seed, T, H, "small"))
    for T, H in ((7, 64), (40, 96)):  # chunks of 448 and of 3072 + 768 values
        cases.append(record(first_seed(T, H, start=1000 * H + T), T, H, "small"))
    seed = 1
    for T in (32, 32, 64):  # modulus below 65497 in at least one chunk
        seed = first_seed(T, 4096, start=seed, want=lambda x: min(ref_moduli(x)) < PRIME)
        cases.append(record(seed, T, 4096, "indices collide mod 65497: modulus below 65497"))
        seed += 1
    seed = first_seed(32, 4096, start=seed, want=lambda x: ref_moduli(x) == [PRIME])
    cases.append(record(seed, 32, 4096, "indices above 65497, modulus 65497"))
    doc = {
        "generator": "tests/data/make_toploc_golden.py",
        "toploc_version": toploc.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": sys.version.split()[0],
        "call": "build_proofs_bytes / build_proofs_base64([row for row in x], 32, 128, skip_prefill=True)",
        "chunk_size": CHUNK,
        "topk": TOPK,
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(cases)} cases, {sum(len(c['moduli']) for c in cases)} proofs, {OUT.stat().st_size} bytes -> {OUT}")
    for c in cases:
        print(
            c["seed"],
            c["T"],
            c["H"],
            c["moduli"],
            "ties",
            c["inner_ties"],
            "ref exp_mismatches",
            [r[0] for r in c["reference_verify"]],
        )


if __name__ == "__main__":
    main()
