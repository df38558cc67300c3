"""Run actors in this process without a topology file (notebooks, tests, embedding).

::

    async with Pipeline([CounterSource("a"), CounterSink("sink")]) as pipeline:
        await pipeline.wait()

``task`` and ``reward`` take Python objects (a ``Task``, a ``(prompt, completion) -> float``
function) that every actor of the pipeline uses instead of importing ``JobConfig.task`` /
``JobConfig.reward``: in one process nothing needs an import string. ``environment`` takes
an environment factory (a class, or a function building one ``echo2.envs.Environment`` per
episode) in place of ``JobConfig.episode.environment``: it makes the job multi-turn, each
actor's ``job.episode.environment`` then names it (the other ``[job.episode]`` settings
stay the actors' own). A launched run names them by import string, since each process it
starts imports them itself.

Addresses come from the same derivation as the launcher's, with every actor placed in one
process (so every channel is ``inproc://``). Entering returns once every actor's setup is
done; leaving always stops the actors and closes every socket.

Why a Pipeline owns exactly one task: the actors must run concurrently with the body of
the ``async with`` block, so the runtime cannot simply be awaited inline. The runtime's own
``TaskGroup`` is the parent of every actor task; the Pipeline holds the one task that runs
that runtime, and ``__aexit__`` always awaits it (after a bounded drain, then
cancellation). That task therefore has a parent, the ``async with`` scope, and its outcome
(an ``ActorFailed``) cannot be lost: it is raised by ``wait()`` or, if nobody called
``wait()``, by ``__aexit__``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from echo2.actor import Actor
from echo2.envs.base import Environment, environment_object, with_environment_object
from echo2.errors import ConfigError
from echo2.job import JobObjects
from echo2.runtime import ProcessRuntime
from echo2.tasks.base import RewardFn, Task, require_objects
from echo2.topology import DEFAULT_HOST, HostSpec, Placement, derive_addresses

log = logging.getLogger("echo2.pipeline")

_PROCESS = "pipeline"
_EXIT_GRACE_S = 5.0


class Pipeline:
    """Actors co-located in this process, run by one ``ProcessRuntime``."""

    def __init__(
        self,
        actors: Sequence[Actor],
        *,
        run_dir: str | Path | None = None,
        drain_timeout_s: float = 10.0,
        task: Task | None = None,
        reward: RewardFn | None = None,
        environment: Callable[[], Environment] | None = None,
    ) -> None:
        names = [actor.name for actor in actors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"duplicate actor names: {', '.join(duplicates)}")
        self.actors = list(actors)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.drain_timeout_s = drain_timeout_s
        require_objects(task, reward)
        spec = environment_object(environment) if environment is not None else None
        if spec is not None:
            for actor in self.actors:
                actor.job = with_environment_object(actor.job, spec)
        given = (task, reward, spec)
        self.job_objects = JobObjects(task, reward, spec) if any(o is not None for o in given) else None
        places = [Placement(actor=a.name, process=_PROCESS, host=DEFAULT_HOST, ports=a.ports) for a in self.actors]
        # Pure and validating: a connector without a binder fails here, before any I/O.
        self._addresses = derive_addresses(places, {DEFAULT_HOST: HostSpec()}, run_id=f"pipeline-{id(self):x}")
        self._runtime: ProcessRuntime | None = None
        self._task: asyncio.Task[None] | None = None
        self._outcome_seen = False

    @property
    def runtime(self) -> ProcessRuntime:
        if self._runtime is None:
            raise RuntimeError("the pipeline has not been entered")
        return self._runtime

    async def __aenter__(self) -> Pipeline:
        if self._task is not None:
            raise RuntimeError("a Pipeline can be entered only once")
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._runtime = ProcessRuntime(
            self.actors,
            self._addresses.ports,
            process=_PROCESS,
            run_dir=self.run_dir,
            drain_timeout_s=self.drain_timeout_s,
            telemetry_connect=self._addresses.telemetry.get(_PROCESS, ()),
            job_objects=self.job_objects,
        )
        self._task = asyncio.create_task(self._runtime.run(), name="echo2-pipeline")
        ready = asyncio.ensure_future(self._runtime.wait_ready())
        try:
            await asyncio.wait((self._task, ready), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            ready.cancel()
            await self._finish(cancel=True)
            raise
        if not ready.done():
            ready.cancel()
            await asyncio.wait((ready,))
        if self._task.done():
            # Setup failed (or nothing to run): propagate the cause, nothing is left open.
            self._outcome_seen = True
            self._task.result()
        return self

    async def wait(self) -> None:
        """Wait until the run completes; re-raise ``ActorFailed`` if an actor failed."""
        if self._task is None:
            raise RuntimeError("the pipeline has not been entered")
        try:
            # shield: a caller that stops waiting does not cancel the actors; __aexit__ does.
            await asyncio.shield(self._task)
        finally:
            if self._task.done():
                self._outcome_seen = True

    def request_stop(self) -> None:
        """First call: actors drain and return. Second call: they are cancelled."""
        self.runtime.request_stop("pipeline.request_stop()")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is None:
            return
        outcome = await self._finish(cancel=False)
        if outcome is None or self._outcome_seen:
            return
        self._outcome_seen = True
        if exc_type is None:
            raise outcome
        log.error("pipeline: %s (while leaving on %s)", outcome, exc_type.__name__)

    async def _finish(self, *, cancel: bool) -> BaseException | None:
        """Stop the runtime (drain, bounded; then cancel) and await its task. Idempotent."""
        task, runtime = self._task, self._runtime
        assert task is not None and runtime is not None
        try:
            if not task.done():
                if cancel:
                    runtime.force_stop("pipeline setup interrupted")
                elif not runtime.stopping.is_set():
                    runtime.request_stop("pipeline exit")
                await asyncio.wait((task,), timeout=self.drain_timeout_s + _EXIT_GRACE_S)
            if not task.done():
                log.warning("pipeline: runtime did not stop in time; cancelling it")
                task.cancel()
                await asyncio.wait((task,))
        finally:
            if not task.done():  # we were cancelled while waiting: never leave it running
                task.cancel()
                await asyncio.wait((task,))
        if task.cancelled():
            return None
        return task.exception()


__all__ = ["Pipeline"]
