"""A swarm rehearsal on one machine (issue 32): regions as network namespaces behind shaped links,
a relay and several workers in each, workers killed with SIGKILL mid-lease and restarted, late
joiners; the trainer (origin), orchestrator and validator in the root namespace, reachable from
the regions only through their links. Not a test; needs root (ip netns, tc). Prints per version
and per region how long the swarm took to hold it, what the origin and the relays served, what
leases were dropped, the staleness at training time, and checks that no group was lost or trained
twice.

    sudo python benchmarks/rehearse_swarm.py [--regions 2] [--workers 4] [--late 1] [--mbit 8]
        [--steps 12] [--kill-every-s 15] [--patches on|off] [--out DIR]

Topology: root holds 10.40.0.1 (on its loopback: the address every region dials) and one veth
pair per region i (root side 10.40.i.1, region side 10.40.i.2). Each veth direction has a `tbf`
qdisc of --mbit (the kernel here has tbf, not netem: bandwidth, no added latency), so the origin
and the orchestrator sit behind the region's link and the relay serves its region's workers
over the namespace's own loopback, unshaped. All workers of a region share its one address, as
behind a NAT: per-address admission applies to them together.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT_IP = "10.40.0.1"
OPORT, WPORT, RPORT = 18700, 18701, 18702
LOADED = re.compile(r"policy v(\d+) loaded .* in ([0-9.]+) s; (.*)")
MIRRORED = re.compile(r"relay: mirrored v(\d+) in ([0-9.]+) s")


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ns(i: int) -> str:
    return f"swr{i}"


def net_up(regions: int, mbit: float) -> None:
    net_down(regions)
    sh("ip", "addr", "add", f"{ROOT_IP}/32", "dev", "lo")
    for i in range(1, regions + 1):
        a, b = f"swv{i}a", f"swv{i}b"
        sh("ip", "netns", "add", ns(i))
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", b, "netns", ns(i))
        sh("ip", "addr", "add", f"10.40.{i}.1/24", "dev", a)
        sh("ip", "link", "set", a, "up")
        inside = ("ip", "netns", "exec", ns(i))
        sh(*inside, "ip", "addr", "add", f"10.40.{i}.2/24", "dev", b)
        sh(*inside, "ip", "link", "set", b, "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        sh(*inside, "ip", "route", "add", "default", "via", f"10.40.{i}.1")
        for dev, pre in ((a, ()), (b, inside)):
            sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb",
               "latency", "2s")  # fmt: skip


def net_down(regions: int) -> None:
    for i in range(1, regions + 1):
        sh("ip", "netns", "del", ns(i), check=False)
        sh("ip", "link", "del", f"swv{i}a", check=False)
    sh("ip", "addr", "del", f"{ROOT_IP}/32", "dev", "lo", check=False)


def dev_bytes(dev: str, namespace: str | None = None) -> tuple[int, int]:
    """(received, transmitted) bytes of an interface, from /proc/net/dev (inside `namespace`)."""
    cmd = ["cat", "/proc/net/dev"] if namespace is None else ["ip", "netns", "exec", namespace, "cat", "/proc/net/dev"]
    for line in subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == dev:
            f = rest.split()
            return int(f[0]), int(f[8])
    raise RuntimeError(f"no interface {dev}")


class Proc:
    """A role's process whose output lines are written to `log` with a wall-clock time each."""

    def __init__(self, name: str, args: list[str], log: Path, namespace: str | None = None):
        self.name, self.args, self.log, self.namespace = name, args, log, namespace
        self.p: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Proc:
        pre = ["ip", "netns", "exec", self.namespace] if self.namespace else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            [*pre, sys.executable, "-m", "swarmrl.cli", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.starts += 1
        p, out = self.p, open(self.log, "a")

        def pump():
            for line in p.stdout:
                out.write(f"{time.time():.3f} {line}")
                out.flush()
            out.close()

        threading.Thread(target=pump, daemon=True).start()
        return self

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


def wait_for(cond, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"rehearsal: timed out waiting for {what}")
        time.sleep(0.2)


def rehearse(args) -> dict:
    out = Path(args.out).resolve()
    run = out / "run"
    run.mkdir(parents=True)
    overrides = [
        "--trainer.steps", str(args.steps),
        "--trainer.weights_host", "0.0.0.0",
        "--trainer.weights_port", str(WPORT),
        "--trainer.weights_url", f"http://{ROOT_IP}:{WPORT}",
        "--orchestrator.host", "0.0.0.0",
        "--orchestrator.port", str(OPORT),
        "--sampling.dtype", args.dtype,
        "--broadcast.patches", args.patches,
        "--broadcast.patch_max_share", "1.0",
        "--eval.every", "0",
        "--seed", str(args.seed),
        *(["--trainer.checkpoint_every", "1", "--validator.mode", "external"] if args.chaos else []),
    ]  # fmt: skip
    subprocess.run([sys.executable, "-m", "swarmrl.cli", "rl", "--prepare", "--run-dir", str(run), *overrides],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    logs = out / "logs"
    logs.mkdir()
    orch = Proc("orchestrator", ["orchestrator", "--run-dir", str(run)], logs / "orchestrator.log").start()
    wait_for(lambda: (run / "orchestrator.json").exists(), "the orchestrator")
    trainer = Proc(
        "trainer",
        ["trainer", "--run-dir", str(run), "--orchestrator", f"http://127.0.0.1:{OPORT}"],
        logs / "trainer.log",
    ).start()
    wait_for(lambda: (run / "origin.json").exists() and (run / "trainer.pub").exists(), "the trainer's origin")
    trusted = [orch, trainer]
    if args.chaos:
        validator = Proc(
            "validator",
            ["validator", "--orchestrator", f"http://127.0.0.1:{OPORT}", "--token-file", str(run / "validator.token")]
            + ["--cache-dir", str(out / "validator"), "--trainer-key", str(run / "trainer.pub")],
            logs / "validator.log",
        ).start()
        trusted.append(validator)
    seen: dict[int, float] = {}  # version -> when the origin first held it
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for p in (run / "broadcast").glob("v[0-9]*"):
                if (p / "manifest.json").exists():
                    seen.setdefault(int(p.name[1:]), time.time())
            stop.wait(0.05)

    threading.Thread(target=watch, daemon=True).start()
    relays = [
        Proc(
            f"relay-{i}",
            ["relay", "--upstream", f"http://{ROOT_IP}:{WPORT}", "--cache-dir", str(out / f"relay-{i}")]
            + ["--host", f"10.40.{i}.2", "--port", str(RPORT), "--trainer-key", str(run / "trainer.pub")],
            logs / f"relay-{i}.log",
            ns(i),
        ).start()
        for i in range(1, args.regions + 1)
    ]

    def worker(i: int, k: int) -> Proc:
        d = out / f"w{i}-{k}"
        return Proc(
            f"w{i}-{k}",
            ["worker", "--orchestrator", f"http://{ROOT_IP}:{OPORT}", "--insecure", "--name", f"w{i}-{k}"]
            + ["--key-file", str(d / "key.pem"), "--cache-dir", str(d), "--trainer-key", str(run / "trainer.pub")]
            + ["--relays", f"http://10.40.{i}.2:{RPORT}"],
            logs / f"w{i}-{k}.log",
            ns(i),
        )

    trusted += relays
    workers = [worker(i, k).start() for i in range(1, args.regions + 1) for k in range(args.workers)]
    late = [worker(i, args.workers + k) for i in range(1, args.regions + 1) for k in range(args.late)]
    before = {i: (dev_bytes(f"swv{i}a"), dev_bytes("lo", ns(i))) for i in range(1, args.regions + 1)}
    kills: list[tuple[float, str]] = []
    rng = random.Random(args.seed)
    t_start, next_kill, late_started = time.time(), time.time() + args.kill_every_s, False
    next_chaos = time.time() + args.chaos
    restarting: set[str] = set()
    order: list[Proc] = []

    def restart(p: Proc) -> None:
        if p is trainer:  # from its newest checkpoint; the steps after it are redone
            p.args = [*p.args, "--resume"] if "--resume" not in p.args else p.args
        p.start()
        restarting.discard(p.name)

    try:
        while trainer.alive() or trainer.name in restarting:
            time.sleep(0.5)
            steps = _steps(run)
            if not late_started and len(steps) >= args.steps // 3:
                for w in late:
                    w.start()
                workers += late
                late_started = True
            if args.kill_every_s and time.time() > next_kill:
                live = [w for w in workers if w.alive()]
                if live:
                    victim = rng.choice(live)
                    victim.kill9()
                    kills.append((time.time(), victim.name))
                    threading.Timer(args.restart_after_s, victim.start).start()
                next_kill = time.time() + args.kill_every_s
            if args.chaos and time.time() > next_chaos and not (run / "stop").exists():
                # Every role in turn, in a shuffled order, so each is hit in a run of a few minutes.
                if not order:
                    order = rng.sample(trusted, len(trusted))
                live = [p for p in order if p.alive() and p.name not in restarting]
                if live:
                    victim = live[0]
                    order.remove(victim)
                    victim.kill9()
                    kills.append((time.time(), victim.name))
                    restarting.add(victim.name)
                    threading.Timer(args.restart_after_s, restart, args=(victim,)).start()
                next_chaos = time.time() + args.chaos * (0.5 + rng.random())
            if time.time() - t_start > args.timeout_s:
                raise SystemExit("rehearsal: the run did not finish in time")
        if trainer.p.returncode != 0:
            raise SystemExit(f"rehearsal: the trainer failed; see {logs / 'trainer.log'}")
        wall = time.time() - t_start
        after = {i: (dev_bytes(f"swv{i}a"), dev_bytes("lo", ns(i))) for i in range(1, args.regions + 1)}
    finally:
        stop.set()
        time.sleep(max(args.restart_after_s, 1.0))  # let pending restarts happen, then stop them
        for p in [*workers, *late, *trusted]:
            p.kill9()
    return report(args, run, logs, seen, before, after, kills, wall)


def _steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if "time/step" in r]


def _loads(log: Path) -> list[tuple[float, int, str]]:
    """(time, version, how) of every version a worker loaded."""
    out = []
    for line in log.read_text().splitlines():
        t, _, rest = line.partition(" ")
        if m := LOADED.search(rest):
            out.append((float(t), int(m.group(1)), "patch" if "and a patch of" in m.group(3) else "shards"))
    return out


def report(args, run, logs, seen, before, after, kills, wall) -> dict:
    regions = range(1, args.regions + 1)
    per_version: dict[int, dict] = {}
    for v, t_pub in sorted(seen.items()):
        row = {"version": v}
        for i in regions:
            for line in (logs / f"relay-{i}.log").read_text().splitlines():
                t, _, rest = line.partition(" ")
                if (m := MIRRORED.search(rest)) and int(m.group(1)) == v:
                    row[f"relay{i}"] = {"mirror_s": float(m.group(2)), "after_publish_s": float(t) - t_pub}
            delays, how = [], []
            for log in logs.glob(f"w{i}-*.log"):
                for t, version, via in _loads(log):
                    if version == v:
                        delays.append(t - t_pub)
                        how.append(via)
            row[f"region{i}"] = {
                "workers": len(delays),
                "all_hold_s": max(delays) if delays else None,
                "median_s": statistics.median(delays) if delays else None,
                "patched": how.count("patch"),
            }
        per_version[v] = row
    traffic = {
        f"region{i}": {
            "origin_and_orchestrator_to_region_bytes": after[i][0][1] - before[i][0][1],
            "region_to_root_bytes": after[i][0][0] - before[i][0][0],
            "inside_region_loopback_bytes": after[i][1][1] - before[i][1][1],
        }
        for i in regions
    }
    steps = _steps(run)
    db = sqlite3.connect(run / "orchestrator.sqlite")
    trained = [json.loads(x) for x in (run / "consumed.jsonl").read_text().splitlines()]
    batches = dict(db.execute("SELECT step, group_ids FROM batches").fetchall())
    ids = [i for t in trained for i in t["group_ids"]]
    consumed = dict(db.execute("SELECT id, step FROM groups WHERE state = 'consumed'").fetchall())
    integrity = {
        "steps_trained": [t["step"] for t in trained],
        "every_batch_as_recorded": all(json.loads(batches[t["step"]]) == t["group_ids"] for t in trained),
        "no_group_trained_twice": len(ids) == len(set(ids)),
        "consumed_are_the_trained": sorted(consumed) == sorted(ids),
        "group_states": dict(db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall()),
    }
    expired = db.execute("SELECT COUNT(*), COALESCE(SUM(slots), 0) FROM penalties").fetchone()
    integrity["versions_republished_with_other_weights"] = (logs / "trainer.log").read_text().count("republishing v")
    summary = {
        "args": vars(args),
        "wall_s": wall,
        "cpu": _cpu(),
        "kills": kills,
        "versions": list(per_version.values()),
        "traffic": traffic,
        "dropped_leases": {"penalties": expired[0], "expired_prompts": expired[1]},
        "staleness": {
            "off_policy_max": [r.get("off_policy/max") for r in steps],
            "off_policy_mean": [r.get("off_policy/mean") for r in steps],
        },
        "integrity": integrity,
        "accuracy": [
            json.loads(x).get("eval/accuracy")
            for x in (run / "metrics.jsonl").read_text().splitlines()
            if "eval/accuracy" in x
        ],
    }
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    _print(summary, regions)
    return summary


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {os.cpu_count()} CPUs"
    return "unknown"


def _print(s: dict, regions) -> None:
    killed = sorted({name for _, name in s["kills"]})
    print(
        f"{s['cpu']}; {s['wall_s']:.0f} s; {len(s['kills'])} kills ({', '.join(killed)}); "
        f"patches {s['args']['patches']}"
    )
    head = " | ".join(f"region {i}: relay has it (s), workers, all hold (s), median (s), patched" for i in regions)
    print(f"| version | {head} |")
    for row in s["versions"]:
        if row["version"] == 0:
            continue  # published before any worker started: its times are the workers' start-up
        cells = []
        for i in regions:
            relay = row.get(f"relay{i}")
            cell = f"{relay['after_publish_s']:.2f}" if relay else "-"
            r = row[f"region{i}"]
            if r["workers"]:
                cell += f", {r['workers']}, {r['all_hold_s']:.2f}, {r['median_s']:.2f}, {r['patched']}"
            cells.append(cell)
        print(f"| v{row['version']} | " + " | ".join(cells) + " |")
    for i in regions:
        lag = [r[f"relay{i}"]["after_publish_s"] for r in s["versions"] if r.get(f"relay{i}") and r["version"]]
        if lag:
            print(f"region {i}: the relay held each version {statistics.median(lag):.2f} s after publication (median), "
                  f"{max(lag):.2f} s at most")  # fmt: skip
    for name, t in s["traffic"].items():
        print(
            f"{name}: into the region over its link {t['origin_and_orchestrator_to_region_bytes'] / 2**20:.1f} MiB, "
            f"out of it {t['region_to_root_bytes'] / 2**20:.1f} MiB, inside it {t['inside_region_loopback_bytes'] / 2**20:.1f} MiB"  # noqa: E501
        )
    print(f"dropped leases: {s['dropped_leases']}; staleness (max per step): {s['staleness']['off_policy_max']}")
    print(f"integrity: {s['integrity']}")
    print(f"held-out accuracy: {s['accuracy']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4, help="workers per region from the start")
    ap.add_argument("--late", type=int, default=1, help="workers per region joining a third of the way in")
    ap.add_argument("--mbit", type=float, default=8.0, help="each region's link, each direction (tbf)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--kill-every-s", type=float, default=15.0, help="SIGKILL a random live worker this often (0: never)"
    )
    ap.add_argument("--restart-after-s", type=float, default=5.0)
    ap.add_argument("--patches", choices=["on", "off"], default="on")
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="sampling.dtype (published weights)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--chaos",
        type=float,
        default=0.0,
        help="also SIGKILL a trusted role (orchestrator, trainer, validator, each relay; all in turn, "
        "shuffled) about this often (seconds; 0: never), restarting it after --restart-after-s (the "
        "trainer with --resume); runs the validator as its own process and checkpoints every step",
    )
    ap.add_argument("--timeout-s", type=float, default=1200)
    ap.add_argument("--out", required=True, help="a new folder for the run, the logs and summary.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("rehearse_swarm.py needs root (ip netns, tc)")
    net_up(args.regions, args.mbit)
    try:
        rehearse(args)
    finally:
        net_down(args.regions)


if __name__ == "__main__":
    main()
