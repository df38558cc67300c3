"""Final-answer extraction and numeric equivalence; the word-problem task; reasoning-gym."""

from __future__ import annotations

import itertools

import pytest

from echo2.tasks.base import Prompt, Task, load_task
from echo2.tasks.math_answer import (
    answers_match,
    extract_answer,
    math_reward,
    parse_number,
)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so the total is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("The answer is 1,234 apples.", "1,234"),
        ("#### 17", "17"),
        ("Answer: $5.50", "$5.50"),
        ("first 3, then 4, finally 12", "12"),
        ("no number here", None),
    ],
)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("predicted", "reference", "equal"),
    [
        ("1,234", "1234", True),
        ("0.5", "1/2", True),
        ("\\frac{1}{2}", "0.50", True),
        ("\\dfrac{6}{4}", "3/2", True),
        ("$12", "12", True),
        ("12.", "12", True),
        ("50%", "50", True),
        ("-3", "3", False),
        ("12", "13", False),
        ("1,23", "123", False),
        ("Paris", "paris", True),
        (None, "1", False),
    ],
)
def test_answers_match(predicted: str | None, reference: str, equal: bool) -> None:
    assert answers_match(predicted, reference) is equal


def test_parse_number_rejects_text() -> None:
    assert parse_number("abc") is None and parse_number("1/0") is None


def test_math_reward() -> None:
    prompt = Prompt("t", "q", "15")
    assert math_reward(prompt, "3 bags of 5 is 15, so the answer is 15.") == 1.0
    assert math_reward(prompt, "the answer is \\boxed{14}") == 0.0


def test_math_word_task() -> None:
    task = load_task("math_answer", max_value=30)
    assert isinstance(task, Task)
    train = list(itertools.islice(task.prompts(0), 200))
    held = task.heldout(20)
    assert {p.text for p in held}.isdisjoint(p.text for p in train)
    assert [p.text for p in task.heldout(5)] == [p.text for p in held[:5]]
    p = train[0]
    assert task.reward(p, f"\\boxed{{{p.answer}}}") == 1.0
    assert task.reward(p, "\\boxed{-1000}") == 0.0


def test_math_sums_task_holds_out_operand_pairs_in_every_phrasing() -> None:
    task = load_task("math_answer", problems="sums", max_value=15, instruction="")
    train = list(itertools.islice(task.prompts(0), 2000))
    for p in train[:50]:
        assert p.answer == str(p.meta["a"] + p.meta["b"]) and 0 <= p.meta["a"] <= 15 and 0 <= p.meta["b"] <= 15
        assert f"{p.meta['a']}" in p.text and p.text.endswith(("?", "."))
    held = task.heldout(72)  # 18 held-out pairs x 4 phrasings: all of them, each once
    assert len({p.text for p in held}) == 72
    held_pairs = {(p.meta["a"], p.meta["b"]) for p in held}
    assert len(held_pairs) == 18 and held_pairs.isdisjoint((p.meta["a"], p.meta["b"]) for p in train)
    assert [p.text for p in task.heldout(10)] == [p.text for p in held[:10]]
    assert task.reward(held[0], f"{held[0].meta['a']} + {held[0].meta['b']} = {held[0].answer}") == 1.0
    assert task.reward(held[0], "To add them, you simply add them together:") == 0.0
    with pytest.raises(ValueError, match="offers at most 72"):
        task.heldout(73)


def test_reasoning_gym_task() -> None:
    pytest.importorskip("reasoning_gym", reason="optional extra 'reasoning' (reasoning-gym) not installed")
    task = load_task("reasoning_gym", dataset="basic_arithmetic")
    p = next(task.prompts(0))
    import json

    answer = json.loads(p.answer)["answer"]
    assert task.reward(p, f"<answer>{answer}</answer>") == 1.0
    assert task.reward(p, "<answer>nonsense</answer>") < 1.0
    assert {q.text for q in task.heldout(10)}.isdisjoint(q.text for q in itertools.islice(task.prompts(0), 50))
