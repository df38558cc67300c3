"""Verifiable rewards done by libraries and sandboxes: math-verify and code execution."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path

import pytest

from echo2.errors import ResolveError
from echo2.tasks.base import Prompt, load_reward, reward_range
from echo2.tasks.code_execution import CodeTestsReward, extract_program
from echo2.tasks.math_answer import math_reward
from echo2.tasks.sandbox import Limits, SandboxUnavailable, run_untrusted

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="math-verify not installed: pip install 'echo2[verify]'"
)


def _math(answer: str) -> Prompt:
    return Prompt(task_id="m", text="?", answer=answer)


@needs_math_verify
@pytest.mark.parametrize(
    ("answer", "completion", "expected"),
    [
        ("1/2", "so the result is \\boxed{0.5}", 1.0),
        ("\\frac{1}{2}", "The answer is $\\frac{2}{4}$.", 1.0),
        ("2", "\\boxed{\\sqrt{4}}", 1.0),
        ("(x-1)(x+1)", "Expanding, \\boxed{x^2 - 1}", 1.0),
        ("1234", "In total 1,234 apples.", 1.0),
        ("3", "\\boxed{4}", 0.0),
        ("3", "I do not know.", 0.0),
    ],
)
def test_math_verify_matches_equal_answers_in_any_notation(answer: str, completion: str, expected: float) -> None:
    reward = load_reward("math_verify")
    assert reward(_math(answer), completion) == expected
    assert reward_range(reward) == (0.0, 1.0)


@needs_math_verify
def test_math_verify_does_better_than_the_hand_written_parser_and_runs_in_a_worker_thread() -> None:
    reward = load_reward("math_verify")
    cases = [(_math("2"), "\\boxed{\\sqrt{4}}"), (_math("(x-1)(x+1)"), "\\boxed{x^2-1}")]
    assert [math_reward(p, c) for p, c in cases] == [0.0, 0.0]
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.extend(reward(p, c) for p, c in cases))  # as the Rewarder
    worker.start()
    worker.join()
    assert results == [1.0, 1.0]


@needs_math_verify
def test_a_reference_math_verify_cannot_read_raises_instead_of_scoring_0() -> None:
    with pytest.raises(ValueError, match="cannot parse the reference"):
        load_reward("math_verify")(_math("  "), "\\boxed{1}")


# -- sandbox and code execution ------------------------------------------------------------


def test_the_program_is_the_last_fenced_block() -> None:
    text = "First try:\n```python\nprint(1)\n```\nBetter:\n```\nprint(2)\n```\nDone."
    assert extract_program(text) == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"


def test_untrusted_code_is_stopped_by_its_time_memory_and_network_limits() -> None:
    started = time.monotonic()
    sleeper = run_untrusted("import time\ntime.sleep(60)", limits=Limits(wall_s=1.0))
    assert sleeper.timed_out and not sleeper.ok
    assert time.monotonic() - started < 30  # killed at its wall limit, not after the sleep
    spinner = run_untrusted("while True: pass", limits=Limits(wall_s=60.0, cpu_s=1))
    assert not spinner.timed_out and spinner.returncode < 0  # SIGXCPU/SIGKILL from RLIMIT_CPU
    hog = run_untrusted("x = bytearray(4 << 30)", limits=Limits(memory_mb=256))
    assert "MemoryError" in hog.stderr
    with socket.socket() as listener:  # a service on this machine the program must not reach
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        probe = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        assert run_untrusted(probe).stdout == ""
        assert run_untrusted(probe, limits=Limits(network=True)).stdout == "connected\n"  # asked for


def test_untrusted_code_sees_no_pythonpath_and_runs_in_an_empty_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    result = run_untrusted("import os, sys\nprint(sorted(os.listdir('.')))\nprint('tests' in ''.join(sys.path))")
    assert result.stdout.splitlines() == ["['program.py']", "False"]


def _code(tests: object) -> Prompt:
    return Prompt(task_id="c7", text="Write add(a, b).", answer="", meta={"tests": tests})


def test_code_tests_reward_runs_assert_style_and_stdin_stdout_tests() -> None:
    reward = load_reward("code_tests")
    asserts = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    assert reward(_code(asserts), "```python\ndef add(a, b):\n    return a + b\n```") == 1.0
    assert reward(_code(asserts), "```python\ndef add(a, b):\n    return a - b\n```") == 0.0
    impatient = CodeTestsReward(Limits(wall_s=1.0, cpu_s=1))
    assert impatient(_code(asserts), "```python\ndef add(a, b):\n    while True: pass\n```") == 0.0
    pairs = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6\n"}]
    program = "a, b = map(int, input().split())\nprint(a + b)   "
    assert reward(_code(pairs), program) == 1.0
    assert reward(_code('[{"input": "1 1", "output": "2"}]'), program) == 1.0  # JSON text of a CSV column
    assert reward(_code(pairs), "print(5)") == 0.0  # the second pair fails


@pytest.mark.parametrize("tests", [None, "", [], [{"input": "1"}], 7])
def test_missing_or_malformed_tests_raise_for_the_rewarder_to_count(tests: object) -> None:
    with pytest.raises(ValueError, match="meta\\['tests'\\]"):
        CodeTestsReward()(_code(tests), "print(1)")


def test_a_machine_that_cannot_isolate_code_fails_when_the_reward_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(limits: Limits | None = None) -> None:
        raise SandboxUnavailable("cannot isolate the network (Operation not permitted)")

    monkeypatch.setattr("echo2.tasks.code_execution.check_available", unavailable)
    with pytest.raises(ResolveError, match="reward 'code_tests' cannot run on this machine: cannot isolate"):
        load_reward("code_tests")
