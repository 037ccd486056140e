"""Weight broadcast on loopback: a relay against a raw HTTP copy, and a relay tree under load.

1. One client's download throughput through a relay (signed manifest, shards fetched in
   parallel and verified, files reassembled, checked and installed) as a ratio to a raw HTTP
   copy of the same bytes from the same machine (the standard library's http.server, one
   urllib stream per file written to disk, no checks). Goal: at least 0.8.
2. The time for 8 clients at once through a tree of an origin and 2 relays, relative to one
   client alone through the same tree.

    python benchmarks/bench_broadcast.py [--mb 64] [--shard-mb 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.protocol.signing import public_key_hex
from swarmrl.transport.broadcast import ShardServer, fetch_version, publish_version, read_versions
from swarmrl.transport.relay import Relay


def fake_model(folder: Path, mb: int) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 128}))
    with open(folder / "model.safetensors", "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    (folder / "tokenizer.json").write_text("{}")


class _Quiet(SimpleHTTPRequestHandler):
    cap = None  # bytes/s, like ShardServer(max_bytes_per_s=...)

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        if self.cap is None:
            return super().copyfile(source, outputfile)
        t0, sent = time.monotonic(), 0
        while chunk := source.read(1 << 16):
            outputfile.write(chunk)
            sent += len(chunk)
            ahead = sent / self.cap - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


def raw_copy(url: str, names: list[str], dest: Path) -> None:
    dest.mkdir(parents=True)
    for name in names:
        with urllib.request.urlopen(f"{url}/{name}") as r, open(dest / name, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)


def wait_for(pred, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the relays to mirror the version")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--shard-mb", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--cap-mib-s",
        type=float,
        default=100.0,
        help="also compare both with the server capped at this rate (a realistic link), 0: skip",
    )
    ap.add_argument("--out", default="bench_broadcast.json")
    args = ap.parse_args()
    key = Ed25519PrivateKey.generate()
    pub = public_key_hex(key)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "policies" / "v000001"
        fake_model(model, args.mb)
        total = sum(p.stat().st_size for p in model.iterdir())
        publish_version(model, tmp / "origin", 1, key=key, parent=0, shard_size=args.shard_mb << 20)
        results: dict = {"bytes": total, "shard_bytes": args.shard_mb << 20}
        raw = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(model)))
        threading.Thread(target=raw.serve_forever, daemon=True).start()
        raw_url = f"http://127.0.0.1:{raw.server_address[1]}"
        names = sorted(p.name for p in model.iterdir())
        with ShardServer(tmp / "origin") as origin:
            relays = [
                Relay([origin.url], tmp / f"relay{i}", public_key=pub, log=lambda *_: None).start() for i in range(2)
            ]
            try:
                wait_for(lambda: all(1 in read_versions(r.root) for r in relays))
                raw_s, relay_s = [], []
                for i in range(args.repeats):  # alternated, so drift hits both
                    t0 = time.perf_counter()
                    raw_copy(raw_url, names, tmp / f"raw{i}")
                    raw_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    fetch_version(1, [relays[0].url], tmp / f"client{i}", public_key=pub)
                    relay_s.append(time.perf_counter() - t0)
                    shutil.rmtree(tmp / f"raw{i}")
                    shutil.rmtree(tmp / f"client{i}")
                results["raw_s"], results["relay_s"] = statistics.median(raw_s), statistics.median(relay_s)
                results["relay_over_raw_throughput"] = results["raw_s"] / results["relay_s"]
                if args.cap_mib_s:
                    cap = args.cap_mib_s * 2**20
                    _Quiet.cap = cap
                    capped = Relay(
                        [origin.url], tmp / "relay-capped", public_key=pub, max_bytes_per_s=cap, log=lambda *_: None
                    ).start()
                    try:
                        wait_for(lambda: 1 in read_versions(capped.root))
                        t0 = time.perf_counter()
                        raw_copy(raw_url, names, tmp / "raw-capped")
                        results["capped_raw_s"] = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        fetch_version(1, [capped.url], tmp / "client-capped", public_key=pub)
                        results["capped_relay_s"] = time.perf_counter() - t0
                    finally:
                        capped.close()
                        _Quiet.cap = None
                    results["capped_ratio"] = results["capped_raw_s"] / results["capped_relay_s"]

                def one(i, out):
                    t0 = time.perf_counter()
                    fetch_version(1, [relays[i % 2].url, relays[(i + 1) % 2].url], tmp / f"c{i}", public_key=pub)
                    out[i] = time.perf_counter() - t0

                solo: dict = {}
                one(0, solo)
                shutil.rmtree(tmp / "c0")
                many: dict = {}
                t0 = time.perf_counter()
                threads = [threading.Thread(target=one, args=(i, many)) for i in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                results["one_client_s"] = solo[0]
                results["eight_clients_s"] = time.perf_counter() - t0
                results["eight_over_one"] = results["eight_clients_s"] / results["one_client_s"]
                for i in range(8):
                    assert (tmp / f"c{i}" / "v000001" / "model.safetensors").read_bytes() == (
                        model / "model.safetensors"
                    ).read_bytes()
            finally:
                for r in relays:
                    r.close()
                raw.shutdown()
    Path(args.out).write_text(json.dumps(results, indent=1))
    mb = total / 2**20
    print(f"{mb:.0f} MiB in {args.shard_mb} MiB shards, loopback, {os.cpu_count()} CPUs")
    print(f"raw HTTP copy     {results['raw_s']:.2f} s  ({mb / results['raw_s']:.0f} MiB/s)")
    print(
        f"through a relay   {results['relay_s']:.2f} s  ({mb / results['relay_s']:.0f} MiB/s): "
        f"{results['relay_over_raw_throughput']:.2f} of the raw throughput"
    )
    if "capped_ratio" in results:
        print(
            f"both servers capped at {args.cap_mib_s:.0f} MiB/s: raw {results['capped_raw_s']:.2f} s, relay "
            f"{results['capped_relay_s']:.2f} s: {results['capped_ratio']:.2f} of the raw throughput"
        )
    print(
        f"8 clients, 2-relay tree: {results['eight_clients_s']:.2f} s vs one client {results['one_client_s']:.2f} s "
        f"({results['eight_over_one']:.1f}x the time for 8x the bytes)"
    )


if __name__ == "__main__":
    main()
