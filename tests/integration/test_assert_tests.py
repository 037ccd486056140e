"""Assert-style code tests (HumanEval's check(candidate), MBPP's asserts) in the real sandbox.

The rows below are written in HumanEval's and MBPP's own shapes and go through the same path as
a benchmark file (`load_benchmark`, then the code grader). The hostile programs are ones that
would earn the reward under HumanEval's own harness, which runs prompt + completion + test +
`check(entry_point)` in one process: each must score 0 here, and the reference must still pass
afterwards.

These tests need bubblewrap (`apt-get install bubblewrap`; `make test` and `.ci/run` do it):
without it they fail, they are not skipped.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from pathlib import Path

import pytest

from swarmrl.config import SandboxConfig
from swarmrl.eval.formats import load_benchmark
from swarmrl.rewards.code import CodeGrader, open_code_grader

UID_BASE = 62200  # away from test_sandbox.py's; each pool claims its own uids from here up

# -- rows in HumanEval's shape ------------------------------------------------------------------

PALINDROME = {
    "task_id": "HumanEval/10",
    "prompt": "\n\ndef is_palindrome(string: str) -> bool:\n"
    '    """ Test if given string is a palindrome """\n'
    "    return string == string[::-1]\n\n\n"
    "def make_palindrome(string: str) -> str:\n"
    '    """ Find the shortest palindrome that begins with a supplied string.\n'
    "    >>> make_palindrome('')\n    ''\n    >>> make_palindrome('cat')\n    'catac'\n"
    '    """\n',
    "canonical_solution": "    if not string:\n        return ''\n\n    beginning_of_suffix = 0\n\n"
    "    while not is_palindrome(string[beginning_of_suffix:]):\n        beginning_of_suffix += 1\n\n"
    "    return string + string[:beginning_of_suffix][::-1]\n",
    "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\n"
    "def check(candidate):\n"
    "    assert candidate('') == ''\n"
    "    assert candidate('x') == 'x'\n"
    "    assert candidate('xyz') == 'xyzyx'\n"
    "    assert candidate('xyx') == 'xyx'\n"
    "    assert candidate('jerry') == 'jerryrrej'\n",
    "entry_point": "make_palindrome",
}
SUM_PRODUCT = {
    "task_id": "HumanEval/8",
    "prompt": "from typing import List, Tuple\n\n\n"
    "def sum_product(numbers: List[int]) -> Tuple[int, int]:\n"
    '    """ For a given list of integers, return a tuple of their sum and their product.\n'
    "    >>> sum_product([])\n    (0, 1)\n    >>> sum_product([1, 2, 3, 4])\n    (10, 24)\n"
    '    """\n',
    "canonical_solution": "    sum_value = 0\n    prod_value = 1\n\n    for n in numbers:\n"
    "        sum_value += n\n        prod_value *= n\n    return sum_value, prod_value\n",
    "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\n"
    "def check(candidate):\n"
    "    assert candidate([]) == (0, 1)\n"
    "    assert candidate([1, 1, 1]) == (3, 1)\n"
    "    assert candidate([100, 0]) == (100, 0)\n"
    "    assert candidate([3, 5, 7]) == (3 + 5 + 7, 3 * 5 * 7)\n"
    "    assert candidate([10]) == (10, 10)\n",
    "entry_point": "sum_product",
}
DECODE_SHIFT = {
    "task_id": "HumanEval/50",
    "prompt": "\n\ndef encode_shift(s: str):\n"
    '    """\n    returns encoded string by shifting every character by 5 in the alphabet.\n    """\n'
    '    return "".join([chr(((ord(ch) + 5 - ord("a")) % 26) + ord("a")) for ch in s])\n\n\n'
    "def decode_shift(s: str):\n"
    '    """\n    takes as input string encoded with encode_shift function. Returns decoded string.\n    """\n',
    "canonical_solution": '    return "".join([chr(((ord(ch) - 5 - ord("a")) % 26) + ord("a")) for ch in s])\n',
    "test": "\n\nMETADATA = {}\n\n\n"
    "def check(candidate):\n"
    "    from random import randint, choice\n    import copy\n    import string\n\n"
    "    letters = string.ascii_lowercase\n"
    "    for _ in range(100):\n"
    "        str = ''.join(choice(letters) for i in range(randint(10, 20)))\n"
    "        encoded_str = encode_shift(str)\n"
    "        assert candidate(copy.deepcopy(encoded_str)) == str\n",
    "entry_point": "decode_shift",
}
MEAN_DEVIATION = {
    "task_id": "HumanEval/4",
    "prompt": "from typing import List\n\n\n"
    "def mean_absolute_deviation(numbers: List[float]) -> float:\n"
    '    """ The average absolute difference between each element and the mean.\n'
    "    >>> mean_absolute_deviation([1.0, 2.0, 3.0, 4.0])\n    1.0\n"
    '    """\n',
    "canonical_solution": "    mean = sum(numbers) / len(numbers)\n"
    "    return sum(abs(x - mean) for x in numbers) / len(numbers)\n",
    "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\n"
    "def check(candidate):\n"
    "    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0/3.0) < 1e-6\n"
    "    assert abs(candidate([1.0, 2.0, 3.0, 4.0]) - 1.0) < 1e-6\n"
    "    assert abs(candidate([1.0, 2.0, 3.0, 4.0, 5.0]) - 6.0/5.0) < 1e-6\n",
    "entry_point": "mean_absolute_deviation",
}
HUMANEVAL = [PALINDROME, SUM_PRODUCT, DECODE_SHIFT, MEAN_DEVIATION]

# -- rows in MBPP's shape (the original file's and the sanitized one's) ----------------------------

MAX_HEIGHT = {  # the asserts pass trees of the setup's own class
    "task_id": 927,
    "text": "Write a function to calculate the height of the given binary tree.",
    "code": "class Node:\n\tdef __init__(self, data):\n\t\tself.data = data\n\t\tself.left = None\n"
    "\t\tself.right = None\ndef max_height(node):\n\tif node is None:\n\t\treturn 0\n\telse:\n"
    "\t\tleft_height = max_height(node.left)\n\t\tright_height = max_height(node.right)\n"
    "\t\tif (left_height > right_height):\n\t\t\treturn left_height+1\n\t\telse:\n"
    "\t\t\treturn right_height+1",
    "test_list": [
        "assert (max_height(root)) == 3",
        "assert (max_height(root1)) == 5",
        "assert (max_height(root2)) == 4",
    ],
    "test_setup_code": "class Node:\n\tdef __init__(self, data):\n\t\tself.data = data\n\t\tself.left = None\n"
    "\t\tself.right = None\nroot = Node(1)\nroot.left = Node(2)\nroot.right = Node(3)\n"
    "root.left.left = Node(4)\nroot.left.right = Node(5)\nroot1 = Node(1)\nroot1.left = Node(2)\n"
    "root1.left.left = Node(3)\nroot1.left.left.left = Node(4)\nroot1.left.left.left.left = Node(5)\n"
    "root2 = Node(1)\nroot2.left = Node(2)\nroot2.left.left = Node(3)\nroot2.left.left.left = Node(4)",
    "challenge_test_list": [],
}
MAX_CHAIN = {  # the asserts build objects of the program's own class
    "task_id": 601,
    "text": "Write a function to find the longest chain which can be formed from the given set of pairs.",
    "code": "class Pair(object): \n\tdef __init__(self, a, b): \n\t\tself.a = a \n\t\tself.b = b \n"
    "def max_chain_length(arr, n): \n\tmax = 0\n\tmcl = [1 for i in range(n)] \n\tfor i in range(1, n): \n"
    "\t\tfor j in range(0, i): \n\t\t\tif (arr[i].a > arr[j].b and\n\t\t\t\tmcl[i] < mcl[j] + 1): \n"
    "\t\t\t\tmcl[i] = mcl[j] + 1\n\tfor i in range(n): \n\t\tif (max < mcl[i]): \n\t\t\tmax = mcl[i] \n"
    "\treturn max",
    "test_list": [
        "assert max_chain_length([Pair(5, 24), Pair(15, 25),Pair(27, 40), Pair(50, 60)], 4) == 3",
        "assert max_chain_length([Pair(1, 2), Pair(3, 4),Pair(5, 6), Pair(7, 8)], 4) == 4",
        "assert max_chain_length([Pair(19, 10), Pair(11, 12),Pair(13, 14), Pair(15, 16), Pair(31, 54)], 5) == 5",
    ],
    "test_setup_code": "",
    "challenge_test_list": [],
}
VOLUME = {  # sanitized: 'prompt' and test_imports
    "source_file": "Benchmark Questions Verification V2.ipynb",
    "task_id": 82,
    "prompt": "Write a function to find the volume of a sphere.",
    "code": "import math\ndef volume_sphere(r):\n  volume=(4/3)*math.pi*r*r*r\n  return volume",
    "test_imports": ["import math"],
    "test_list": [
        "assert math.isclose(volume_sphere(10), 4188.790204786391, rel_tol=0.001)",
        "assert math.isclose(volume_sphere(25), 65449.84694978735, rel_tol=0.001)",
        "assert math.isclose(volume_sphere(20), 33510.32163829113, rel_tol=0.001)",
    ],
}


def benchmark(tmp_path: Path, records: list[dict], name: str) -> dict[str, dict]:
    """The records written as a benchmark file and read back the way `swarmrl eval` reads it."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return {row["problem_id"]: json.loads(row["verification_info"]) for row in load_benchmark(path)}


@pytest.fixture(scope="module")
def humaneval(tmp_path_factory) -> dict[str, dict]:
    return benchmark(tmp_path_factory.mktemp("he"), HUMANEVAL, "HumanEval")


@pytest.fixture(scope="module")
def mbpp(tmp_path_factory) -> dict[str, dict]:
    return benchmark(tmp_path_factory.mktemp("mbpp"), [MAX_HEIGHT, MAX_CHAIN, VOLUME], "mbpp")


def make_grader(**changes) -> CodeGrader:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: `apt-get install bubblewrap` (make test does it)")
    settings = dict(workers=2, test_timeout_s=2.0, total_timeout_s=8.0, uid_base=UID_BASE, memory_mb=256)
    settings.update(max_output_kb=256, startup_grace_s=1.0)
    return open_code_grader(SandboxConfig(**{**settings, **changes}))


@pytest.fixture(scope="module")
def grader():
    g = make_grader()
    yield g
    g.close()


def completion(program: str) -> str:
    return f"<think>\nok\n</think>\nHere is the function:\n```python\n{program}```\n"


def grade(grader: CodeGrader, info: dict, program: str) -> tuple[float, str]:
    (result,) = grader.grade_many([(info, completion(program))])
    if isinstance(result, Exception):
        raise result
    reward, reason = result
    return reward, reason or ""


def whole_function(row: dict) -> str:
    """The reference written the way a chat model answers: the full function, its imports too."""
    return row["prompt"].lstrip("\n") + row["canonical_solution"]


# -- the reference passes, a wrong answer fails ------------------------------------------------------


def test_reference_solutions_pass_as_a_body_or_as_a_whole_function(grader, humaneval):
    jobs = [(humaneval[row["task_id"]], completion(row["canonical_solution"])) for row in HUMANEVAL]
    jobs += [(humaneval[row["task_id"]], completion(whole_function(row))) for row in HUMANEVAL]
    assert grader.grade_many(jobs) == [(1.0, None)] * len(jobs)


@pytest.mark.parametrize(
    "task, program, says",
    [
        # A list is not the tuple the test wants: values cross as their own types.
        ("HumanEval/8", "def sum_product(numbers):\n    return [sum(numbers), 0]\n", "AssertionError (line"),
        ("HumanEval/10", "def make_palindrome(string):\n    return string\n", "wrong answer: AssertionError"),
        ("HumanEval/4", "def mean_absolute_deviation(numbers):\n    return 0.66\n", "wrong answer: AssertionError"),
        ("HumanEval/8", "def sumProduct(numbers):\n    return (0, 1)\n", "wrong answer"),  # the prompt's stub runs
        ("HumanEval/8", "def sum_product(numbers):\n    return 1 / 0\n", "the program raised ZeroDivisionError"),
        ("HumanEval/8", "def sum_product(numbers)\n    return 1\n", "the program failed to load: SyntaxError"),
    ],
)
def test_wrong_solutions_fail_with_the_reason(grader, humaneval, task, program, says):
    reward, reason = grade(grader, humaneval[task], program)
    assert reward == 0.0 and says in reason, reason


def test_an_infinite_loop_times_out(grader, humaneval):
    started = time.monotonic()
    for program in ("def sum_product(numbers):\n    while True:\n        pass\n", "while True:\n    pass\n"):
        reward, reason = grade(grader, humaneval["HumanEval/8"], program)
        assert reward == 0.0 and "time limit exceeded (2 s)" in reason, reason
    assert time.monotonic() - started < 12
    assert grade(grader, humaneval["HumanEval/8"], SUM_PRODUCT["canonical_solution"]) == (1.0, "")


# -- a completion cannot fake a pass ---------------------------------------------------------------

EQUALS_ANYTHING = "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"


@pytest.mark.parametrize(
    "task, program, says",
    [
        # Exit with success before the asserts run, or from inside the first call.
        ("HumanEval/8", "import sys\nsys.exit(0)\n", "the program failed to load: SystemExit: 0"),
        ("HumanEval/8", "import os\ndef sum_product(numbers):\n    os._exit(0)\n", "exited (code 0)"),
        # Write a pass where the harness's answer would go, then leave.
        (
            "HumanEval/8",
            "import os, sys\nfor fd in (1, 3, 4, 5, 6):\n    try:\n        os.write(fd, b'ok\\n' * 4)\n"
            "    except OSError:\n        pass\nprint('All tests passed')\nos._exit(0)\n",
            "runtime error",
        ),
        # Redefine check and AssertionError (globally too), then answer wrongly.
        (
            "HumanEval/8",
            "import builtins\nclass AssertionError(Exception):\n    pass\nbuiltins.AssertionError = AssertionError\n"
            "def check(candidate):\n    return True\ndef sum_product(numbers):\n    return (0, 0)\n",
            "wrong answer: AssertionError",
        ),
        # Replace the prompt's helper that the test uses to make its inputs: under one process
        # identity would then decode identity; here the test uses the prompt's own encode_shift.
        (
            "HumanEval/50",
            "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s\n",
            "wrong answer: AssertionError",
        ),
        # Objects that equal anything; subclasses of the expected types with such an __eq__.
        ("HumanEval/8", EQUALS_ANYTHING + "def sum_product(numbers):\n    return Yes()\n", "wrong answer"),
        (
            "HumanEval/10",
            "class S(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n"
            "def make_palindrome(string):\n    return S('no')\n",
            "wrong answer",
        ),
        (
            "HumanEval/8",
            "class T(tuple):\n    def __eq__(self, other):\n        return True\n    __hash__ = tuple.__hash__\n"
            "def sum_product(numbers):\n    return T((0, 0))\n",
            "wrong answer",
        ),
        # Patch the builtins and modules the asserts use.
        (
            "HumanEval/4",
            "import builtins\nbuiltins.abs = lambda x: 0\ndef mean_absolute_deviation(numbers):\n    return 99.0\n",
            "wrong answer",
        ),
        # Take the tests' process down, or walk up to it and patch it.
        ("HumanEval/8", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", "killed by signal 9"),
        (
            "HumanEval/8",
            "import sys\ndef sum_product(numbers):\n    f = sys._getframe()\n    while f.f_back:\n"
            "        f = f.f_back\n    f.f_globals['check'] = lambda c: None\n    return (0, 0)\n",
            "wrong answer",
        ),
    ],
)
def test_tampering_does_not_pass(grader, humaneval, task, program, says):
    reward, reason = grade(grader, humaneval[task], program)
    assert reward == 0.0 and says in reason, reason
    row = {r["task_id"]: r for r in HUMANEVAL}[task]
    assert grade(grader, humaneval[task], row["canonical_solution"]) == (1.0, "")


# A thief: looks for the answer in its own memory, its stdin and every process it can see
# (the tests' process holds it), and returns the first match.
THIEF = r"""
import os, re, sys
PATTERN = re.compile(rb"secret-[0-9a-f]{32}")

def scan(pid):
    found = []
    for name in ("cmdline", "environ", "fd/0"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as handle:
                found += PATTERN.findall(handle.read(1 << 20))
        except OSError:
            pass
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                low, high = (int(x, 16) for x in span.split("-"))
                if perms.startswith("rw") and high - low < (64 << 20):
                    try:
                        mem.seek(low)
                        found += PATTERN.findall(mem.read(high - low))
                    except (OSError, ValueError, OverflowError):
                        pass
    except OSError:
        pass
    return found

def steal():
    found = PATTERN.findall(sys.stdin.buffer.read())
    for pid in [os.getppid(), 1, "self"] + [p for p in os.listdir("/proc") if p.isdigit()]:
        found += [f for f in scan(pid) if f != MINE]
    return found[0].decode() if found else "nothing found"
"""


def test_the_answer_cannot_be_stolen_from_the_tests_process(grader):
    secret = f"secret-{secrets.token_hex(16)}"
    info = {
        "assert_tests": {
            "functions": ["answer"],
            "tests": ["check(answer)"],
            "setup": f"SECRET = {secret!r}\ndef check(candidate):\n    assert candidate() == SECRET\n",
        }
    }
    # Control: the thief does find the secret where it may read (its own memory), so its
    # failure below is the sandbox's doing. MINE is how it skips its own copy in the real try.
    decoy = f"secret-{secrets.token_hex(16)}"
    shown = f"MINE = b'none'\nKEPT = {secret!r}.encode()\n" + THIEF
    assert grade(grader, info, shown + "def answer():\n    return steal()\n") == (1.0, "")
    program = f"MINE = {decoy!r}.encode()\n" + THIEF + "def answer():\n    return steal()\n"
    reward, reason = grade(grader, info, program)
    assert reward == 0.0 and "AssertionError" in reason, reason


# -- MBPP ---------------------------------------------------------------------------------------------


def test_mbpp_references_pass(grader, mbpp):
    rows = [MAX_HEIGHT, MAX_CHAIN, VOLUME]
    results = grader.grade_many([(mbpp[str(row["task_id"])], completion(row["code"] + "\n")) for row in rows])
    assert results == [(1.0, None)] * 3
    # The tree the setup built reaches a program that does not define Node as an object with
    # the same attributes; objects the program made (Pair) come back to it as themselves.
    height = (
        "def max_height(node):\n    return 0 if node is None else 1 + max(map(max_height, (node.left, node.right)))\n"
    )
    assert grade(grader, mbpp["927"], height) == (1.0, "")


def test_mbpp_asserts_are_tests_for_partial_credit(mbpp):
    right_twice = "import math\ndef volume_sphere(r):\n    return (4/3) * math.pi * r ** 3 if r != 20 else 1.0\n"
    patched = "import math\nmath.isclose = lambda *a, **k: True\ndef volume_sphere(r):\n    return 0.0\n"
    grader = make_grader(partial_credit=True)
    try:
        reward, reason = grade(grader, mbpp["82"], right_twice)
        assert reward == pytest.approx(2 / 3) and reason.startswith("test 3 of 3: wrong answer"), reason
        assert grade(grader, mbpp["82"], patched)[0] == 0.0  # math.isclose of the tests is their own
    finally:
        grader.close()


# -- broken rows are errors, not zeros ----------------------------------------------------------------


@pytest.mark.parametrize(
    "tests, says",
    [
        ({"setup": "import no_such_module\n", "tests": ["assert f(1) == 2"]}, "the setup failed"),
        ({"setup": "def check(candidate):\n    pass\n", "tests": ["check(f)"]}, "never called the program"),
    ],
)
def test_a_broken_row_is_an_error_for_every_program(grader, tests, says):
    info = {"assert_tests": {"functions": ["f"], **tests}}
    (result,) = grader.grade_many([(info, completion("def f(x):\n    return x + 1\n"))])
    assert isinstance(result, ValueError) and "assert_tests are broken" in str(result) and says in str(result)


def test_values_cross_as_themselves(grader):
    """Long ints, floats, None, nested tuples/sets/dicts with non-string keys, bytes, iterators."""
    setup = (
        "import math\n"
        "def check(candidate):\n"
        "    assert candidate('fact') == math.factorial(2000)\n"  # 5736 digits, past 3.11's str limit
        "    assert candidate('float') == 0.1 + 0.2 and candidate('inf') == float('inf')\n"
        "    assert candidate('nan') != candidate('nan')\n"
        "    assert candidate('none') is None and candidate('bool') is True\n"
        "    assert candidate('nested') == {1: (2, frozenset({3})), (4, 5): [b'x', {6}], 'k': 1j}\n"
        "    assert list(candidate('gen')) == [0, 1, 4]\n"
        "    assert candidate('nested', key=2) == 2\n"
    )
    program = (
        "import math\n"
        "def f(what, key=None):\n"
        "    if key is not None:\n        return key\n"
        "    return {'fact': math.factorial(2000), 'float': 0.1 + 0.2, 'inf': float('inf'), 'nan': float('nan'),\n"
        "            'none': None, 'bool': True, 'gen': (i * i for i in range(3)),\n"
        "            'nested': {1: (2, frozenset({3})), (4, 5): [b'x', {6}], 'k': 1j}}[what]\n"
    )
    info = {"assert_tests": {"functions": ["f"], "tests": ["check(f)"], "setup": setup}}
    assert grade(grader, info, program) == (1.0, "")
