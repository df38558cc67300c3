"""A code-execution reward: the completion's program, run against the prompt's tests.

``reward = "code_tests"`` (a dataset task's ``reward``, or ``job.reward``) reads the tests
from the prompt's metadata (a dataset row's ``tests`` field) in either of the two common
forms:

* a string of Python, appended to the program (MBPP / HumanEval style ``assert f(2) == 4``):
  the program passes if it exits 0;
* a list of ``{"input": ..., "output": ...}`` pairs (APPS / CodeContests style): the program
  runs once per pair with ``input`` on stdin and passes a pair when its stdout equals
  ``output``, trailing whitespace of each line ignored.

The program is the last fenced code block of the completion (```` ```python ```` or bare
```` ``` ````), or the whole completion when it has none. Reward: 1.0 if every test passes,
else 0.0 (binary, so it is its own pass@1 predicate). Each run is a child process under
``echo2.tasks.sandbox`` limits (wall and CPU time, memory, no network): a program that
fails, hangs or runs out of memory fails its test, it does not fail the reward. Tests that
are missing or malformed are the dataset's fault and raise, which the Rewarder counts by
reason (``raised:ValueError``) instead of scoring 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from echo2.tasks.base import Prompt
from echo2.tasks.sandbox import Limits, check_available, run_untrusted

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
TESTS_FIELD = "tests"


def extract_program(completion: str) -> str:
    """The last fenced code block of ``completion``, else all of it."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeTestsReward:
    """``(prompt, completion) -> 1.0 | 0.0``: do the prompt's tests pass? (module docstring)."""

    reward_range = (0.0, 1.0)

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()

    def check(self) -> None:
        """Raise ``SandboxUnavailable`` if this machine cannot apply the limits (called once,
        when the reward is loaded, so a launch fails before any process starts)."""
        check_available(self.limits)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        tests = _tests_of(prompt)
        program = extract_program(completion)
        if isinstance(tests, str):
            return 1.0 if run_untrusted(f"{program}\n\n{tests}\n", limits=self.limits).ok else 0.0
        for case in tests:
            result = run_untrusted(program, stdin=case["input"], limits=self.limits)
            if not result.ok or _lines(result.stdout) != _lines(case["output"]):
                return 0.0
        return 1.0


def _tests_of(prompt: Prompt) -> str | list[dict[str, str]]:
    tests: Any = prompt.meta.get(TESTS_FIELD)
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        tests = json.loads(tests)  # a CSV or Parquet column holding the pairs as JSON text
    if isinstance(tests, str) and tests.strip():
        return tests
    if isinstance(tests, Sequence) and tests and all(_is_case(case) for case in tests):
        return [{"input": str(case["input"]), "output": str(case["output"])} for case in tests]
    raise ValueError(
        f"task {prompt.task_id}: meta[{TESTS_FIELD!r}] must be Python test code or a list of "
        f"{{'input', 'output'}} pairs, got {type(tests).__name__}"
    )


def _is_case(case: object) -> bool:
    return isinstance(case, Mapping) and "input" in case and "output" in case


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


code_tests_reward = CodeTestsReward()
"""The registered ``code_tests`` reward, with the default limits."""
