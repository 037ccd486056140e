"""What one source with free keys and sockets can do to everyone else (issue 34), measured.

Real services on loopback: an orchestrator process (in-process validator), a broadcast origin,
honest workers sampling the tiny policy in this process from 127.0.0.1, a trainer thread
consuming batches. Each attack runs from its own loopback address (127.0.0.3 and up) during an
attacked phase, beside a calm phase of the same run just before it, and the honest side is
measured in both:

  idle      1000 TCP connections that never send a byte
  slow      100 connections sending their request head at one byte a second (orchestrator),
            and 64 against the weight origin (honest GET /versions measured instead)
  answers   2 free keys submitting groups of hostile short answers (\\boxed{\\Gamma(10^{6})}, a
            power tower 30 high, 499 nested parentheses) with well-formed proofs, while a new
            honest key (unproven, so in the same grading lane) works beside them
  hoarders  a fresh run at the shipped sizes: N = 1, 2, 5 free keys lease and never submit,
            from one address and from N addresses; an honest newcomer's time to first lease
  strict    signed bodies with coerced types and duplicate keys: the status codes
  cost      the connection guard's cost on the honest path: the same app under uvicorn's h11
            protocol and under the guarded one, side by side

Printed per attack: honest /healthz and lease/submit latency p50/p99 (ms), honest groups/s,
connections the attacker still holds after `--hold` s, grading seconds by lane (server side:
unproven keys share one lane, proven keys grade in the others) and the attackers' submit round
trips, the newcomer's time to first lease.

    python benchmarks/bench_hostile.py [--phase 20] [--hold 45] [--only idle,slow,answers,hoarders,strict,cost]

A figure, not a test: the machine's load moves every number (docs/security.md records a run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from swarmrl.protocol.client import Refused, TrainerClient, Unavailable, WorkerClient  # noqa: E402
from swarmrl.protocol.signing import sign_headers  # noqa: E402

from hostile import CONFIG, Honest, garbage, trainer_loop  # noqa: E402
from orchestrator_harness import TRAINER_KEY, OrchestratorProcess, make_run_dir, signed_version  # noqa: E402

HOSTILE_ANSWERS = [
    r"\boxed{\Gamma(10^{6})}",
    r"\boxed{" + "2^{" * 30 + "2" + "}" * 30 + "}",
    r"\boxed{" + "(" * 499 + "1" + ")" * 499 + "}",
]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ms(values: list[float]) -> str:
    return f"{pct(values, 0.5) * 1000:.0f} / {pct(values, 0.99) * 1000:.0f}" if values else "-"


class Timed:
    """Wraps a worker client's lease and submit to record their latencies."""

    def __init__(self, client):
        self.lease_s: list[float] = []
        self.submit_s: list[float] = []
        for name, sink in (("lease", self.lease_s), ("submit", self.submit_s)):
            original = getattr(client, name)

            def timed(*args, _original=original, _sink=sink, **kwargs):
                t0 = time.monotonic()
                try:
                    return _original(*args, **kwargs)
                finally:
                    _sink.append(time.monotonic() - t0)

            setattr(client, name, timed)

    def reset(self) -> None:
        self.lease_s.clear()
        self.submit_s.clear()


class Probe:
    """GET `path` every 0.2 s from 127.0.0.1: latencies of answers, and answers that were not 200."""

    def __init__(self, url: str, path: str = "/healthz"):
        self.url, self.path = url, path
        self.latency: list[float] = []
        self.failures: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.wait(0.2):
                t0 = time.monotonic()
                try:
                    code = str(http.get(self.url + self.path).status_code)
                except httpx.HTTPError as e:
                    code = type(e).__name__
                self.latency.append(time.monotonic() - t0)
                if code != "200":
                    self.failures[code] = self.failures.get(code, 0) + 1

    def take(self) -> tuple[list[float], dict]:
        out = (list(self.latency), dict(self.failures))
        self.latency.clear()
        self.failures.clear()
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def connect(url: str, source: str) -> socket.socket | None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
    except OSError:
        return None


def still_open(sockets: list[socket.socket | None]) -> int:
    """Sockets the server has neither closed nor answered (an answer means it was refused or cut)."""
    n = 0
    for s in sockets:
        if s is None:
            continue
        try:
            data = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            n += 1
            continue
        except OSError:
            continue
        if not data:
            continue
    return n


# ---- the run with honest workers ----------------------------------------------------------------


class Run:
    def __init__(self, root: Path, overrides: tuple[str, ...] = ()):
        from swarmrl.inference.worker import Worker
        from swarmrl.protocol.signing import public_key_hex
        from swarmrl.transport.broadcast import ShardServer

        self.root = root
        run = make_run_dir(root / "run", *CONFIG, *overrides)
        self.run_dir = run
        manifest = signed_version(run, 0)
        # The per-address cap a public origin has (on loopback it would default to all 128).
        self.server = ShardServer(run / "broadcast", max_connections_per_source=16).start()
        self.orch = OrchestratorProcess(run).start()
        self.stop = threading.Event()
        self.trainer = TrainerClient(self.orch.url, (run / "trainer.token").read_text().strip())
        self.trainer.publish(0, self.server.url, manifest)
        self.policy = {"version": 0, "url": self.server.url, "manifest": manifest}
        self._Worker, self._key = Worker, public_key_hex(TRAINER_KEY)
        self.workers = [self.worker(f"honest-{i}") for i in range(2)]
        self.timers = [Timed(w.client) for w in self.workers]
        threading.Thread(target=trainer_loop, args=(self.trainer, self.stop), daemon=True).start()
        self.honest = Honest(self.workers)
        deadline = time.monotonic() + 180
        self.honest.running.set()
        while not all(w.client.me()["proven"] for w in self.workers):
            if time.monotonic() > deadline:
                raise RuntimeError("honest workers not proven after 180 s")
            time.sleep(0.5)
        self.honest.running.clear()
        self.probe = Probe(self.orch.url)

    def worker(self, name: str):
        d = self.root / name
        w = self._Worker(
            self.orch.url, key_file=d / "key.pem", cache_dir=d, name=name, log=lambda *_: None, trainer_key=self._key
        )
        w.client.register(name)
        assert w._ensure_policy(self.policy)
        return w

    def phase(self, seconds: float) -> dict:
        for t in self.timers:
            t.reset()
        self.probe.take()
        rate, stats = self.honest.measure(seconds)
        healthz, failures = self.probe.take()
        return {
            "groups_per_s": rate,
            "healthz": healthz,
            "healthz_failures": failures,
            "lease": [x for t in self.timers for x in t.lease_s],
            "submit": [x for t in self.timers for x in t.submit_s],
        }

    def close(self) -> None:
        self.stop.set()
        self.honest.stop.set()
        self.probe.close()
        self.orch.stop()
        self.server.close()


def row(name: str, got: dict, extra: str = "") -> None:
    fails = ",".join(f"{k}x{v}" for k, v in got["healthz_failures"].items()) or "none"
    print(
        f"{name:<22} | {got['groups_per_s']:6.2f} | {ms(got['healthz']):>11} ({fails}) | {ms(got['lease']):>11} | "
        f"{ms(got['submit']):>11} | {extra}",
        flush=True,
    )


HEADER = "phase                  | groups/s | /healthz p50/p99 ms (not 200) | lease p50/p99 | submit p50/p99 | attacker"


def start_drip(socks: list[socket.socket | None], path: str, stop: threading.Event) -> None:
    """Send each socket the next byte of a long request head for `path`, once a second."""
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Padding: ".encode() + b"a" * 4000

    def drip():
        i = 0
        while not stop.wait(1.0):
            for s in socks:
                if s is not None:
                    try:
                        s.send(head[i : i + 1])
                    except OSError:
                        pass
            i += 1

    threading.Thread(target=drip, daemon=True).start()


def attack_sockets(run: Run, args, *, slow: bool) -> None:
    source = "127.0.0.4" if slow else "127.0.0.3"
    count = 100 if slow else 1000
    row("calm", run.phase(args.phase))
    socks = [connect(run.orch.url, source) for _ in range(count)]
    stop = threading.Event()
    if slow:
        start_drip(socks, "/healthz", stop)
    t0 = time.monotonic()
    got = run.phase(min(args.phase, args.hold))
    time.sleep(max(0.0, args.hold - (time.monotonic() - t0)))
    held = still_open(socks)
    stop.set()
    what = f"{count} {'slow-header' if slow else 'idle'} connections from {source}"
    row("attacked", got, f"{what}: {held} still open after {args.hold:.0f} s")
    for s in socks:
        if s is not None:
            s.close()


def attack_origin_slow(run: Run, args) -> None:
    """64 slow-header connections against the weight origin; honest GET /versions beside them."""
    probe = Probe(run.server.url, "/versions")
    time.sleep(args.phase / 2)
    calm, calm_fail = probe.take()
    socks = [connect(run.server.url, "127.0.0.4") for _ in range(64)]
    stop = threading.Event()
    start_drip(socks, "/versions", stop)
    time.sleep(args.phase)
    attacked, attacked_fail = probe.take()
    time.sleep(max(0.0, args.hold - args.phase))
    held = still_open(socks)
    stop.set()
    probe.close()
    print(
        f"origin GET /versions p50/p99 ms: calm {ms(calm)} (not 200: {calm_fail or 'none'}); "
        f"64 slow-header connections: {ms(attacked)} (not 200: {attacked_fail or 'none'}); "
        f"{held} still open after {args.hold:.0f} s",
        flush=True,
    )
    for s in socks:
        if s is not None:
            s.close()


def grading_seconds(url: str) -> dict[str, float]:
    """The orchestrator's grading seconds so far, by lane kind (its /metrics totals)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for kind in ("proven", "unproven"):
            if line.startswith(f'swarmrl_total{{what="grading_seconds/{kind}"}}'):
                out[kind] = float(line.split()[-1])
    return out


def attack_answers(run: Run, args) -> None:
    from transformers import AutoTokenizer

    policy = run.run_dir / "policies" / "v000000"
    tok = AutoTokenizer.from_pretrained(policy, local_files_only=True)
    hidden = json.loads((policy / "config.json").read_text())["hidden_size"]
    answer_ids = [tok(f"<think>x</think>{a}", add_special_tokens=False)["input_ids"] for a in HOSTILE_ANSWERS]
    row("calm", run.phase(args.phase))
    stop = threading.Event()
    round_trips: dict[str, list[float]] = {}
    codes: dict[str, dict[str, int]] = {}
    a_src = "127.0.0.5"
    attackers = [
        WorkerClient(run.orch.url, Ed25519PrivateKey.generate(), timeout_s=60, local_address=a_src) for _ in range(2)
    ]
    for i, a in enumerate(attackers):
        a.register(f"answers-{i}")

    def attack(i: int, a: WorkerClient) -> None:
        n = 0
        while not stop.is_set():
            try:
                got = a.lease(0)
                if got["lease"] is None:
                    time.sleep(0.2)
                    continue
                t0 = time.monotonic()
                lease = got["lease"]
                a.submit(garbage(lease, answer_ids, lease["max_new_tokens"], tok.eos_token_id, hidden))
                round_trips.setdefault(f"a{i}", []).append(time.monotonic() - t0)
                codes.setdefault(f"a{i}", {}).setdefault("submitted", 0)
                codes[f"a{i}"]["submitted"] += 1
            except (Refused, Unavailable) as e:
                known = ("allowance_exhausted", "grading_spent", "grading_busy", "rate_limited")
                code = getattr(e, "code", None) or next(
                    (c for c in known if c in str(e)), f"{getattr(e, 'status', '')}"
                )
                codes.setdefault(f"a{i}", {}).setdefault(code, 0)
                codes[f"a{i}"][code] += 1
                if code in ("allowance_exhausted", "banned"):  # a fresh key costs nothing: take one
                    n += 1
                    fresh = WorkerClient(run.orch.url, Ed25519PrivateKey.generate(), timeout_s=60, local_address=a_src)
                    try:
                        fresh.register(f"answers-{i}-{n}")
                        a = fresh
                        codes[f"a{i}"]["fresh keys"] = codes[f"a{i}"].get("fresh keys", 0) + 1
                    except (Refused, Unavailable):
                        pass
                time.sleep(0.05)

    # A new honest key starts during the attack: unproven, so it shares the attackers' lane.
    newcomer = run.worker("newcomer")
    lost, done = [0], [0]

    def new_honest() -> None:
        while not stop.is_set():
            try:
                got = newcomer.client.lease(0)
            except (Refused, Unavailable):
                time.sleep(0.5)
                continue
            if got["lease"] is None:
                time.sleep(0.5)
                continue
            sub = newcomer.generate(got["lease"])
            while not stop.is_set():
                try:
                    newcomer.client.submit(sub)
                    done[0] += 1
                    break
                except Unavailable as e:
                    time.sleep(min(1.0, e.retry_after or 0.2))
                except Refused as e:
                    if e.code in ("lease_expired", "unknown_lease") or "410" in str(e):
                        lost[0] += 1
                    break

    threads = [threading.Thread(target=attack, args=(i, a), daemon=True) for i, a in enumerate(attackers)]
    threads.append(threading.Thread(target=new_honest, daemon=True))
    for t in threads:
        t.start()
    before = grading_seconds(run.orch.url)
    got = run.phase(args.phase)
    after = grading_seconds(run.orch.url)
    stop.set()
    for t in threads:
        t.join(timeout=90)
    spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("proven", "unproven")}
    attacker_rt = [x for v in round_trips.values() for x in v]
    row(
        "attacked",
        got,
        f"2 attackers of hostile answers (fresh keys when refused): submit round trip"
        f" p50/p99 {ms(attacker_rt)} ms, refusals {codes}; "
        f"grading s in the phase (server): unproven lane (2 attackers + the new honest key) "
        f"{spent['unproven']:.1f}, proven lanes (2 honest keys) {spent['proven']:.1f}; "
        f"new honest key: {done[0]} leases submitted, {lost[0]} lost",
    )


def shipped_run_dir(root: Path) -> Path:
    """A run directory with configs/default.toml's sizes (make_run_dir shrinks leases for tests)."""
    from swarmrl.config import load_config
    from swarmrl.model.checkpoint import build_tiny_policy, save_policy

    cfg = load_config(None, [])
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.toml").write_text(cfg.model_copy(update={"run_dir": str(root)}).to_toml())
    model, tok = build_tiny_policy(seed=0)
    save_policy(model, tok, root / "policies" / "v000000")
    return root


def attack_hoarders(root: Path, args) -> None:
    """Fresh runs at the shipped sizes (no honest workers yet): N keys lease and never submit."""
    print("newcomer's time to first lease (s) at the shipped sizes, N keys hoarding:", flush=True)
    for spread in (False, True):
        for n in (1, 2, 5):
            run = shipped_run_dir(root / f"hoard-{n}-{int(spread)}")
            manifest = signed_version(run, 0)
            orch = OrchestratorProcess(run).start()
            try:
                TrainerClient(orch.url, (run / "trainer.token").read_text().strip()).publish(
                    0, "http://127.0.0.1:9", manifest
                )
                hoarders = [
                    WorkerClient(
                        orch.url,
                        Ed25519PrivateKey.generate(),
                        timeout_s=10,
                        local_address=f"127.0.0.{10 + i}" if spread else "127.0.0.3",
                    )
                    for i in range(n)
                ]
                held = 0
                for i, h in enumerate(hoarders):
                    h.register(f"hoarder-{i}")
                    for _ in range(2):  # as many leases as each may hold
                        try:
                            got = h.lease(0)
                            held += len(got["lease"]["prompts"]) if got["lease"] else 0
                        except (Refused, Unavailable):
                            pass
                newcomer = WorkerClient(orch.url, Ed25519PrivateKey.generate(), timeout_s=10, local_address="127.0.0.2")
                newcomer.register("newcomer")
                t0 = time.monotonic()
                first = None
                while time.monotonic() - t0 < args.newcomer_wait:
                    for h in hoarders:  # they keep asking, as hoarders do
                        try:
                            got = h.lease(0)
                            held += len(got["lease"]["prompts"]) if got["lease"] else 0
                        except (Refused, Unavailable):
                            pass
                    try:
                        got = newcomer.lease(0)
                    except (Refused, Unavailable):
                        got = {"lease": None}
                    if got["lease"] is not None:
                        first = time.monotonic() - t0
                        break
                    time.sleep(0.5)
                where = f"{n} addresses" if spread else "one address"
                when = f"{first:.1f}" if first is not None else f"none in {args.newcomer_wait:.0f}"
                print(f"  N={n} from {where}: hoarders leased {held} prompts; newcomer: {when}", flush=True)
            finally:
                orch.stop()


def attack_strict(root: Path) -> None:
    run = make_run_dir(root / "strict")
    orch = OrchestratorProcess(run).start()
    try:
        key = Ed25519PrivateKey.generate()
        w = WorkerClient(orch.url, key, timeout_s=10)
        w.register("strict")
        run_id = w.run()
        bodies = {
            "version as a string": b'{"policy_version":"0"}',
            "version as true": b'{"policy_version":true}',
            "duplicate key": b'{"policy_version":0,"policy_version":1}',
            "version as 0.0": b'{"policy_version":0.0}',
        }
        out = []
        with httpx.Client(timeout=10) as http:
            for name, body in bodies.items():
                headers = {"content-type": "application/json", **sign_headers(key, run_id, "POST", "/v1/leases", body)}
                r = http.post(orch.url + "/v1/leases", content=body, headers=headers)
                out.append(f"{name}: {r.status_code} {r.json().get('detail', '')[:80]!r}")
        print("strict wire format (POST /v1/leases):\n  " + "\n  ".join(out), flush=True)
    finally:
        orch.stop()


def guard_cost(requests: int = 2000) -> None:
    """The guard's cost on the honest path: the same tiny ASGI app under uvicorn's plain h11
    protocol and under the guarded one, side by side, with new connections and with keep-alive."""
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from swarmrl.transport.connlimit import SourceSlots, guarded_h11

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def start(protocol) -> tuple[uvicorn.Server, str]:
        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the services do (44 ms a request without)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, http=protocol, log_level="warning", access_log=False, limit_concurrency=None)
        server = uvicorn.Server(config)
        threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True).start()
        while not server.started:
            time.sleep(0.01)
        return server, f"http://127.0.0.1:{sock.getsockname()[1]}"

    servers = {
        "uvicorn h11": start(H11Protocol),
        "guarded h11": start(guarded_h11(SourceSlots.sized(1000, 64), head_timeout_s=10, idle_timeout_s=30)),
    }
    print(f"guard cost: {requests} GET / each, alternating servers (median of 5 rounds, us per request)")
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"

    def one(sock: socket.socket) -> None:
        sock.sendall(request)
        data = b""
        while not data.endswith(b"ok"):
            data += sock.recv(4096)

    def address(url: str) -> tuple[str, int]:
        return ("127.0.0.1", int(url.rsplit(":", 1)[1]))

    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(5):
        for name, (_, url) in servers.items():
            with socket.create_connection(address(url)) as sock:  # keep-alive: one connection
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.perf_counter()
                for _ in range(requests):
                    one(sock)
                results.setdefault((name, "keep-alive"), []).append((time.perf_counter() - t0) / requests)
            t0 = time.perf_counter()
            for _ in range(requests // 4):  # a new connection per request
                with socket.create_connection(address(url)) as sock:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    one(sock)
            results.setdefault((name, "new connection"), []).append((time.perf_counter() - t0) / (requests // 4))
    for mode in ("keep-alive", "new connection"):
        plain = statistics.median(results[("uvicorn h11", mode)]) * 1e6
        guarded = statistics.median(results[("guarded h11", mode)]) * 1e6
        print(f"  {mode:<15} uvicorn {plain:7.0f} | guarded {guarded:7.0f} | ratio {guarded / plain:.2f}")
    for server, _ in servers.values():
        server.should_exit = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", type=float, default=20.0, help="seconds of each calm and attacked phase")
    ap.add_argument("--hold", type=float, default=45.0, help="seconds after which attacker connections are counted")
    ap.add_argument("--newcomer-wait", type=float, default=60.0, help="longest wait for a newcomer's first lease")
    ap.add_argument("--only", default="idle,slow,answers,hoarders,strict,cost")
    args = ap.parse_args()
    only = set(args.only.split(","))
    random.seed(0)
    torch.manual_seed(0)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; phases of {args.phase:.0f} s")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if only & {"idle", "slow", "answers"}:
            # Leases of 20 s, not the test's 3: the honest workers sample on a loaded machine.
            # 160 new tokens: the Gamma and the tower fit whole (the tiny policy's tokens are
            # characters); the 499 parentheses are cut to 77, as deep for the grader's checks.
            run = Run(root / "main", ("--orchestrator.lease_timeout_s", "20", "--sampling.max_new_tokens", "160"))
            try:
                print(HEADER, flush=True)
                if "idle" in only:
                    attack_sockets(run, args, slow=False)
                if "slow" in only:
                    attack_sockets(run, args, slow=True)
                    attack_origin_slow(run, args)
                if "answers" in only:
                    attack_answers(run, args)
            finally:
                run.close()
        if "hoarders" in only:
            attack_hoarders(root, args)
        if "strict" in only:
            attack_strict(root)
        if "cost" in only:
            guard_cost()


if __name__ == "__main__":
    main()
