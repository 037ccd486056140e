"""Weight patches on real runs' versions: how big a patch is against its full version, what it
costs to make and apply, and how long a version takes to reach a client over a capped link with
and without it (docs/broadcast.md, "Patches").

For each run directory, each pair of consecutive versions in <run>/broadcast (full versions; a
LoRA run's adapters are skipped) is measured as published (the run's `sampling.dtype`) and cast
to bfloat16 (what a bf16 publication of the same training would ship: the trainer casts its
float32 masters the same way). Then the last pair goes through a real origin (ShardServer, capped
at --link-mib-s) to a client holding the older version, fetched with and without patches.

    python benchmarks/bench_patches.py --run-dir RUN [--run-dir RUN ...] [--link-mib-s 10] [--out F.jsonl]

--hostile (no run directory needed) measures instead, on a synthetic bfloat16 model of --mb MiB
(docs/security.md, "Relays that lie and patches that overflow"): a worker's time to a version
behind a relay that lists it as incoming and answers 404 to everything (--liar: with no progress
figure, or with one that never grows), with the origin behind it and the default waits; then the
peak traced memory (tracemalloc) of an honest patch install, worker (fetch_version) and relay
(mirror_version), as a multiple of the file, and the calm-path install time (median of --repeats).

    python benchmarks/bench_patches.py --hostile [--mb 96] [--liar silent --liar stuck] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file, save_file

from swarmrl.protocol.patch import apply_patch, encode_patch
from swarmrl.protocol.signing import public_key_hex
from swarmrl.transport.broadcast import (
    ShardRequestHandler,
    ShardServer,
    fetch_version,
    mirror_version,
    publish_version,
)
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


# ---- --hostile -----------------------------------------------------------------------------------


def bf16_model(folder: Path, mib: int, changed: float, seed: int) -> Path:
    """A safetensors file of `mib` MiB of bfloat16 weights (one tensor, written without torch) and a
    config; with `changed` > 0 the weights of `seed` 0 with that share of elements moved by one ulp
    (what a small bf16 step does: most elements keep their bits)."""
    n = (mib << 20) // 2
    w = np.random.default_rng(0).integers(0x3C00, 0xBC00, size=n, dtype=np.uint16)  # |w| ~ 0.01..1
    if changed:
        idx = np.random.default_rng(seed).choice(n, size=int(changed * n), replace=False)
        w[idx] += 1
    header = json.dumps({"w": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    folder.mkdir(parents=True)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.write(w.tobytes())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "seed": seed}))
    return folder


class _Liar(ShardRequestHandler):
    """A relay that lists every version up to `upto` as incoming and serves nothing (404); with
    `figure`, it reports a progress figure for them that never grows."""

    upto, figure = 0, False

    def do_GET(self):
        if self.path != "/versions":
            return self._not_found(True)
        listing = {"versions": [], "incoming": list(range(self.upto + 1))}
        if self.figure:
            listing["progress"] = {str(v): 1 << 20 for v in range(self.upto + 1)}
        self._send_small(200, json.dumps(listing).encode(), "application/json", True)


def behind_liar(origin: str, pub: str, version: int, figure: bool, tmp: Path) -> float:
    """Seconds for a worker holding nothing to get `version` with a lying relay before the origin,
    with fetch_version's default waits."""

    class Liar(_Liar):
        upto = version

    Liar.figure = figure
    server = ShardServer(tmp / "liar-root")
    server.handler_class = Liar
    (tmp / "liar-root").mkdir(exist_ok=True)
    with server:
        t0 = time.perf_counter()
        fetch_version(version, [server.url, origin], tmp / f"liar-client-{figure}", public_key=pub)
        return time.perf_counter() - t0


def traced(fn) -> tuple[float, int]:
    """(seconds, peak bytes traced) of fn()."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
        return time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def hostile(args) -> list[dict]:
    key = Ed25519PrivateKey.generate()
    pub = public_key_hex(key)
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        m0 = bf16_model(tmp / "m0", args.mb, 0.0, 0)
        m1 = bf16_model(tmp / "m1", args.mb, 0.03, 1)
        size = (m1 / "model.safetensors").stat().st_size
        root = tmp / "origin"
        man0 = publish_version(m0, root, 0, key=key, shard_size=4 << 20)
        publish_version(m1, root, 1, key=key, parent=0, shard_size=4 << 20,
                        patch_from={"dir": m0, "manifest": man0, "max_share": 0.5})  # fmt: skip
        patch = (root / "v000001" / "patch.bin").stat().st_size
        print(f"model.safetensors {size / 2**20:.0f} MiB bf16, 3% of elements changed: patch {patch / 2**20:.2f} MiB")
        with ShardServer(root) as origin:
            for liar in args.liar or ["silent", "stuck"]:
                s = behind_liar(origin.url, pub, 1, liar == "stuck", tmp)
                rows.append({"measure": "behind_lying_relay", "liar": liar, "seconds": s})
                print(f"worker behind a lying relay ({liar}: incoming, 404 on everything): v1 in {s:.1f} s", flush=True)
            times = []
            for i in range(args.repeats):
                client = tmp / f"calm-{i}"
                fetch_version(0, [origin.url], client, public_key=pub, relay_wait_s=0)
                t0 = time.perf_counter()
                fetch_version(1, [origin.url], client, public_key=pub, relay_wait_s=0)
                times.append(time.perf_counter() - t0)
                shutil.rmtree(client)
            rows.append({"measure": "calm_patch_install", "seconds": statistics.median(times), "runs": times})
            print(f"calm-path patch install (worker): median {statistics.median(times):.2f} s of "
                  f"{', '.join(f'{x:.2f}' for x in times)}", flush=True)  # fmt: skip
            client, relay = tmp / "mem-client", tmp / "mem-relay"
            fetch_version(0, [origin.url], client, public_key=pub, relay_wait_s=0)
            mirror_version(0, [origin.url], relay, public_key=pub)
            for who, fn in (
                ("worker", lambda: fetch_version(1, [origin.url], client, public_key=pub, relay_wait_s=0)),
                ("relay", lambda: mirror_version(1, [origin.url], relay, public_key=pub)),
            ):
                s, peak = traced(fn)
                rows.append({"measure": "patch_install_peak", "who": who, "peak_bytes": peak, "file_bytes": size,
                             "multiple": peak / size, "seconds_traced": s})  # fmt: skip
                print(
                    f"patch install peak ({who}): {peak / 2**20:.1f} MiB traced = {peak / size:.3f}x the file",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", action="append", type=Path)
    ap.add_argument("--hostile", action="store_true", help="the lying relay and patch memory measurements instead")
    ap.add_argument("--mb", type=int, default=96, help="--hostile: the model file's size in MiB")
    ap.add_argument(
        "--liar",
        action="append",
        choices=["silent", "stuck"],
        help="--hostile: which lying relays (default both; each costs relay_wait_max_s before the fix)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="--hostile: calm-path installs timed")
    ap.add_argument("--link-mib-s", type=float, default=10.0, help="the origin's cap for the side-by-side fetch")
    ap.add_argument("--out", type=Path, help="append one JSON line per measurement")
    args = ap.parse_args()
    if args.hostile:
        rows = hostile(args)
        if args.out:
            with open(args.out, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        return
    if not args.run_dir:
        ap.error("--run-dir is required (or --hostile)")
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
