"""Checks that need the job's task built, run by the launcher before any process starts.

``validate`` (``echo2.topology.schema``) checks what a topology names; this checks what
only building it shows, so that ``--dry-run`` finds it and a run does not crash seconds in:

- the task builds with its ``task_kwargs`` (a dataset file exists, loads, has the mapped
  fields, a non-empty held-out split; user modules it names import);
- every prompt it will issue is encodable by the model's tokenizer (:func:`echo2.tasks.base.prompts_to_check`:
  all of a dataset's rows, a sample of an endless stream). The tokenizer is loaded alone,
  without the model's weights.

Each failure is one ``ConfigError`` naming the field, like the topology's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from echo2.errors import ConfigError, ResolveError
from echo2.job import JobConfig
from echo2.models.tokenizer import CharTokenizer
from echo2.tasks.base import Task, load_job_task, prompts_to_check

if TYPE_CHECKING:
    from echo2.models.policy import HFTokenizer


def check_job(job: JobConfig) -> list[str]:
    """Build the job's task and encode its prompts; the notes to print (checks not made).

    Raises ``ConfigError`` (``job.task_kwargs: ...``, ``job.model: ...``) on the first failure.
    """
    try:
        task = load_job_task(job)
    except ResolveError as exc:  # a reward or predicate the task names does not import
        raise ConfigError(str(exc), path="job.task_kwargs") from None
    except Exception as exc:  # a user's task factory may fail in any way: report it in one line
        raise ConfigError(f"task {job.task!r}: {_one_line(exc)}", path="job.task_kwargs") from None
    return check_prompts_encode(task, job.model)


def check_prompts_encode(task: Task, model: str) -> list[str]:
    """Encode the task's prompts with ``model``'s tokenizer; ConfigError at the first that fails."""
    tokenizer: CharTokenizer | HFTokenizer | None
    if not model:
        tokenizer = CharTokenizer()  # the built-in model's, without importing torch
    else:
        from echo2.models.policy import load_tokenizer

        try:
            tokenizer = load_tokenizer(model)
        except (ValueError, OSError, ImportError) as exc:
            raise ConfigError(f"cannot load the tokenizer: {_one_line(exc)}", path="job.model") from None
    if tokenizer is None:
        return [f"job.model: {model!r} is converted on first use; prompts not checked against its tokenizer"]
    for prompt in prompts_to_check(task):
        try:
            tokenizer.encode_prompt(prompt.text)
        except ValueError as exc:
            raise ConfigError(
                f"prompt {prompt.task_id!r} of task {task.name!r} cannot be encoded for model "
                f"{model or 'built-in tiny'!r}: {_one_line(exc)}",
                path="job.task",
            ) from None
    return []


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
