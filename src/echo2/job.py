"""The job: settings every actor of a run must agree on (one ``[job]`` table in the topology)."""

from __future__ import annotations

from typing import Any

import msgspec


class JobConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Settings several actors must agree on. One ``[job]`` table in the topology."""

    staleness: int = 3
    """S: a group made by policy version v is trained at learner version t only if v >= t - S."""
    task: str = "addition"
    """Built-in task name (``echo2.registry.TASKS``) or ``module:function`` returning a Task."""
    task_kwargs: dict[str, Any] = {}
    """Keyword arguments of the task's factory (checked against its signature at load)."""
    reward: str = ""
    """Optional training reward replacing the task's own: a built-in name ("exact",
    "math_answer") or ``module:function``. The task's correctness predicate (its metric) stays."""
    group_size: int = 8
    """G: completions sampled per prompt (one GRPO group)."""
    groups_per_step: int = 16
    """Prompts (groups) per learner update; R = groups_per_step * group_size rollouts."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0; evaluation is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass of the rollouts, in (0, 1] (1: the whole distribution)."""
    max_new_tokens: int = 8
    """Most tokens generated per completion, EOS included."""
    model: str = ""
    """"": the built-in warm-started tiny model; "smollm2"; or a model directory (Hugging Face
    or tiny-model checkpoint). See ``echo2.models.policy``."""
    seed: int = 0
    """Seed of the prompt stream and, mixed with each sampler's name, of its engine."""

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0")
        if self.group_size < 1:
            raise ValueError("group_size must be >= 1")
        if self.groups_per_step < 1:
            raise ValueError("groups_per_step must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.temperature <= 0.0:
            raise ValueError("temperature must be > 0")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
