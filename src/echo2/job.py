"""The job: settings every actor of a run must agree on (one ``[job]`` table in the topology)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Switch = Literal["auto", "on", "off"]


class PromptFormat(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[job.prompt_format]``: how a prompt's text becomes the token ids a model sees.

    One setting for every process: the trusted side tokenizes each prompt itself and
    refuses a group whose prompt ids differ (``prompt_mismatch``), so an engine cannot render
    prompts its own way. Applies to Hugging Face models; the built-in tiny model has no chat
    template, so anything but the defaults is refused for it.
    """

    chat_template: Switch = "auto"
    """"auto": the tokenizer's chat template when it has one; "on": require one; "off":
    the plain text (with the tokenizer's BOS handling)."""
    system_prompt: str = ""
    """A system message before each prompt (needs a chat template)."""
    thinking: Switch = "auto"
    """"on"/"off": the template's ``enable_thinking`` switch (Qwen3-style reasoning
    templates); "auto": the template's default. Refused for a template without the switch."""


class EpisodeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[job.episode]``: multi-turn episodes in an environment (``echo2.envs``) instead of
    one completion per prompt. Each rollout is an episode: the model acts, the environment
    answers with an observation appended as tokens, until it says done or ``max_turns``."""

    environment: str = ""
    """"": single-turn (the default); a built-in environment ("chain_addition") or
    ``module:factory`` returning an ``echo2.envs.Environment`` per episode."""
    environment_kwargs: dict[str, Any] = {}
    """Keyword arguments of the environment's factory (checked against its signature)."""
    max_turns: Annotated[int, Meta(ge=1, le=1024)] = 4
    """Most model turns of one episode."""
    max_episode_tokens: Annotated[int, Meta(ge=1)] = 1024
    """Most tokens of one episode after the prompt, actions and observations together (the
    prompt plus this must fit the model's context). An episode that would pass it ends."""
    turn_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    """Seconds one environment call (reset or step) may take; past it the episode failed
    (its lease is re-issued, never scored as 0)."""
    lease_fields: list[str] = []
    """Fields of a prompt's metadata sent with its lease for the environment to reset from
    on the sampler (they reach machines you may not trust: never the answer)."""
    trusted_samplers: list[str] = []
    """Samplers whose episodes of an environment that cannot be replayed (``replayable =
    False``: an external service) are accepted, rewards included. Names are proven only
    with ``[security] curve = true``."""


class JobConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Settings several actors must agree on. One ``[job]`` table in the topology."""

    staleness: Annotated[int, Meta(ge=0)] = 3
    """S: a group made by policy version v is trained at learner version t only if v >= t - S."""
    task: str = "addition"
    """Built-in task name (``echo2.registry.TASKS``) or ``module:function`` returning a Task."""
    task_kwargs: dict[str, Any] = {}
    """Keyword arguments of the task's factory (checked against its signature at load)."""
    reward: str = ""
    """Optional training reward replacing the task's own: a built-in name ("exact",
    "math_answer") or ``module:function``. The task's correctness predicate (its metric) stays."""
    group_size: Annotated[int, Meta(ge=1)] = 8
    """G: completions sampled per prompt (one GRPO group)."""
    groups_per_step: Annotated[int, Meta(ge=1)] = 16
    """Prompts (groups) per learner update; R = groups_per_step * group_size rollouts."""
    temperature: Annotated[float, Meta(gt=0)] = 1.0
    """Sampling temperature of the rollouts (> 0; evaluation is greedy)."""
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling mass of the rollouts, in (0, 1] (1: the whole distribution)."""
    max_new_tokens: Annotated[int, Meta(ge=1)] = 8
    """Most tokens generated per completion, EOS included."""
    model: str = ""
    """"": the built-in warm-started tiny model; "smollm2"; or a model directory (Hugging Face
    or tiny-model checkpoint). See ``echo2.models.policy``."""
    seed: Annotated[int, Meta(ge=0)] = 0
    """Seed of the prompt stream and, mixed with each sampler's name, of its engine."""
    prompt_format: PromptFormat = PromptFormat()
    """How prompts are rendered into token ids (chat template, system prompt, thinking)."""
    episode: EpisodeConfig = EpisodeConfig()
    """Multi-turn episodes in an environment (``[job.episode]``); single-turn by default."""

    @property
    def multi_turn(self) -> bool:
        """Rollouts are episodes in ``episode.environment``."""
        return bool(self.episode.environment)


@dataclass(frozen=True)
class JobObjects:
    """Python objects standing in for the job's import strings, in one process only.

    The embedding API (``echo2.Pipeline(actors, task=..., reward=..., environment=...)``)
    hands them to every actor of the process, which uses them instead of importing
    ``JobConfig.task`` / ``JobConfig.reward`` / ``JobConfig.episode.environment``. A
    launched run cannot carry them: each process it starts imports the task by name, so
    there the import strings stay. Typed loosely here (this module sits below
    ``echo2.tasks`` and ``echo2.envs``); ``echo2.tasks.base.load_job_task`` and
    ``echo2.envs.base.environment_object`` check them.
    """

    task: Any = None
    """An ``echo2.tasks.base.Task`` (its ``correct`` is the held-out predicate), or None."""
    reward: Callable[[Any, str], float] | None = None
    """A reward ``(prompt, completion) -> float`` replacing the task's own, or None."""
    environment: Any = None
    """An ``echo2.envs.base.EnvironmentSpec`` of the environment given as an object, which
    replaces the one ``job.episode.environment`` would name, or None."""
