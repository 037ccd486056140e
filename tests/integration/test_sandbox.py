"""The code verifier against hostile completions, in the real bubblewrap sandbox.

Every hostile program is written so that it would *earn* the reward if its attack worked
(it prints the expected answer only after the attack succeeds, or its attack is itself a way
of producing the answer). Reward 0 therefore shows the attack failed; each test then also
checks the host directly (the planted file, the loopback server's log, the sentinel
processes, stray processes and cgroups), and that the same grader still scores a correct
program 1.0 afterwards.

These tests need bubblewrap (`apt-get install bubblewrap`; `make test` and `.ci/run` do it):
without it they fail, they are not skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swarmrl.config import SandboxConfig
from swarmrl.rewards.code import CodeGrader, grade_code, open_code_grader
from swarmrl.sandbox.runner import Sandbox, SandboxSettings, SandboxUnavailable
from swarmrl.tasks import code as code_tasks

from harness import wait_for

UID_BASE = 61500  # away from the default; each pool claims its own uids from here up
WORKERS = 2

SUM_INFO = {
    "test_cases": json.dumps(
        {
            "inputs": ["1 2\n", "10 20\n", "-4 4\n"],
            "outputs": ["3\n", "30\n", "0\n"],
        }
    )
}
ADD_INFO = {
    "test_cases": json.dumps(
        {
            "fn_name": "add",
            "inputs": [[1, 2], [10, 20], [-4, 4]],
            "outputs": [3, 30, 0],
        }
    )
}
SUM_OK = "a, b = map(int, input().split())\nprint(a + b)\n"


def completion(program: str) -> str:
    return f"<think>\nsure\n</think>\nHere:\n```python\n{program}```\n"


def slot_processes(uids) -> list[int]:
    """Host pids running as one of `uids` (a pool's slot uids: none between executions)."""
    uids = set(uids)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid in uids:
            found.append(int(entry.name))
    return found


def leftover_cgroups(grader: CodeGrader) -> list[Path]:
    prefix = f"swarmrl-{os.getpid()}-{id(grader.sandbox):x}-"
    found = []
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory")):
        if root.is_dir():
            found += [p for p in root.rglob(f"{prefix}*") if p.is_dir()]
    return found


@pytest.fixture(scope="module")
def grader():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: `apt-get install bubblewrap` (make test does it)")
    cfg = SandboxConfig(
        workers=WORKERS,
        test_timeout_s=2.0,
        total_timeout_s=8.0,
        uid_base=UID_BASE,
        memory_mb=256,
        max_output_kb=256,
        startup_grace_s=1.0,
    )
    g = open_code_grader(cfg)
    yield g
    g.close()


@pytest.fixture
def intact(grader):
    """After the test: nothing left running as a slot uid, and the grader still serves."""
    yield
    outlived = "every sandboxed process to end (one outlived its execution)"
    wait_for(lambda: slot_processes(grader.sandbox.uids) == [], 5, outlived)
    assert grader.grade_many([(SUM_INFO, completion(SUM_OK))]) == [(1.0, None)]


def grade(grader: CodeGrader, program: str, info: dict = SUM_INFO) -> tuple[float, str]:
    (result,) = grader.grade_many([(info, completion(program))])
    reward, reason = result
    return reward, reason or ""


# -- the sandbox and the verifier work ------------------------------------------------------


def test_reference_solutions_pass_and_wrong_ones_fail_with_a_reason(grader):
    rows = code_tasks.generate(completions="reference") + code_tasks.generate(completions="wrong")
    results = grader.grade_many([(json.loads(r["verification_info"]), r["completion"]) for r in rows])
    n = len(code_tasks.TASKS)
    assert results[:n] == [(1.0, None)] * n
    for row, (reward, reason) in zip(rows[n:], results[n:]):
        assert reward == 0.0, row["problem_id"]
        assert reason.startswith("test ") and "wrong answer: expected" in reason, reason


def test_partial_credit_runs_every_test(grader):
    program = "a, b = map(int, input().split())\nprint(a + b if a > 0 else 99)\n"
    assert grade(grader, program)[0] == 0.0
    sandbox = grader.sandbox
    from swarmrl.rewards.code import CodeLimits

    reward, reason = grade_code(sandbox, SUM_INFO, completion(program), CodeLimits(2.0, 8.0, partial_credit=True))
    assert reward == pytest.approx(2 / 3)
    assert reason.startswith("test 3 of 3: wrong answer")


def test_the_program_runs_unprivileged_with_nothing_of_the_host(grader):
    probe = (
        "import os, json, resource\n"
        "print(json.dumps({'uid': os.getuid(), 'euid': os.geteuid(), 'pid': os.getpid(),\n"
        "  'root': sorted(os.listdir('/')), 'cap': open('/proc/self/status').read().split('CapEff:')[1].split()[0],\n"
        "  'nproc': resource.getrlimit(resource.RLIMIT_NPROC)[0], 'env': sorted(os.environ)}))\n"
    )
    result = grader.sandbox.run(probe, mode="stdio", stdin=b"", timeout_s=5)
    assert result.status == "ok", result
    seen = json.loads(result.stdout)
    assert seen["uid"] in grader.sandbox.uids and seen["euid"] == seen["uid"]
    assert seen["cap"] == "0000000000000000"
    assert seen["pid"] <= 3  # its own pid namespace
    assert seen["nproc"] == 32
    for hidden in ("home", "etc", "work", "var", "sys", "mnt"):
        assert hidden not in seen["root"]
    assert set(seen["env"]) <= {"HOME", "PATH", "LANG", "LC_CTYPE", "PWD"}


def test_unsafe_no_sandbox_warns_at_every_start_and_still_grades(capsys):
    settings = SandboxSettings(workers=1, unsafe_no_sandbox=True)
    for _ in range(2):
        with Sandbox(settings) as sandbox:
            assert grade_code(sandbox, SUM_INFO, completion(SUM_OK)) == (1.0, None)
    err = capsys.readouterr().err
    assert err.count("WARNING: sandbox.unsafe_no_sandbox is set") == 2


@pytest.mark.parametrize(
    "bwrap, says",
    [
        ("/nonexistent/bwrap", "is not on PATH"),
        ("/bin/false", "a trivial program failed"),
    ],
)
def test_code_tasks_are_refused_when_bubblewrap_cannot_run(bwrap, says):
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox(SandboxSettings(workers=1, bwrap=bwrap))
    message = str(info.value)
    assert says in message and "apt-get install bubblewrap" in message
    assert "unsafe_no_sandbox" in message


# -- hostile programs ----------------------------------------------------------------------


def test_infinite_loop(grader, intact):
    started = time.monotonic()
    reward, reason = grade(grader, "while True:\n    pass\n")
    assert reward == 0.0 and "time limit exceeded (2 s)" in reason
    assert time.monotonic() - started < 6


def test_fork_bomb(grader, intact):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    reward, reason = grade(grader, bomb)
    # Which limit stops it first depends on the machine's load: time, processes or memory.
    assert reward == 0.0 and any(s in reason for s in ("time limit exceeded", "resource limit", "memory limit")), reason
    assert leftover_cgroups(grader) == [] or not any(
        (p / "cgroup.procs").read_text().strip() for p in leftover_cgroups(grader)
    )
    # The host can still start processes.
    assert subprocess.run(["true"]).returncode == 0


def test_each_execution_gets_one_core_of_cpu(grader, intact):
    """RLIMIT_CPU is per process; the execution's cgroup caps all of its processes together
    at one core. Checked on the live cgroup while a program runs in it (how much CPU busy
    children get on a shared 2-core machine says little about the cap)."""
    cpu_root = Path("/sys/fs/cgroup/cpu")
    if not (cpu_root / "cpu.cfs_quota_us").exists():
        pytest.skip("no cgroup v1 cpu controller on this machine")
    prefix = f"swarmrl-{os.getpid()}-{id(grader.sandbox):x}-"
    runner = threading.Thread(
        target=grader.sandbox.run,
        args=("import time\ntime.sleep(2)\n",),
        kwargs=dict(mode="stdio", stdin=b"", timeout_s=5),
    )
    runner.start()
    seen = None
    deadline = time.monotonic() + 3
    while seen is None and time.monotonic() < deadline:
        for d in cpu_root.glob(f"{prefix}*"):
            try:
                if (d / "cgroup.procs").read_text().strip():  # the one holding the running program
                    seen = (
                        d,
                        (d / "cpu.cfs_quota_us").read_text().strip(),
                        (d / "cpu.cfs_period_us").read_text().strip(),
                    )
            except FileNotFoundError:  # an earlier execution's cgroup, removed as we looked
                continue
        time.sleep(0.05)
    runner.join()
    assert seen is not None, "no cpu cgroup held the running program"
    assert seen[1:] == ("100000", "100000")
    assert not seen[0].exists()  # removed once the execution ended


@pytest.mark.parametrize(
    "program",
    [
        "x = bytearray(8 * 1024 ** 3)\nprint(3)\n",
        "hoard = []\nwhile True:\n    hoard.append(' ' * 10 ** 7)\n",
        # 16 forks, each writing (not just reserving) 200 MB: the cgroup's memory limit, not
        # RLIMIT_AS, is what stops these.
        "import os\nfor _ in range(16):\n    if os.fork() == 0:\n        break\nhoard = [b'x' * (200 * 1024 ** 2)]\nwhile True:\n    hoard.append(b'x' * 10 ** 7)\n",  # noqa: E501
    ],
)
def test_memory_bomb(grader, intact, program):
    reward, reason = grade(grader, program)
    assert reward == 0.0
    stopped = ["MemoryError", "memory limit exceeded"]
    if "os.fork" in program:
        # The cgroup's OOM killer takes the 17 processes one at a time; on a loaded machine the
        # 2 s test limit can come first (seen once in CI). Contained either way: 0, and `intact`
        # checks the slot still works.
        stopped.append("time limit exceeded")
    assert any(s in reason for s in stopped), reason


def test_gigabytes_of_output(grader, intact):
    started = time.monotonic()
    reward, reason = grade(grader, "import os\nblock = b'x' * 2 ** 20\nfor _ in range(4096):\n    os.write(1, block)\n")
    assert reward == 0.0 and "output limit exceeded" in reason
    assert time.monotonic() - started < 5  # killed at the cap, not after 4 GiB
    reward, reason = grade(grader, "import sys\nwhile True:\n    sys.stderr.write('e' * 65536)\n")
    assert reward == 0.0 and "output limit exceeded" in reason


def test_writing_outside_the_sandbox(grader, intact, tmp_path):
    target = tmp_path / "pwned"
    for path in (str(target), "/usr/pwned", "/box/prog.py", "/pwned", "/proc/sys/kernel/hostname"):
        program = f"with open({path!r}, 'w') as f:\n    f.write('x')\n" + SUM_OK
        reward, reason = grade(grader, program)
        assert reward == 0.0 and "runtime error" in reason, (path, reason)
    assert not target.exists() and not Path("/usr/pwned").exists() and not Path("/pwned").exists()
    # Its private /tmp is writable (programs may need scratch space) but goes with it.
    scratch = "open('/tmp/scratch', 'w').write('x')\n" + SUM_OK
    assert grade(grader, scratch) == (1.0, "")


def test_reading_a_secret_planted_on_the_host(grader, intact, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2\n")
    secret.chmod(0o644)  # readable by anyone on the host: only the sandbox stands in the way
    info = {"test_cases": json.dumps({"inputs": ["\n"], "outputs": ["hunter2\n"]})}
    for path in (secret, Path("/root/.bash_history"), Path("/etc/hostname")):
        program = f"print(open({str(path)!r}).read().strip())\n"
        reward, reason = grade(grader, program, info)
        assert reward == 0.0 and ("No such file" in reason or "Permission" in reason), reason
    listing = f"import os\nprint('hunter2' if os.path.exists({str(tmp_path)!r}) else 'no')\n"
    assert grade(grader, listing, info)[0] == 0.0


def test_connecting_to_a_loopback_server(grader, intact):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    connections = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            connections.append(conn)
            conn.sendall(b"3\n30\n0\n")  # it would hand over the answers
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        for host in ("127.0.0.1", "localhost", socket.gethostname()):
            program = (
                "import socket\n"
                f"s = socket.create_connection(({host!r}, {port}), timeout=1)\n"
                "print(s.recv(100).decode().split()[0])\n"
            )
            reward, reason = grade(grader, program)
            assert reward == 0.0 and "runtime error" in reason, reason
        assert connections == []
        # The host itself reaches the server, so the test would have seen a connection.
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        wait_for(lambda: connections, 2, "the host's connection to reach the server", every=0.02)
        assert len(connections) == 1
    finally:
        stop.set()
        thread.join()
        server.close()


def test_killing_the_parent_and_other_processes(grader, intact):
    # Sentinels: one root process, and one running as the slot's own uid outside the sandbox,
    # which only the pid namespace protects.
    sentinels = [
        subprocess.Popen(["sleep", "60"]),
        subprocess.Popen(
            [
                "setpriv",
                f"--reuid={grader.sandbox.slot_uid(0)}",
                f"--regid={grader.sandbox.slot_uid(0)}",
                "--clear-groups",
                "sleep",
                "60",
            ]
        ),
    ]
    pids = [p.pid for p in sentinels] + [os.getpid(), os.getppid()]
    try:
        for pid in pids:
            program = f"import os, signal\nos.kill({pid}, signal.SIGKILL)\n" + SUM_OK
            reward, reason = grade(grader, program)
            assert reward == 0.0 and "ProcessLookupError" in reason, (pid, reason)
        for program in (
            "import os, signal\nos.kill(-1, signal.SIGKILL)\n",
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + SUM_OK,
            "import os, signal\nos.killpg(0, signal.SIGKILL)\n",
        ):
            reward, reason = grade(grader, program)
            assert reward == 0.0, (program, reason)
        assert all(p.poll() is None for p in sentinels), "a sentinel process was killed"
    finally:
        for p in sentinels:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "program, says",
    [
        # Replace the comparison: the host compares, not anything in the sandbox.
        ("import swarmrl.rewards.code as c\nc.stdout_matches = lambda *a: True\n", "ModuleNotFoundError"),
        ("import builtins\nbuiltins.str.__eq__ = lambda a, b: True\n", "TypeError"),
        # Exit early, with success, before printing anything.
        ("import sys\nsys.exit(0)\n", "wrong answer"),
        ("import os\nos._exit(0)\n", "wrong answer"),
        # Print the expected output of another test (test 1's answer, every time).
        ("print(3)\n", "test 2 of 3: wrong answer"),
        # Patch builtins so any print shows test 1's answer; claim success on stderr.
        (
            "import builtins, sys\n_w = sys.stdout.write\nbuiltins.print = lambda *a, **k: _w('3\\n')\n"
            "sys.stderr.write('All tests passed\\n')\nprint('anything')\n",
            "test 2 of 3: wrong answer",
        ),
    ],
)
def test_faking_success_on_stdio_tests(grader, intact, program, says):
    reward, reason = grade(grader, program)
    assert reward == 0.0 and says in reason, reason


class_always_equal = "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()\n"


@pytest.mark.parametrize(
    "program, says",
    [
        (class_always_equal, "cannot be written as JSON"),
        (
            "class Yes(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes(7)\n",
            "wrong answer",
        ),
        ("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n", "no return value came back"),
        # fd 1 is the program's stderr while it runs: the answer channel is not reachable that way.
        ("import os\nos.write(1, b'3')\nos._exit(0)\n", "no return value came back"),
        ("import json\njson.dumps = lambda *a, **k: '3'\ndef add(a, b):\n    return 0\n", "test 2 of 3: wrong answer"),
        ("def add(a, b):\n    print(a + b)\n", "wrong answer: expected '3', got 'null'"),
        ("def plus(a, b):\n    return a + b\n", "defines no function 'add'"),
        # Garbage on the answer channel must not crash the host's parser.
        ("import os\nos.write(3, b'[' * 200000)\nos._exit(0)\n", "no return value came back"),
        ("import os\nos.write(3, b'7' * 5000)\nos._exit(0)\n", "no return value came back"),
        ("def add(a, b):\n    return 10 ** 400\n", "wrong answer"),
    ],
)
def test_faking_success_on_function_tests(grader, intact, program, says):
    reward, reason = grade(grader, program, ADD_INFO)
    assert reward == 0.0 and says in reason, reason
    assert grade(grader, "def add(a, b):\n    return a + b\n", ADD_INFO) == (1.0, "")


def test_a_float_answer_is_not_crashed_by_a_huge_integer(grader, intact):
    info = {"test_cases": json.dumps({"fn_name": "half", "inputs": [[5]], "outputs": [2.5]})}
    reward, reason = grade(grader, "def half(x):\n    return 10 ** 400\n", info)
    assert reward == 0.0 and "wrong answer" in reason
    assert grade(grader, "def half(x):\n    return x / 2\n", info) == (1.0, "")


def test_many_hostile_completions_at_once_then_the_next_request(grader, intact):
    jobs = [
        (SUM_INFO, completion("while True:\n    pass\n")),
        (
            SUM_INFO,
            completion("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
        ),
        (SUM_INFO, completion("x = bytearray(8 * 1024 ** 3)\n")),
        (SUM_INFO, completion(SUM_OK)),
    ] * 2
    results = grader.grade_many(jobs)
    assert [r[0] for r in results] == [0.0, 0.0, 0.0, 1.0] * 2


def test_a_killed_scorer_takes_its_sandboxes_with_it(tmp_path):
    """--die-with-parent: SIGKILL the process holding the pool mid-execution; nothing stays."""
    script = tmp_path / "scorer.py"
    script.write_text(
        "import sys\n"
        "from swarmrl.sandbox.runner import Sandbox, SandboxSettings\n"
        f"s = Sandbox(SandboxSettings(workers=1, uid_base={UID_BASE}))\n"
        "print('ready', *s.uids, flush=True)\n"
        "s.run('import os\\nos.fork()\\nwhile True:\\n    pass\\n', mode='stdio', stdin=b'', timeout_s=60)\n"
    )
    scorer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ready, *uids = scorer.stdout.readline().split()
        assert ready == "ready"
        uids = [int(u) for u in uids]
        wait_for(lambda: len(slot_processes(uids)) >= 2, 10, "two sandboxed processes running")
    finally:
        scorer.send_signal(signal.SIGKILL)
        scorer.wait()
    wait_for(lambda: slot_processes(uids) == [], 5, "the killed scorer's sandboxed processes to end")


# -- pools do not share uids ---------------------------------------------------------------


def test_every_pool_gets_its_own_uids_in_this_process_and_in_others(grader, intact):
    if os.geteuid() != 0:
        pytest.skip("only root runs slots as other uids; as another user each program has its own user namespace")
    script = (
        "from swarmrl.sandbox.runner import Sandbox, SandboxSettings\n"
        f"s = Sandbox(SandboxSettings(workers=2, uid_base={UID_BASE}))\n"
        "print(*s.uids, flush=True)\n"
        "input()\n"
    )
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with (
            Sandbox(SandboxSettings(workers=2, uid_base=UID_BASE)) as a,
            Sandbox(SandboxSettings(workers=3, uid_base=UID_BASE)) as b,
        ):
            theirs = [int(u) for u in other.stdout.readline().split()]
            pools = [grader.sandbox.uids, a.uids, b.uids, theirs]
            assert [len(u) for u in pools] == [WORKERS, 2, 3, 2]
            assert len(set().union(*map(set, pools))) == sum(map(len, pools)), pools  # pairwise disjoint
            assert all(u >= UID_BASE for p in pools for u in p)
            assert f"uids {b.uids[0]}-{b.uids[-1]}" in b.describe()
            result = b.run("import os\nprint(os.getuid())\n", mode="stdio", stdin=b"", timeout_s=5)
            assert int(result.stdout) in b.uids
            released = a.uids
    finally:
        other.communicate("\n", timeout=30)
    # Closed pools give their uids back (and a killed process's go back with it).
    with Sandbox(SandboxSettings(workers=2, uid_base=UID_BASE)) as again:
        assert set(again.uids) & (set(released) | set(theirs))


def test_a_fork_bomb_in_one_pool_leaves_another_pools_programs_alone(grader, intact):
    """RLIMIT_NPROC counts a uid's processes host-wide: with shared uids the bomb in one pool
    would make this other pool's program fail to fork."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    forker = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n        time.sleep(0.2)\n        os._exit(0)\n"
        "    kids.append(pid)\n"
        "for k in kids:\n    os.waitpid(k, 0)\n"
        "print('forked 8')\n"
    )
    with Sandbox(SandboxSettings(workers=1, uid_base=UID_BASE)) as other:
        bombs = [
            threading.Thread(target=grader.sandbox.run, args=(bomb,), kwargs=dict(mode="stdio", stdin=b"", timeout_s=4))
            for _ in range(WORKERS)
        ]
        for b in bombs:  # one in every slot of the grader's pool
            b.start()
        try:
            time.sleep(1.0)  # the bombs are at their process limits by now
            for _ in range(3):
                result = other.run(forker, mode="stdio", stdin=b"", timeout_s=5)
                assert result.status == "ok" and result.stdout == b"forked 8\n", result
        finally:
            for b in bombs:
                b.join()
