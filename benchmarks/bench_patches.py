"""Weight patches on real runs' versions: how big a patch is against its full version, what it
costs to make and apply, and how long a version takes to reach a client over a capped link with
and without it (docs/broadcast.md, "Patches").

For each run directory, each pair of consecutive versions in <run>/broadcast (full versions; a
LoRA run's adapters are skipped) is measured as published (the run's `sampling.dtype`) and cast
to bfloat16 (what a bf16 publication of the same training would ship: the trainer casts its
float32 masters the same way). Then the last pair goes through a real origin (ShardServer, capped
at --link-mib-s) to a client holding the older version, fetched with and without patches.

    python benchmarks/bench_patches.py --run-dir RUN [--run-dir RUN ...] [--link-mib-s 10] [--out F.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file, save_file

from swarmrl.protocol.patch import apply_patch, encode_patch
from swarmrl.protocol.signing import public_key_hex
from swarmrl.transport.broadcast import ShardServer, fetch_version, publish_version
from swarmrl.transport.broadcast.patches import read_span


def versions(run: Path, tmp: Path) -> list[Path]:
    """The run's full versions as HF folders, rebuilt from what its trainer published
    (<run>/broadcast keeps them after the run; <run>/policies is pruned), consecutive ones only."""
    out = []
    for vdir in sorted(p for p in (run / "broadcast").iterdir() if re.fullmatch(r"v[0-9]{6}", p.name)):
        manifest = json.loads((vdir / "manifest.json").read_text())
        if "base" in manifest:
            continue  # a LoRA adapter
        folder = tmp / f"{run.name}-{vdir.name}"
        folder.mkdir()
        for f in manifest["files"]:
            data = read_span(vdir / "shards", manifest["shard_size"], f["offset"], f["size"])
            (folder / f["name"]).write_bytes(data)
        out.append(folder)
    return out


def as_bf16(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name == "model.safetensors":
            w = load_file(str(p))
            save_file(
                {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}, str(dst / p.name)
            )
        elif p.is_file() and not p.name.startswith("."):
            shutil.copy(p, dst / p.name)
    return dst


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def measure_pair(old: Path, new: Path) -> dict:
    fo, fn = files(old), files(new)
    t0 = time.perf_counter()
    blob = encode_patch(fn, fn.__getitem__, fo.get)
    t1 = time.perf_counter()
    out: dict[str, bytes] = {}
    apply_patch(blob, fo.get, out.__setitem__)
    t2 = time.perf_counter()
    assert out == fn, "a patch did not rebuild the version"
    wo, wn = load_file(str(old / "model.safetensors")), load_file(str(new / "model.safetensors"))
    n = sum(v.numel() for v in wn.values())
    moved = sum(int((wo[k].view(torch.uint8) != wn[k].view(torch.uint8)).view(-1, wn[k].element_size()).any(1).sum())
                for k in wn)  # fmt: skip
    full = sum(len(v) for v in fn.values())
    return {
        "full_bytes": full,
        "patch_bytes": len(blob),
        "share": len(blob) / full,
        "changed_elements": moved / n,
        "encode_s": t1 - t0,
        "apply_s": t2 - t1,
    }


def over_link(old: Path, new: Path, mib_s: float, tmp: Path) -> dict:
    """Seconds for a client holding `old` to install `new` from a capped origin, with and without patches."""
    key = Ed25519PrivateKey.generate()
    root = tmp / "origin"
    m0 = publish_version(old, root, 0, key=key, shard_size=1 << 20)
    publish_version(new, root, 1, key=key, parent=0, shard_size=1 << 20,
                    patch_from={"dir": old, "manifest": m0, "max_share": 1.0})  # fmt: skip
    out = {}
    with ShardServer(root, max_bytes_per_s=int(mib_s * (1 << 20))) as origin:
        for patches in (True, False):
            client = tmp / f"client-{patches}"
            fetch_version(0, [origin.url], client, public_key=public_key_hex(key), relay_wait_s=0)
            t0 = time.perf_counter()
            fetch_version(1, [origin.url], client, public_key=public_key_hex(key), relay_wait_s=0, patches=patches)
            out["with_patch_s" if patches else "full_s"] = time.perf_counter() - t0
    shutil.rmtree(root)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", action="append", required=True, type=Path)
    ap.add_argument("--link-mib-s", type=float, default=10.0, help="the origin's cap for the side-by-side fetch")
    ap.add_argument("--out", type=Path, help="append one JSON line per measurement")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for run in args.run_dir:
            vs = versions(run, tmp)
            if len(vs) < 2:
                raise SystemExit(f"{run}/broadcast holds {len(vs)} full versions; need 2 consecutive ones")
            for precision in ("published", "bfloat16"):
                if precision == "bfloat16":
                    vs = [as_bf16(v, tmp / f"{v.name}-bf16") for v in vs]
                pairs = list(zip(vs, vs[1:]))
                for a, b in pairs:
                    r = measure_pair(a, b)
                    r.update(run=str(run), precision=precision, old=a.name, new=b.name)
                    rows.append(r)
                    print(
                        f"{run.name} {precision:9s} {r['old']}->{r['new']}: {r['full_bytes'] / 2**20:8.2f} MiB full, "
                        f"patch {r['patch_bytes'] / 2**20:8.2f} MiB = {r['share']:6.1%}; elements changed "
                        f"{r['changed_elements']:6.1%}; encode {r['encode_s']:.2f} s, apply {r['apply_s']:.2f} s",
                        flush=True,
                    )
                link = over_link(*pairs[-1], args.link_mib_s, tmp)
                link.update(run=str(run), precision=precision, link_mib_s=args.link_mib_s)
                rows.append(link)
                print(
                    f"{run.name} {precision:9s} over {args.link_mib_s:g} MiB/s: full {link['full_s']:.2f} s, "
                    f"with patch {link['with_patch_s']:.2f} s ({link['full_s'] / link['with_patch_s']:.1f}x)",
                    flush=True,
                )
            for p in tmp.glob(f"{run.name}-*"):
                shutil.rmtree(p)
    shares = {}
    for r in rows:
        if "share" in r:
            shares.setdefault((Path(r["run"]).name, r["precision"]), []).append(r["share"])
    for (run, precision), s in shares.items():
        print(f"{run} {precision}: patch share median {statistics.median(s):.1%} (min {min(s):.1%}, max {max(s):.1%}) "
              f"over {len(s)} steps")  # fmt: skip
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
