"""Sandboxed code execution: its cost per run against an unsandboxed subprocess, and throughput.

1. Latency of one trivial program (``print(1)``), run one at a time, measured side by side in
   interleaved rounds:
   - ``subprocess``: the same interpreter started directly (``python -I -S -c``), no harness,
     no limits: the floor for any per-test process;
   - ``harness, no sandbox``: our harness and limits without bubblewrap
     (``sandbox.unsafe_no_sandbox``), so the sandbox's own cost is the difference;
   - ``sandbox``: the full path (bubblewrap, namespaces, setpriv, per-run cgroups as root).
2. Throughput of sandboxed test executions on this machine's cores: the same trivial program
   from 1 and from N threads through one pool of N slots.
3. Grading throughput on the built-in code tasks: reference completions (every test runs),
   completions/s and tests/s with N slots.

    python benchmarks/bench_sandbox.py [--runs 100] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from swarmrl.rewards.code import CodeGrader, CodeLimits, parse_test_cases
from swarmrl.sandbox.runner import Sandbox, SandboxSettings
from swarmrl.tasks import code as code_tasks

TRIVIAL = "print(1)\n"


def time_one(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs per variant in part 1 and 2")
    parser.add_argument("--workers", type=int, default=2, help="sandbox slots (default: 2 cores here)")
    args = parser.parse_args()

    sandbox = Sandbox(SandboxSettings(workers=args.workers))
    unsafe = Sandbox(SandboxSettings(workers=1, unsafe_no_sandbox=True), log=lambda _: None)
    python = sandbox.python
    print(f"sandbox: {sandbox.describe()}; interpreter {python}")

    def plain():
        out = subprocess.run([python, "-I", "-S", "-c", TRIVIAL], capture_output=True, check=True)
        assert out.stdout == b"1\n"

    def harness():
        assert unsafe.run(TRIVIAL, mode="stdio", stdin=b"", timeout_s=5).stdout == b"1\n"

    def sandboxed():
        assert sandbox.run(TRIVIAL, mode="stdio", stdin=b"", timeout_s=5).stdout == b"1\n"

    variants = {"subprocess": plain, "harness, no sandbox": harness, "sandbox": sandboxed}
    for fn in variants.values():  # warm the page cache
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, fn in variants.items():
            times[name].append(time_one(fn))
    base = statistics.median(times["subprocess"])
    print("\n1. one trivial program at a time (median of", args.runs, "interleaved rounds)")
    print(f"{'variant':<22}{'median ms':>10}{'p90 ms':>9}{'x subprocess':>14}")
    for name, values in times.items():
        values = sorted(values)
        p90 = values[int(0.9 * (len(values) - 1))]
        print(
            f"{name:<22}{1000 * statistics.median(values):>10.1f}{1000 * p90:>9.1f}"
            f"{statistics.median(values) / base:>14.2f}"
        )
    overhead = statistics.median(times["sandbox"]) - statistics.median(times["harness, no sandbox"])
    print(f"sandbox overhead over the same harness unsandboxed: {1000 * overhead:.1f} ms per execution")

    print("\n2. sandboxed executions per second (trivial program)")
    for threads in sorted({1, args.workers}):
        n = args.runs * threads
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: sandboxed(), range(n)))
        elapsed = time.perf_counter() - started
        print(f"{threads} thread(s), {args.workers} slots: {n / elapsed:6.1f} executions/s ({n} runs)")

    grader = CodeGrader(sandbox, CodeLimits())
    rows = code_tasks.generate(completions="reference")
    jobs = [(json.loads(r["verification_info"]), r["completion"]) for r in rows] * 4
    tests = sum(len(parse_test_cases(info).inputs) for info, _ in jobs)
    started = time.perf_counter()
    results = grader.grade_many(jobs)
    elapsed = time.perf_counter() - started
    assert all(r == (1.0, None) for r in results), results
    print(
        f"\n3. grading the built-in tasks' reference completions, {args.workers} slots: "
        f"{len(jobs) / elapsed:.1f} completions/s, {tests / elapsed:.1f} tests/s "
        f"({len(jobs)} completions, {tests} tests, {elapsed:.1f} s)"
    )
    grader.close()
    unsafe.close()


if __name__ == "__main__":
    main()
