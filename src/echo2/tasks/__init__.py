"""Tasks: prompt sources with held-out splits and rewards (see :mod:`echo2.tasks.base`)."""

from echo2.tasks.addition import AdditionTask
from echo2.tasks.base import Prompt, RewardFn, Task, load_reward, load_task, with_reward

__all__ = ["AdditionTask", "Prompt", "RewardFn", "Task", "load_reward", "load_task", "with_reward"]
