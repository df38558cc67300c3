"""The built-in addition task and the task/reward loaders."""

from __future__ import annotations

import itertools
import sys
import textwrap

import pytest

from echo2.tasks import AdditionTask, Prompt, Task, load_reward, load_task, with_reward
from echo2.tasks.addition import is_heldout_pair, reversed_sum


def test_prompt_format_and_reversed_answer() -> None:
    task = AdditionTask()
    for p in itertools.islice(task.prompts(3), 200):
        a, b = p.meta["a"], p.meta["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert p.text == f"{a}+{b}="
        assert p.answer == str(a + b)[::-1]
    assert task.name == "add3"


def test_reward_is_exact_match_of_reversed_sum() -> None:
    task = AdditionTask()
    p = Prompt(task_id="t", text="123+456=", answer="975", meta={"a": 123, "b": 456})
    assert task.reward(p, "975") == 1.0
    assert task.reward(p, "579") == 0.0  # not reversed
    assert task.reward(p, "9750") == 0.0
    assert task.reward(p, "") == 0.0
    assert reversed_sum(999, 999) == "8991"  # 1998 reversed, no padding
    assert reversed_sum(100, 100) == "002"  # 200 reversed keeps its zeros
    carry = Prompt(task_id="c", text="999+999=", answer="8991", meta={})
    assert task.reward(carry, "8991") == 1.0


def test_prompts_are_deterministic_per_seed_with_unique_ids() -> None:
    task = AdditionTask()
    first = list(itertools.islice(task.prompts(7), 500))
    assert first == list(itertools.islice(AdditionTask().prompts(7), 500))
    assert first != list(itertools.islice(task.prompts(8), 500))
    assert len({p.task_id for p in first}) == 500
    assert first[0].task_id == "add3-7-0"


def test_heldout_is_fixed_distinct_and_disjoint_from_training() -> None:
    task = AdditionTask()
    heldout = task.heldout(300)
    assert heldout == AdditionTask().heldout(300)
    assert heldout[:50] == task.heldout(50)
    pairs = {(p.meta["a"], p.meta["b"]) for p in heldout}
    assert len(pairs) == 300
    assert all(is_heldout_pair(a, b) for a, b in pairs)
    for seed in (0, 1):
        train = {(p.meta["a"], p.meta["b"]) for p in itertools.islice(task.prompts(seed), 10_000)}
        assert not train & pairs
    with pytest.raises(ValueError):
        AdditionTask(digits=1).heldout(1000)


def test_other_digit_counts() -> None:
    p = next(AdditionTask(digits=2).prompts(0))
    assert len(p.text) == 6 and p.task_id.startswith("add2-")
    with pytest.raises(ValueError, match="digits"):
        AdditionTask(digits=0)


def test_load_builtin_task() -> None:
    task = load_task("addition", digits=2)
    assert isinstance(task, AdditionTask) and task.digits == 2
    assert isinstance(task, Task)


@pytest.fixture
def user_module(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module with a task factory and a reward, as a user would write them."""
    name = "echo2_user_task_for_tests"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
        from echo2.tasks import AdditionTask

        def make_task(digits=3):
            return AdditionTask(digits=digits)

        def always_half(prompt, completion):
            return 0.5

        NOT_CALLABLE = 3

        def not_a_task():
            return object()
        """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_load_task_by_import_path(user_module: str) -> None:
    task = load_task(f"{user_module}:make_task", digits=2)
    assert isinstance(task, AdditionTask) and task.digits == 2


def test_load_task_errors_name_the_spec(user_module: str) -> None:
    for spec in (
        "no_such_module_xyz:make",
        f"{user_module}:missing",
        f"{user_module}:NOT_CALLABLE",
        f"{user_module}:not_a_task",
        "not-a-builtin",
        f"{user_module}:",
    ):
        with pytest.raises(ValueError, match=spec.split(":")[0]):
            load_task(spec)


def test_load_reward_and_override(user_module: str) -> None:
    reward = load_reward(f"{user_module}:always_half")
    task = with_reward(AdditionTask(), reward)
    p = next(task.prompts(0))
    assert task.reward(p, "whatever") == 0.5
    assert task.heldout(3) == AdditionTask().heldout(3)
    assert with_reward(AdditionTask(), None).reward(p, p.answer) == 1.0
    with pytest.raises(ValueError, match="nope"):
        load_reward(f"{user_module}:nope")
