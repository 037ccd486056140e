"""Benchmark (not a test): where a `swarmrl rl` step's CPU time goes, process by process and part
by part, measured with a sampling profiler (py-spy) on the running processes.

It starts `swarmrl rl` (the embedded default unless --config / overrides say otherwise), waits
until --warm steps are done (imports, base load and the first policy fetches are behind it),
then records every process of the run with `py-spy record --subprocesses --nonblocking` until
--steps more steps are done, and divides each process's and each part's CPU samples by the
number of steps recorded. py-spy counts a sample only where a thread is running (not waiting on
a socket, a lock or sleep), so the figures are CPU seconds, native code (torch, SQLite) charged to
the Python frame that called it. Each process's CPU seconds are the kernel's count over the
window (/proc/PID/stat), split over its parts in proportion to its samples. Parts come from the
frames on each sample's stack (PARTS below, the first rule that matches wins); what no rule names
is "other" with its innermost swarmrl frame.

Needs py-spy (`pip install -e ".[profile]"`) and root or ptrace rights over the run's processes.
Usage: python benchmarks/profile_step.py [--steps 20 --warm 3 --rate 100 --out /tmp/profile_step]
       [-- extra `swarmrl rl` arguments, e.g. --validator.sampled_rate 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# (process role, part, substrings of which one must appear in a frame of the stack). Per role, the
# first rule that matches a sample wins: specific (inner) work before the code that calls it.
PARTS: list[tuple[str, str, tuple[str, ...]]] = [
    # trainer
    ("trainer", "proximal pass (no-grad forward)", ("GRPOTrainer._logprobs",)),
    ("trainer", "optimizer (clip + AdamW)", ("clip_grad_norm_", "Optimizer.step", "AdamW.step", "_sync_compute")),
    ("trainer", "backward", ("backward (torch/", "_engine_run_backward")),
    ("trainer", "forward + loss", ("GRPOTrainer._logits", "grpo_loss", "token_logprobs", "token_entropy")),
    ("trainer", "batch assembly", ("build_train_batch", "TrainBatch", "batch_from", "swarmrl/trainer/batch.py")),
    ("trainer", "train step (rest)", ("GRPOTrainer.train_step",)),
    ("trainer", "publishing (write + sign)", ("_write_version", "publish", "save_policy", "sign", "prune_versions")),
    ("trainer", "pulling batches (HTTP)", ("TrainerClient", "httpx", "httpcore")),
    ("trainer", "serving versions to relays (origin)", ("ShardRequestHandler", "_Server", "socketserver", "source_of")),
    ("trainer", "checkpoint", ("save_checkpoint",)),
    # worker
    ("worker", "proofs (TOPLOC)", ("swarmrl/proofs/", "build_proofs")),
    ("worker", "generation: sampling", ("BatchEngine._sample", "seeded", "gumbel", "_hash24", "_uniform")),
    ("worker", "generation: prefill", ("SlotDecoder.prefill",)),
    ("worker", "generation: decode", ("SlotDecoder.decode", "BatchEngine", "SlotDecoder")),
    ("worker", "policy fetch + load", ("download_shards", "_ensure_policy", "load_policy", "verify_manifest")),
    ("worker", "submission (sign + HTTP)", ("_Client", "WorkerClient", "httpx", "httpcore", "sign_headers")),
    ("worker", "rollout bookkeeping", ("Worker.generate", "Worker.run")),
    # orchestrator (its validator thread and its grading pool's processes included)
    ("orchestrator", "validation: prefill", ("Validator.prefill", "prefill (swarmrl/validator")),
    ("orchestrator", "validation: checks", ("swarmrl/validator/", "verify_proofs", "swarmrl/proofs/")),
    ("orchestrator", "grading", ("math_task_reward", "VerifierPool", "score_rows", "_worker_main", "Graders")),
    ("orchestrator", "SQLite", ("sqlite3", "Store.", "swarmrl/orchestrator/store.py")),
    ("orchestrator", "submissions (parse + checks)", ("Submissions.", "Group.", "swarmrl/orchestrator/submissions.py")),
    ("orchestrator", "batches for the trainer", ("swarmrl/orchestrator/batches.py",)),
    ("orchestrator", "leases", ("swarmrl/orchestrator/leasing.py", "Leasing.")),
    ("orchestrator", "auth + admission", ("orchestrator/gate.py", "orchestrator/admission.py", "verify_headers")),
    ("orchestrator", "dashboard", ("dashboard",)),
    ("orchestrator", "HTTP server", ("uvicorn", "starlette", "fastapi", "h11", "asyncio", "pydantic")),
    # relay
    ("relay", "mirror (fetch + verify)", ("mirror_version", "download_shards", "_mirror")),
    ("relay", "serving shards", ("ShardRequestHandler", "_Server", "socketserver")),
    # launcher
    ("launcher", "progress + metrics polling", ("read_metrics", "Progress", "_Events", "run_rl")),
]

ROLES = ("trainer", "worker", "orchestrator", "relay", "launcher")
TRUSTED = ("trainer", "orchestrator", "relay", "launcher")  # what a swarm's operator runs


def role_of(cmdline: str) -> str:
    for role in ("trainer", "worker", "orchestrator", "relay", "validator"):
        if f"swarmrl.cli {role}" in cmdline or f"swarmrl {role}" in cmdline:
            return role
    if "swarmrl.cli rl" in cmdline or cmdline in ("", '""'):
        return "launcher"
    return "other"


def parse_raw(path: Path) -> tuple[collections.Counter, dict]:
    """py-spy's raw (collapsed) stacks -> samples by (pid, role, part), and the processes seen."""
    by_part: collections.Counter = collections.Counter()
    procs: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        marks = [i for i, f in enumerate(frames) if f.startswith("process ")]
        own = frames[marks[-1]] if marks else ""
        pid = own.split(":", 1)[0].removeprefix("process ").strip()
        role = "other"
        for i in reversed(marks):  # a pool process (the orchestrator's graders): its nearest swarmrl ancestor's
            role = role_of(frames[i].split(":", 1)[1] if ":" in frames[i] else "")
            if role != "other":
                break
        procs.setdefault(pid, {"role": role, "cmd": own.split(":", 1)[-1].strip('"')[:100]})
        body = frames[(marks[-1] + 1) if marks else 0 :]
        part = None
        for r, name, needles in PARTS:
            if r == role and any(needle in f for f in body for needle in needles):
                part = name
                break
        if part is None:
            inner = [f.split(" (")[0] for f in body if "swarmrl/" in f]
            part = f"other ({inner[-1]})" if inner else "other (imports, interpreter, libraries)"
        by_part[(pid, role, part)] += int(n)
    return by_part, procs


def descendants(root: int) -> list[int]:
    """`root` and every process below it (from /proc's parent links)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def cpu_seconds(pids: list[int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (the kernel's own count)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[str(pid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def steps_done(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "time/step" in r:
            out.append(r["time/step"])
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_kind() -> str:
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            fields.setdefault(k.strip(), v.strip())
    except OSError:
        return "unknown"
    flags = fields.get("flags", "").split()
    isa = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    vendor, family, model = fields.get("vendor_id", "?"), fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{vendor} family {family} model {model}, {isa}"


def scaled(by_part: collections.Counter, procs: dict, cpu: dict[str, float], rate: float) -> dict:
    """CPU seconds by (role, part): each process's kernel-counted CPU time, split over its parts
    in proportion to its samples. (py-spy's samples alone overcount on a busy machine: a thread
    waiting for a core, runnable, counts as active.) A process the kernel count missed (it ended
    within the window) keeps its samples / rate."""
    samples = collections.Counter()
    for (pid, _, _), n in by_part.items():
        samples[pid] += n
    out: collections.Counter = collections.Counter()
    for (pid, role, part), n in by_part.items():
        per_sample = cpu[pid] / samples[pid] if pid in cpu else 1.0 / rate
        out[(role, part)] += n * per_sample
    return out


def table(cpu_by_part: collections.Counter, steps: int) -> tuple[str, dict]:
    per_step = {k: v / steps for k, v in cpu_by_part.items()}
    total = sum(per_step.values())
    lines = ["| process | part | CPU s / step | share |", "|---|---|---|---|"]
    roles = [r for r in ROLES if any(k[0] == r for k in per_step)] + sorted({k[0] for k in per_step} - set(ROLES))
    summary = {}
    for role in roles:
        parts = sorted(((k[1], v) for k, v in per_step.items() if k[0] == role), key=lambda kv: -kv[1])
        role_total = sum(v for _, v in parts)
        summary[role] = role_total
        lines.append(f"| **{role}** | **all** | **{role_total:.3f}** | **{role_total / total:.0%}** |")
        small = sum(v for _, v in parts if v < 0.01)
        lines += [f"| {role} | {name} | {v:.3f} | {v / total:.0%} |" for name, v in parts if v >= 0.01]
        if small:
            lines.append(f"| {role} | (parts under 0.01 s each) | {small:.3f} | {small / total:.0%} |")
    trusted = sum(v for r, v in summary.items() if r in TRUSTED)
    lines.append(f"| **all processes** | | **{total:.3f}** | 100% |")
    lines.append(
        f"| **trusted side** (trainer, orchestrator + validator + graders, relay, launcher) | | **{trusted:.3f}** "
        f"| {trusted / total:.0%} |"
    )
    per_part = {f"{k[0]}: {k[1]}": v for k, v in per_step.items()}
    return "\n".join(lines) + "\n", {"per_role": summary, "trusted": trusted, "total": total, "per_part": per_part}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps recorded")
    p.add_argument("--warm", type=int, default=3, help="steps run before recording starts")
    p.add_argument("--rate", type=int, default=100, help="samples per second per thread")
    p.add_argument("--out", default="/tmp/profile_step")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    p.add_argument("rl_args", nargs="*", help="extra `swarmrl rl` arguments (after --)")
    args = p.parse_args()
    if not Path(args.py_spy).exists():
        raise SystemExit('py-spy is not installed: pip install -e ".[profile]" (or pass --py-spy PATH)')
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run_dir = out / "run"
    total_steps = args.warm + args.steps + 2  # two spare steps: recording stops at a step's end
    cmd = [
        sys.executable,
        "-m",
        "swarmrl.cli",
        "rl",
        "--run-dir",
        str(run_dir),
        "--trainer.steps",
        str(total_steps),
        "--eval.every",
        "0",
        "--logging.progress",
        "false",
        "--logging.plots",
        "false",
        *args.rl_args,
    ]
    print(f"cpu: {cpu_name()} ({cpu_kind()}), {os.cpu_count()} logical CPUs\n$ {' '.join(cmd)}", flush=True)
    rl = subprocess.Popen(cmd, stdout=(out / "rl.log").open("w"), stderr=subprocess.STDOUT)
    try:
        while len(steps_done(run_dir)) < args.warm:
            if rl.poll() is not None:
                raise SystemExit(f"swarmrl rl exited ({rl.returncode}) before step {args.warm}: {out / 'rl.log'}")
            time.sleep(0.2)
        first = len(steps_done(run_dir))
        raw = out / "raw.txt"
        spy = subprocess.Popen(
            [
                args.py_spy,
                "record",
                "--pid",
                str(rl.pid),
                "--subprocesses",
                "--nonblocking",
                "--rate",
                str(args.rate),
                "--format",
                "raw",
                "--output",
                str(raw),
            ],
            stdout=(out / "py-spy.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        started = time.monotonic()
        cpu0 = cpu_seconds(descendants(rl.pid))
        while len(steps_done(run_dir)) < first + args.steps:
            if rl.poll() is not None:
                break
            time.sleep(0.05)
        wall = time.monotonic() - started
        cpu1 = cpu_seconds(descendants(rl.pid))
        done = steps_done(run_dir)
        last = len(done)
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
    finally:
        if rl.poll() is None:
            rl.send_signal(signal.SIGINT)  # the launcher stops its children itself
            try:
                rl.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rl.kill()
    steps = last - first
    if steps <= 0 or not raw.exists():
        raise SystemExit(f"nothing recorded (steps {steps}); see {out / 'py-spy.log'} and {out / 'rl.log'}")
    by_part, procs = parse_raw(raw)
    cpu = {pid: cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1}
    text, summary = table(scaled(by_part, procs, cpu, args.rate), steps)
    step_s = sum(done[first:last]) / steps
    head = (
        f"cpu: {cpu_name()} ({cpu_kind()}), {os.cpu_count()} logical CPUs; {steps} steps recorded after {first}; "
        f"wall {wall:.1f} s ({wall / steps:.2f} s/step; trainer's time/step {step_s:.2f} s); "
        f"CPU capacity {os.cpu_count() * wall / steps:.2f} core-s/step\n"
        f"extra arguments: {' '.join(args.rl_args) or '(none: the embedded default)'}\n\n"
    )
    summary.update(
        cpu=cpu_name(),
        cpu_kind=cpu_kind(),
        steps=steps,
        wall_s=wall,
        step_s=step_s,
        rl_args=args.rl_args,
        processes=list(procs.values()),
    )
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(head + text)
    print(head + text)


if __name__ == "__main__":
    main()
