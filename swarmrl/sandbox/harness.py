"""Runs inside the sandbox: set the resource limits, then run the untrusted program.

This file is copied into each sandbox slot and run by the sandbox's own interpreter with
``-I -S``, so it imports nothing from swarmrl or site-packages: the standard library only.

    python -I -S -B -X utf8 harness.py MODE LIMITS

LIMITS is ``name=value,...`` (integers), not JSON: importing json costs ~8 ms, a third of a
trivial run, so only the modes that exchange structured data (``call``, ``assert``) import it.
The limits are set with soft = hard, so the program cannot raise them again.

MODE ``stdio``: run ``prog.py`` (next to this file) as ``__main__``; it reads the test's
input from stdin and its stdout is the answer. MODE ``call``: stdin holds
``{"fn_name": ..., "args": [...]}``; the program is run as a module, the function (or the
method of the same name on ``Solution()``) is called with the arguments, and the return
value is written to stdout as JSON. While the program runs, its own prints go to stderr.

For these two modes nothing here needs to be secret or tamper-proof: the program runs in this
same process and can change anything in it, but the expected outputs never enter the sandbox;
the host compares what comes out.

MODE ``assert``: stdin holds ``{"nonce", "setup", "test", "functions"}``. Assert-style tests
carry their expected values and judge in the sandbox, so this process keeps them to itself and
runs ``prog.py`` in a second process (MODE ``program``) that the test reaches only through
proxies of ``functions``; it writes the nonce to stdout only if the test passed. The section
"MODE assert" below says why and how.
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


# -- MODE assert: assert-style tests (HumanEval's check(candidate), MBPP's asserts) -----------
#
# The tests hold the expected values and decide pass or fail, so they must not share a process
# with the program: in one process the program could read them, print the pass token and exit,
# patch the builtins the asserts use, or return an object whose __eq__ always says yes. So:
#
# - this process (the tests' process) reads the whole request from stdin first: the setup code,
#   the test, the names of the program's functions, and a nonce only the host knows;
# - it makes itself non-dumpable, so another process of this uid can neither ptrace it nor open
#   its /proc/PID/mem or /proc/PID/fd;
# - it runs the program in a fresh interpreter (MODE program) that it spawns after that, with
#   stdin from /dev/null, stdout on stderr, and two pipes as its only link;
# - the test calls the program's functions through proxies: arguments go over as data, and what
#   comes back is decoded into plain values (numbers, strings, lists, tuples, dicts, sets...);
#   any other object stays in the program's process and is seen here as an opaque handle that
#   can only be passed back, called, or asked for an attribute;
# - only when the test returns without an exception, and the program never broke the link, does
#   this process write the nonce to its real stdout, which the program never holds.

EXIT_TEST_FAILED = 4  # the test raised: an assert failed, or the program's function raised
EXIT_PROGRAM_FAILED = 5  # the program did not load, exited while tested, or broke the protocol
EXIT_BAD_TESTS = 6  # the setup or the test is broken (raised before any call, or never called)
EXIT_UNSAFE = 7  # this process could not hide itself from the program: nothing was run

_MAX_MESSAGE = 64 << 20  # a reply line larger than this is the program's failure


class _ProgramFailed(BaseException):
    """The program broke the link (exited, garbage on the pipe). A BaseException, so that a test's
    ``except Exception`` cannot swallow it; the link also remembers it, for a bare ``except``."""


def _encode(value, other):
    """``value`` as JSON-ready data with tags for what JSON lacks; ``other`` encodes the rest."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return int.__int__(value)  # a subclass goes over as its plain value
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [_encode(v, other) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"t": [_encode(v, other) for v in tuple.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[_encode(k, other), _encode(v, other)] for k, v in dict.items(value)]}
    if isinstance(value, frozenset):
        return {"f": [_encode(v, other) for v in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"s": [_encode(v, other) for v in set.__iter__(value)]}
    if isinstance(value, bytes):
        return {"b": bytes.hex(value)}
    if isinstance(value, complex):
        return {"c": [complex.real.__get__(value), complex.imag.__get__(value)]}
    return other(value)


def _decode(data, resolve):
    """The inverse of ``_encode``; ``resolve(tag, body)`` decodes the side's own tags."""
    if isinstance(data, list):
        return [_decode(v, resolve) for v in data]
    if not isinstance(data, dict):
        return data  # None, bool, int, float, str: JSON's own
    if len(data) != 1:
        raise ValueError("a tagged value has exactly one key")
    ((tag, body),) = data.items()
    if tag == "t":
        return tuple(_decode(v, resolve) for v in body)
    if tag == "d":
        return {_decode(k, resolve): _decode(v, resolve) for k, v in body}
    if tag == "f":
        return frozenset(_decode(v, resolve) for v in body)
    if tag == "s":
        return {_decode(v, resolve) for v in body}
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "c":
        return complex(float(body[0]), float(body[1]))
    if tag == "q":
        import collections

        return collections.deque(_decode(v, resolve) for v in body)
    if tag == "i":
        return iter([_decode(v, resolve) for v in body])
    return resolve(tag, body)


def _allow_long_ints():
    """Both sides of MODE assert send ints as decimal text; 3.11+ caps its length at 4300 digits,
    and a long result (a factorial) is a value to compare, not an attack."""
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)


def _send(fd, message):
    import json

    data = (json.dumps(message, allow_nan=True) + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data) :]


class _Link:
    """The tests' side of the pipe to the program."""

    def __init__(self, pid, to_program, from_program):
        self.pid = pid
        self.to_program = to_program
        self.replies = os.fdopen(from_program, "rb")
        self.calls = 0
        self.broken = None
        self.remotes = {}

    def fail(self, why):
        self.broken = self.broken or why
        raise _ProgramFailed(self.broken)

    def receive(self):
        import json

        try:
            line = self.replies.readline(_MAX_MESSAGE)
        except (OSError, MemoryError) as exc:
            self.fail(f"the link to the program failed ({type(exc).__name__})")
        if not line:
            self.fail(_exit_description(self.pid))
        if not line.endswith(b"\n"):
            self.fail("the program sent a reply larger than the tests accept")
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            self.fail("the program wrote something other than a reply on the tests' pipe")
        if not isinstance(reply, dict):
            self.fail("the program wrote something other than a reply on the tests' pipe")
        return reply

    def request(self, message):
        if self.broken:
            raise _ProgramFailed(self.broken)
        self.calls += 1
        try:
            _send(self.to_program, message)
        except OSError:
            self.fail(_exit_description(self.pid))
        reply = self.receive()
        if "raise" in reply:
            raise _program_exception(reply["raise"])
        if "value" not in reply:
            self.fail("the program wrote something other than a reply on the tests' pipe")
        try:
            return _decode(reply["value"], self.resolve)
        except (ValueError, TypeError, KeyError, RecursionError, MemoryError):
            self.fail("the program sent a value the tests cannot read")

    def resolve(self, tag, body):
        if tag != "h" or not isinstance(body, int) or isinstance(body, bool):
            raise ValueError(f"unknown tag {tag!r}")
        remote = self.remotes.get(body)
        if remote is None:
            remote = self.remotes[body] = _Remote(self, body)
        return remote

    def encode_argument(self, value):
        def other(obj):
            if isinstance(obj, _Remote):
                return {"h": obj._ref}
            # An object of the setup's own class (MBPP's trees of Node) crosses as its class name
            # and attributes; the program rebuilds it as its own class of that name, or as a
            # plain object with those attributes.
            fields = getattr(obj, "__dict__", None)
            if isinstance(fields, dict) and not callable(obj):
                return {"o": [type(obj).__name__, {str(k): _encode(v, other) for k, v in fields.items()}]}
            raise TypeError(f"the tests cannot pass a {type(obj).__name__} to the program")

        return _encode(value, other)

    def call(self, target, args, kwargs):
        message = {
            "call": target,
            "args": [self.encode_argument(a) for a in args],
            "kwargs": {k: self.encode_argument(v) for k, v in kwargs.items()},
        }
        return self.request(message)

    def close(self):
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


class _Remote:
    """An object that lives in the program's process: it can be passed back to the program,
    called, or asked for a (non-dunder) attribute; it equals only itself."""

    __slots__ = ("_link", "_ref")

    def __init__(self, link, ref):
        self._link = link
        self._ref = ref

    def __call__(self, *args, **kwargs):
        return self._link.call({"h": self._ref}, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.request({"get": [self._ref, name]})

    def __repr__(self):
        return f"<object {self._ref} of the program>"


def _program_exception(raised):
    """The exception a function of the program raised, as one of this process's own types."""
    import builtins

    name, message = (raised + ["", ""])[:2] if isinstance(raised, list) else ("", "")
    name, message = str(name)[:100], str(message)[:1000]
    kind = getattr(builtins, name, None) if name.isidentifier() else None
    exc = None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            exc = kind(message)
        except Exception:  # noqa: BLE001 - a type with other arguments (UnicodeDecodeError)
            exc = None
    if exc is None:
        exc = RuntimeError(f"{name}: {message}")
    exc.raised_by_program = True  # told apart from a failed assert when reported
    return exc


def _exit_description(pid):
    import time

    done, status = 0, 0
    for _ in range(50):  # its pipe closes a moment before it can be reaped
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "the program exited while being tested"
        if done:
            break
        time.sleep(0.01)
    if done and os.WIFSIGNALED(status):
        return f"the program was killed by signal {os.WTERMSIG(status)} while being tested"
    if done:
        return f"the program exited (code {os.WEXITSTATUS(status)}) while being tested"
    return "the program closed its link to the tests"


def _hide_from_program():
    """Non-dumpable: processes of this uid can no longer ptrace this one or read its /proc
    files (mem, fd, environ), which would show the test and the nonce. False if it failed."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE, 0
    except (ImportError, OSError, AttributeError):
        return False


def _fail(code, message):
    sys.stderr.write(message.replace("\n", " ")[:500] + "\n")
    sys.stderr.flush()
    os._exit(code)


def _where(exc):
    """' (line N of the test)' for the deepest frame of the row's code (setup or test)."""
    found, tb = "", exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name in ("<setup>", "<test>"):
            found = f" (line {tb.tb_lineno} of the {name.strip('<>')})"
        tb = tb.tb_next
    return found


def _run_assert():
    import json

    _allow_long_ints()
    request = json.loads(sys.stdin.buffer.read())
    nonce, functions = request["nonce"], request["functions"]
    if not _hide_from_program():
        _fail(EXIT_UNSAFE, "harness: prctl(PR_SET_DUMPABLE, 0) failed; not running the program")
    sys.stdout.flush()
    answer_fd = os.dup(1)  # the real stdout, for the nonce; it is not inheritable
    os.dup2(2, 1)  # the setup's and the test's own prints go to stderr
    namespace = {"__name__": "__tests__", "__builtins__": __builtins__}
    try:
        exec(compile(request["setup"], "<setup>", "exec"), namespace)
        test = compile(request["test"], "<test>", "exec")
    except BaseException as exc:  # noqa: BLE001 - the row's own code: a data bug, reported as such
        _fail(EXIT_BAD_TESTS, f"the setup failed{_where(exc)}: {type(exc).__name__}: {exc}")
    link = _spawn_program()
    try:
        first = link.receive()
    except _ProgramFailed as exc:
        link.close()
        _fail(EXIT_PROGRAM_FAILED, f"{exc}")
    if "load_error" in first:
        link.close()
        _fail(EXIT_PROGRAM_FAILED, f"the program failed to load: {str(first['load_error'])[:300]}")
    for name in functions:
        namespace[name] = _proxy(link, name)
    failure, code = None, EXIT_TEST_FAILED
    try:
        exec(test, namespace)
    except _ProgramFailed:
        pass  # reported below, from link.broken
    except BaseException as exc:  # noqa: BLE001 - whatever the test raised is a failed test
        text = str(exc)[:200]
        failure = f"{type(exc).__name__}" + (f": {text}" if text else "") + _where(exc)
        if getattr(exc, "raised_by_program", False):
            failure, code = f"the program raised {failure}", EXIT_PROGRAM_FAILED
    link.close()
    if link.broken:
        _fail(EXIT_PROGRAM_FAILED, link.broken)
    if failure is not None:
        _fail(code, failure)
    if link.calls == 0:
        _fail(EXIT_BAD_TESTS, "the test never called the program's functions " + ", ".join(functions))
    data = nonce.encode("ascii")
    while data:
        data = data[os.write(answer_fd, data) :]


def _proxy(link, name):
    def candidate(*args, **kwargs):
        return link.call(name, args, kwargs)

    candidate.__name__ = candidate.__qualname__ = name
    return candidate


def _spawn_program():
    to_read, to_write = os.pipe()
    from_read, from_write = os.pipe()
    os.set_inheritable(to_read, True)
    os.set_inheritable(from_write, True)
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", os.path.join(HERE, "harness.py")]
    argv += ["program", sys.argv[2], f"{to_read},{from_write}"]
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, 2, 1)]
    # /proc/self/exe, not sys.executable: the slot's uid may not search the directories above
    # the interpreter (a prefix under /root), and the magic link needs no path walk.
    exe = "/proc/self/exe" if os.path.exists("/proc/self/exe") else sys.executable
    pid = os.posix_spawn(exe, argv, dict(os.environ), file_actions=actions)
    os.close(to_read)
    os.close(from_write)
    return _Link(pid, to_write, from_read)


# -- MODE program: the program's side of MODE assert (untrusted from its first line on) --------


class _Fields:
    """An object the tests passed whose class the program does not define: its attributes only."""

    def __init__(self, fields):
        self.__dict__.update(fields)


def _serve_program():
    import json

    _allow_long_ints()
    requests_fd, replies_fd = (int(fd) for fd in sys.argv[3].split(","))
    requests = os.fdopen(requests_fd, "rb")
    try:
        code = _load_program()
        namespace = {"__name__": "solution", "__builtins__": __builtins__}
        exec(code, namespace)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a program that exits while loading
        _send(replies_fd, {"load_error": f"{type(exc).__name__}: {exc}"[:300]})
        os._exit(0)
    _send(replies_fd, {"ready": True})
    handles, refs = {}, {}

    def other(obj):
        if isinstance(obj, type(iter([]))) or (hasattr(obj, "__next__") and hasattr(obj, "__iter__")):
            return {"i": [_encode(v, other) for v in obj]}
        collections = sys.modules.get("collections")
        if collections is not None and isinstance(obj, collections.deque):
            return {"q": [_encode(v, other) for v in obj]}
        ref = refs.get(id(obj))
        if ref is None:
            ref = refs[id(obj)] = len(handles)
            handles[ref] = obj
        return {"h": ref}

    def resolve(tag, body):
        if tag == "h":
            return handles[body]
        if tag == "o":
            name, fields = body
            cls = namespace.get(name)
            decoded = {k: _decode(v, resolve) for k, v in fields.items()}
            if isinstance(cls, type):
                try:
                    obj = cls.__new__(cls)
                    obj.__dict__.update(decoded)
                    return obj
                except (TypeError, AttributeError):
                    pass
            return _Fields(decoded)
        raise ValueError(f"unknown tag {tag!r}")

    while True:
        line = requests.readline()
        if not line:
            os._exit(0)
        message = json.loads(line)
        try:
            if "get" in message:
                ref, name = message["get"]
                value = getattr(handles[ref], name)
            else:
                target = message["call"]
                fn = handles[target["h"]] if isinstance(target, dict) else namespace.get(target)
                if not callable(fn):
                    raise NameError(f"the program defines no function {target!r}")
                args = [_decode(a, resolve) for a in message["args"]]
                kwargs = {k: _decode(v, resolve) for k, v in message["kwargs"].items()}
                value = fn(*args, **kwargs)
            reply = {"value": _encode(value, other)}
        except Exception as exc:  # noqa: BLE001 - the tests see it raised by the function
            reply = {"raise": [type(exc).__name__, str(exc)[:1000]]}
        _send(replies_fd, reply)


def main():
    mode = sys.argv[1]
    _set_limits(_parse_limits(sys.argv[2]))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    if mode == "stdio":
        _run_stdio()
    elif mode == "call":
        _run_call()
    elif mode == "assert":
        _run_assert()
    elif mode == "program":
        _serve_program()
    else:
        sys.stderr.write(f"harness: unknown mode {mode!r}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
