"""Math answers checked by Hugging Face's ``math-verify`` (``reward = "math_verify"``).

``math-verify`` parses the reference and the completion into sympy (LaTeX, ``\\boxed{}``,
plain expressions, sets, intervals, matrices) and compares them symbolically, so
``\\frac{1}{2}``, ``0.5`` and ``1/2`` match, as do ``x^2-1`` and ``(x-1)(x+1)``; the
hand-written parser of ``echo2.tasks.math_answer`` (``reward = "math_answer"``) compares
numbers and text only. 1.0 if they match, else 0.0, so the reward is its own correctness
predicate.

Timeouts: ``math-verify`` times out parsing with ``signal.alarm``, which works only in a
process's main thread; the Rewarder scores in worker threads under its own deadline
(``item_timeout_s``), so the library's timers are off here and a hung parse counts as
``timeout`` there.

Needs the ``verify`` extra (``pip install 'echo2[verify]'``; bootstrap installs it).
"""

from __future__ import annotations

import logging
from typing import Any

from echo2.tasks.base import Prompt, declares_reward_range


def _library() -> tuple[Any, Any]:
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError("reward 'math_verify' needs math-verify: pip install 'echo2[verify]'") from exc
    # It warns on every call that its timers are off: they are, on purpose (see above).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse, verify


@declares_reward_range(0.0, 1.0)
def math_verify_reward(prompt: Prompt, completion: str) -> float:
    """1.0 if ``completion``'s final answer is mathematically equal to ``prompt.answer``."""
    parse, verify = _library()
    reference = prompt.answer.strip()
    # A bare reference ("1/2", "x^2") is read as math, not searched for an answer in prose.
    gold = parse(
        reference if reference.startswith("$") or "\\boxed" in reference else f"${reference}$", parsing_timeout=None
    )
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {prompt.answer!r}")
    answer = parse(completion, parsing_timeout=None)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=None) else 0.0
