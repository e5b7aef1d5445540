"""Verifiable rewards against hand-worked answers, the sandbox's containment (each escape
refused with its reason, the test process untouched, the scratch directory gone), and
RewardSet's weighting and failure handling."""

import logging
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest
from axplug_rl import math_reward as math_module
from axplug_rl.code_reward import CodeReward, extract_code
from axplug_rl.math_reward import MathReward
from axplug_rl.reward_set import BUILTIN_REWARDS, RewardSet
from axplug_rl.rewards import ExactMatch, RegexReward, Reward
from axplug_rl.sandbox import run_python

from axplug.api.config import ConfigError

# ---- exact_match


@pytest.mark.parametrize(
    "completion",
    [
        "Let me think. 6 * 7 = 42, so the result is \\boxed{42}.",
        "First guess \\boxed{41}, but rechecking: \\boxed{ 42 }",
        "The sum works out.\nAnswer: 42\nI am confident.",
        "answer: 40 is wrong. Final answer:  42.",
        "We compute step by step.\n\n42\n\n",
        "#### 42",
    ],
)
def test_exact_match_finds_the_answer(completion):
    assert ExactMatch().score(completion, {"answer": "42"}) == 1.0


@pytest.mark.parametrize(
    "completion",
    ["\\boxed{41}", "Answer: 4 2", "42 is close but the answer: 24", "42\nno wait, 43", ""],
)
def test_exact_match_wrong_answers_score_zero(completion):
    assert ExactMatch().score(completion, {"answer": "42"}) == 0.0


def test_exact_match_normalises_separators_case_and_punctuation():
    reward = ExactMatch()
    assert reward.score("Answer: 1,000,000", {"answer": "1000000"}) == 1.0
    assert reward.score("Answer: $1000$", {"answer": "1,000"}) == 1.0
    assert reward.score("Answer: **Paris**.", {"answer": "paris"}) == 1.0
    assert reward.score("Answer: New   York", {"answer": "new york"}) == 1.0
    assert reward.score("Answer: (1, 2)", {"answer": "(1,2)"}) == 0.0  # not a separator
    assert ExactMatch(case_sensitive=True).score("Answer: Paris", {"answer": "paris"}) == 0.0


def test_exact_match_accepts_a_list_a_field_and_the_full_completion():
    sample = {"answer": "x", "aliases": ["NYC", "New York City"]}
    reward = ExactMatch(field="aliases")
    assert reward.score("Answer: new york city", sample) == 1.0
    assert reward.score("Answer: nyc", sample) == 1.0
    assert reward.score("Answer: york", sample) == 0.0
    full = ExactMatch(extract="full")
    assert full.score("  Blue. ", {"answer": "blue"}) == 1.0
    assert full.score("It is blue", {"answer": "blue"}) == 0.0
    with pytest.raises(ValueError, match="no 'aliases' field"):
        reward.score("Answer: nyc", {"answer": "nyc"})


def test_unknown_or_bad_options_name_the_reward_and_its_options():
    with pytest.raises(ConfigError, match="'exact_match': unknown option 'fild'") as info:
        ExactMatch(fild="answer")
    assert "field, extract, case_sensitive" in str(info.value)
    with pytest.raises(ConfigError, match="extract='boxed'"):
        ExactMatch(extract="boxed")
    with pytest.raises(ConfigError, match="workers=0"):
        CodeReward(workers=0)


# ---- regex

FORMAT = r"<think>.*</think>\s*<answer>.*</answer>"


def test_regex_rewards_a_format():
    reward = RegexReward(pattern=FORMAT)
    good = "<think>two and\ntwo</think>\n<answer>4</answer>"
    assert reward.score(good, {}) == 1.0
    assert reward.score("<answer>4</answer>", {}) == 0.0
    assert reward.score("<think>hm</think> 4", {}) == 0.0
    strict = RegexReward(pattern=FORMAT, full_match=True, score=0.5)
    assert strict.score(good, {}) == 0.5
    assert strict.score(good + " and more", {}) == 0.0


def test_regex_bad_or_missing_pattern_is_a_config_error():
    with pytest.raises(ConfigError, match=r"pattern '<answer>\(' is not a regular expression"):
        RegexReward(pattern="<answer>(")
    with pytest.raises(ConfigError, match="needs a pattern"):
        RegexReward()


# ---- math


@pytest.fixture(scope="module")
def math_reward():
    return MathReward()


def test_math_verifies_equivalence(math_reward):
    assert math_reward.score("So the answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert math_reward.score("1/3", {"answer": "0.5"}) == 0.0
    assert math_reward.score("$x^2 + 2x + 1$", {"answer": "(x+1)^2"}) == 1.0
    assert math_reward.score("\\boxed{7}", {"answer": ["6", "7"]}) == 1.0
    with pytest.raises(ValueError, match="no 'answer' field"):
        math_reward.score("\\boxed{3}", {"solution": "3"})
    assert MathReward(field="solution").score("\\boxed{3}", {"solution": "3"}) == 1.0


def test_math_works_from_a_thread(math_reward):
    got = []
    thread = threading.Thread(
        target=lambda: got.append(math_reward.score("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}))
    )
    thread.start()
    thread.join(30)
    assert got == [1.0]


def test_math_worker_that_hangs_is_killed_and_restarted(monkeypatch):
    # A worker that never answers (as if stuck in C, where its alarm cannot reach).
    stuck = "import sys, time\nprint('{\"ready\": true}', flush=True)\nsys.stdin.readline()\n"
    monkeypatch.setattr(math_module, "_MATH_WORKER", stuck + "time.sleep(100)\n")
    monkeypatch.setattr(math_module, "_MATH_GRACE_S", 0.2)
    reward = MathReward(timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer within 0.3s"):
        reward.score("\\boxed{1}", {"answer": "1"})
    assert time.monotonic() - started < 3
    assert reward._worker._proc is None  # killed: the next score starts a fresh one
    answers = stuck + "print('{\"equal\": true}', flush=True)"
    monkeypatch.setattr(math_module, "_MATH_WORKER", answers)
    assert reward.score("\\boxed{1}", {"answer": "1"}) == 1.0


# ---- code


def test_extract_code_takes_the_last_python_block():
    text = "Plan:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\n```bash\nls\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"


def test_code_reward_runs_the_tests_after_the_solution():
    reward = CodeReward(timeout_s=3)
    sample = {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}
    right = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert reward.score(right, sample) == 1.0
    assert reward.score("def add(a, b):\n    return a - b", sample) == 0.0
    listed = {"tests": ["assert add(1, 1) == 2", "assert add(0, 5) == 5"]}
    assert reward.score(right, listed) == 1.0
    assert reward.score("def add(a, b) return", sample) == 0.0
    # Leaving before the tests run is no pass.
    assert reward.score("import sys\nsys.exit(0)", sample) == 0.0
    assert reward.score("import os\nos._exit(0)", sample) == 0.0
    assert reward.score("def add(a, b):\n    return a + b\nexit()", sample) == 0.0


def test_code_reward_batch_runs_in_parallel_in_order():
    reward = CodeReward(timeout_s=3, workers=2)
    sample = {"tests": "assert square(3) == 9"}
    solutions = ["def square(x):\n    return x * x", "def square(x):\n    return x + x"] * 2
    assert reward.score_batch(solutions, [sample] * 4) == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "solution",
    [
        "print(open('/etc/passwd').read())",
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import os\nos.fork()",
    ],
)
def test_code_reward_scores_an_escape_zero(solution):
    assert CodeReward(timeout_s=3).score(solution + "\nok = 1", {"tests": "assert ok"}) == 0.0


# ---- the sandbox


def _run(body, *, timeout_s=5.0, memory_mb=256, stdin=""):
    """Runs `body` after a line printing its cwd, and checks that directory is gone after."""
    code = "import os\nprint(os.getcwd(), flush=True)\n" + body
    result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin)
    scratch = result.stdout.splitlines()[0]
    assert "axplug-sandbox-" in scratch
    assert not os.path.exists(scratch)
    return result


def test_sandbox_runs_an_ordinary_program(monkeypatch):
    monkeypatch.setenv("AXPLUG_TEST_TOKEN", "hunter2")
    body = (
        "import collections, json, math, tempfile, threading\n"
        "P = collections.namedtuple('P', 'x y')\n"
        "with open('notes.txt', 'w') as f:\n    f.write(json.dumps(P(1, 2)._asdict()))\n"
        "print(open('notes.txt').read(), sorted(os.listdir('.')))\n"
        "print(tempfile.mkstemp()[1].startswith(os.getcwd()))\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "print(input()[::-1], math.isqrt(99))\n"
        "print(sorted(os.environ))\n"
    )
    result = _run(body, stdin="olleh\n")
    assert result.ok and result.reason == "ok" and result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[1:5] == ['{"x": 1, "y": 2} [\'main.py\', \'notes.txt\']', "True", "thread",
                          "hello 9"]  # fmt: skip
    assert "AXPLUG_TEST_TOKEN" not in result.stdout and "hunter2" not in result.stdout


def test_sandbox_reports_exits_and_tracebacks():
    failed = _run("def f():\n    raise ValueError('bad input')\nf()")
    assert (failed.ok, failed.exit_code, failed.reason) == (False, 1, "exit 1")
    assert "ValueError: bad input" in failed.stderr and "_sandbox_child" not in failed.stderr
    left = _run("print('leaving')\nexit(7)")  # exit() as with site, though the child has -S
    assert (left.ok, left.exit_code, left.reason) == (False, 7, "exit 7")
    assert left.stdout.splitlines()[1:] == ["leaving"]


def test_sandbox_refuses_reading_outside_its_directory(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-launch-codes")
    for path in (str(secret), "/etc/passwd", __file__):
        result = _run(f"print(open({path!r}).read())")
        assert (result.ok, result.reason, result.exit_code) == (False, "filesystem", 111)
        assert "the-launch-codes" not in result.stdout and "root:" not in result.stdout
        assert f"refused open {path!r}" in result.stderr
    listing = _run(f"print(os.listdir({str(tmp_path)!r}))")
    assert listing.reason == "filesystem" and "secret.txt" not in listing.stdout


def test_sandbox_refusal_cannot_be_caught():
    body = "try:\n    open('/etc/passwd')\nexcept BaseException:\n    print('caught')\n"
    result = _run(body)
    assert result.reason == "filesystem" and "caught" not in result.stdout


def test_sandbox_refuses_writing_outside_its_directory(tmp_path):
    target = tmp_path / "planted.txt"
    result = _run(f"open({str(target)!r}, 'w').write('x')")
    assert result.reason == "filesystem"
    assert not target.exists()
    escape = _run("os.makedirs('../axplug-escape', exist_ok=True)")
    assert escape.reason == "filesystem"
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "axplug-escape"))


def test_sandbox_refuses_the_network():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    try:
        port = server.getsockname()[1]
        body = (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'hello')\nprint('connected')\n"
        )
        result = _run(body)
        assert (result.ok, result.reason, result.exit_code) == (False, "network", 112)
        assert "connected" not in result.stdout
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected
    finally:
        server.close()


def test_sandbox_uses_namespaces_where_the_kernel_allows_them():
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to tell whether namespaces are allowed here")
    allowed = subprocess.run(["unshare", "-rnp", "--fork", "true"], capture_output=True)
    if allowed.returncode != 0:
        pytest.skip("this kernel or container allows no new namespaces")
    body = (
        "import signal\nprint(os.readlink('/proc/self/ns/net'), os.getpid(), os.getppid())\n"
        "try:\n"
        f"    signal.pidfd_send_signal(os.pidfd_open({os.getpid()}), 0)\n"
        "    print('reached the test process')\n"
        "except ProcessLookupError:\n"
        "    print('no such process')\n"
    )
    result = _run(body)
    assert result.ok, result.stderr
    network, pid, parent = result.stdout.splitlines()[1].split()
    assert network != os.readlink("/proc/self/ns/net")
    assert (pid, parent) == ("1", "0")  # process 1 of its own: nothing outside to signal
    assert result.stdout.splitlines()[2] == "no such process"


def test_sandbox_kills_an_endless_loop():
    started = time.monotonic()
    result = _run("while True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - started < 2.5
    assert (result.ok, result.timed_out, result.reason, result.exit_code) == (
        False, True, "timeout", None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "body", ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(' ' * 10**6)"]
)
def test_sandbox_caps_memory(body):
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = _run(body, memory_mb=256)
    assert (result.ok, result.reason, result.exit_code) == (False, "memory", 114)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kb < 64 * 1024


@pytest.mark.parametrize(
    "body",
    [
        "os.fork()",
        "import subprocess\nsubprocess.run(['echo', 'spawned'])",
        "os.system('echo spawned')",
        "os.execv('/bin/echo', ['echo', 'spawned'])",
        "import ctypes\nctypes.CDLL(None).system(b'echo spawned')",
    ],
)
def test_sandbox_refuses_new_processes(body):
    result = _run(body)
    assert (result.ok, result.reason, result.exit_code) == (False, "process", 113)
    assert "spawned" not in result.stdout


def test_sandbox_checks_its_limits():
    with pytest.raises(ValueError, match="memory_mb=8"):
        run_python("pass", timeout_s=1, memory_mb=8)
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_python("pass", timeout_s=0, memory_mb=256)


# ---- RewardSet


class Picky(Reward):
    """Raises on samples it dislikes; 0.25 otherwise."""

    name = "picky"

    def score(self, completion, sample):
        if sample.get("bad"):
            raise KeyError("no such thing")
        return float("nan") if sample.get("nan") else 0.25


LOOKUP = {**BUILTIN_REWARDS, "picky": Picky}


def test_reward_set_weights_and_options():
    rewards_ = RewardSet(
        ["exact_match", "regex:pattern='<answer>',score=0.5", "regex:pattern='^A'"],
        [2.0, 1.0, -1.0],
    )
    assert rewards_.names == ["exact_match", "regex", "regex_2"]
    completions = ["<answer>\nAnswer: 7", "A wrong answer: 8", "7"]
    total, scores, failures = rewards_.score(completions, [{"answer": "7"}] * 3)
    np.testing.assert_array_equal(scores["exact_match"], [1, 0, 1])
    np.testing.assert_array_equal(scores["regex"], [0.5, 0, 0])
    np.testing.assert_array_equal(scores["regex_2"], [0, 1, 0])
    assert total.dtype == np.float32
    np.testing.assert_allclose(total, [2.5, -1.0, 2.0])
    assert failures == {"exact_match": 0, "regex": 0, "regex_2": 0}
    field = RewardSet(["exact_match:field='solution',case_sensitive=True"])
    assert field.score(["Answer: Ok"], [{"solution": "Ok"}])[0].tolist() == [1.0]


def test_reward_set_failure_scores_zero_counts_and_warns_once(caplog):
    rewards_ = RewardSet(["picky", "exact_match"], [1.0, 1.0], lookup=LOOKUP)
    samples = [{"answer": "1"}, {"answer": "2", "bad": True}, {"answer": "3", "bad": True},
               {"answer": "4", "nan": True}]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="axplug.rl"):
        total, scores, failures = rewards_.score(["1", "2", "x", "4"], samples)
    np.testing.assert_array_equal(scores["picky"], [0.25, 0, 0, 0])
    np.testing.assert_array_equal(scores["exact_match"], [1, 1, 0, 1])
    np.testing.assert_allclose(total, [1.25, 1, 0, 1])
    assert failures == {"picky": 3, "exact_match": 0}
    warnings = [r for r in caplog.records if r.name == "axplug.rl"]
    assert len(warnings) == 1
    assert "'picky' failed on 3 of 4" in warnings[0].getMessage()
    assert "KeyError" in warnings[0].getMessage()


def test_reward_set_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="'exact' is unknown; known rewards: code, exact_match"):
        RewardSet(["exact"])

    def registry(name):
        raise LookupError(f"no rewards component named {name!r}")

    with pytest.raises(ConfigError, match="'mine' is unknown: no rewards component"):
        RewardSet(["mine"], lookup=registry)


def test_reward_set_checks_weights_and_specs():
    with pytest.raises(ConfigError, match="2 rewards but 3 weights"):
        RewardSet(["exact_match", "math"], [1.0, 0.5, 0.2])
    with pytest.raises(ConfigError, match="'regex': unknown option 'patern'"):
        RewardSet(["regex:patern='x'"])
    with pytest.raises(ConfigError, match="expected a list"):
        RewardSet("exact_match")
