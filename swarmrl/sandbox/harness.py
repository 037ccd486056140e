"""Runs inside the sandbox: set the resource limits, then run the untrusted program.

This file is copied into each sandbox slot and run by the sandbox's own interpreter with
``-I -S``, so it imports nothing from swarmrl or site-packages: the standard library only.

    python -I -S -B -X utf8 harness.py MODE LIMITS

LIMITS is ``name=value,...`` (integers), not JSON: importing json costs ~8 ms, a third of a
trivial run, so only MODE ``call`` (which needs it for the arguments and result) imports it.

MODE ``stdio``: run ``prog.py`` (next to this file) as ``__main__``; it reads the test's
input from stdin and its stdout is the answer. MODE ``call``: stdin holds
``{"fn_name": ..., "args": [...]}``; the program is run as a module, the function (or the
method of the same name on ``Solution()``) is called with the arguments, and the return
value is written to stdout as JSON. While the program runs, its own prints go to stderr.

Nothing here needs to be secret or tamper-proof: the program runs in this same process and
can change anything in it, but the expected outputs never enter the sandbox; the host
compares what comes out. The limits are set with soft = hard, so the program cannot raise
them again.
"""

import os
import resource
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# Exit codes the host reads (1 is an uncaught exception in the program, as usual).
EXIT_BAD_CALL = 3  # the function is missing, or its result is not JSON


def _parse_limits(text):
    limits = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        limits[name] = int(value)
    return limits


def _set_limits(limits):
    names = {
        "cpu_s": resource.RLIMIT_CPU,
        "memory_bytes": resource.RLIMIT_AS,
        "max_procs": resource.RLIMIT_NPROC,
        "max_file_bytes": resource.RLIMIT_FSIZE,
        "max_open_files": resource.RLIMIT_NOFILE,
    }
    for key, which in names.items():
        value = limits.get(key)
        if value is not None:
            resource.setrlimit(which, (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _load_program():
    with open(os.path.join(HERE, "prog.py"), encoding="utf-8") as handle:
        source = handle.read()
    return compile(source, "prog.py", "exec")


def _run_stdio():
    code = _load_program()
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


def _find_function(namespace, fn_name):
    fn = namespace.get(fn_name)
    if callable(fn):
        return fn
    solution = namespace.get("Solution")
    if isinstance(solution, type) and callable(getattr(solution, fn_name, None)):
        return getattr(solution(), fn_name)
    return None


def _run_call():
    import json

    request = json.loads(sys.stdin.read())
    fn_name, args = request["fn_name"], request["args"]
    code = _load_program()
    # The program's own prints must not be taken for the answer: point fd 1 at stderr while
    # it runs, and keep the real stdout aside for the result.
    sys.stdout.flush()
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(code, namespace)
    fn = _find_function(namespace, fn_name)
    if fn is None:
        sys.stderr.write(f"NameError: the program defines no function {fn_name!r}\n")
        sys.exit(EXIT_BAD_CALL)
    result = fn(*args)
    try:  # tuples become lists here, as the dataset writes them
        text = json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as exc:
        sys.stderr.write(f"TypeError: the return value cannot be written as JSON: {exc}\n")
        sys.exit(EXIT_BAD_CALL)
    sys.stdout.flush()
    data = text.encode("utf-8")
    while data:
        data = data[os.write(answer_fd, data) :]


def main():
    mode = sys.argv[1]
    _set_limits(_parse_limits(sys.argv[2]))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    if mode == "stdio":
        _run_stdio()
    elif mode == "call":
        _run_call()
    else:
        sys.stderr.write(f"harness: unknown mode {mode!r}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
