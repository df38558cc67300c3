"""Helpers the built-in actors share: running loops until a stop, loading the job's task."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from echo2.actor import JobConfig
from echo2.tasks.base import Task, load_reward, load_task, with_reward


async def run_until_stopped(stopping: asyncio.Event, *loops: Coroutine[Any, Any, None]) -> None:
    """Run an actor's concurrent loops until ``stopping`` is set, then cancel them.

    One loop raising cancels the others and the error propagates (the actor fails).
    """
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(loop) for loop in loops]
        await stopping.wait()
        for task in tasks:
            task.cancel()


def load_job_task(job: JobConfig) -> Task:
    """The job's task, with its reward replaced when ``job.reward`` names one."""
    task = load_task(job.task, **job.task_kwargs)
    return with_reward(task, load_reward(job.reward) if job.reward else None)
