"""Optional live writers of the learner's metrics: TensorBoard and Weights & Biases.

Off by default. ``[run] metric_writers = ["tensorboard", "wandb"]`` makes the process that
holds the learner hand every ``ctx.record`` line of the learner (the ``step`` records of
``metrics/learner.jsonl``: loss, reward, clip and IS fractions, staleness, timings and, on
evaluation steps, held-out pass@1 as ``accuracy``, and ``pass_at_k``) to each writer as it
is written:

* ``tensorboard``: event files in ``RUN_DIR/tensorboard/`` (``tensorboard --logdir
  RUN_DIR/tensorboard``); the ``tensorboard`` package (``pip install 'echo2[tensorboard]'``),
  written through ``torch.utils.tensorboard``.
* ``wandb``: a Weights & Biases run named after the run directory, in project
  ``run.wandb_project``, files in ``RUN_DIR/wandb/``; the ``wandb`` package. With
  ``run.wandb_mode = "offline"`` (the default) nothing leaves the machine and no account is
  needed (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later); ``"online"`` streams
  it (``wandb login`` or ``WANDB_API_KEY`` first). A resumed run continues the same W&B run.

Names: a record of kind ``step`` gives ``<actor>/<field>`` (``learner/loss``); another kind
``<actor>/<kind>/<field>``; the x axis is the record's ``step``. Only numbers are written
(booleans as 0/1; not the wall-clock stamps, which each tool keeps itself); text and
tables stay in the JSON lines. A writer that fails (a full
disk, W&B's service gone) logs once and is dropped; the learner goes on, and
``metrics/learner.jsonl`` stays the complete record.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from echo2.errors import ConfigError

log = logging.getLogger("echo2.observe.writers")

MetricWriterKind = Literal["tensorboard", "wandb"]
METRIC_WRITERS: tuple[str, ...] = get_args(MetricWriterKind)
WandbMode = Literal["offline", "online"]
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
_NOT_SCALARS = frozenset({"step", "time_s", "unix_s"})
"""The x axis and wall-clock stamps (each tool keeps its own wall time)."""
_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install 'echo2[tensorboard]'"),
    "wandb": ("wandb", "pip install 'echo2[wandb]'"),
}


class MetricWriter(Protocol):
    """Where a process's learner records also go (see the module docstring)."""

    def write(self, actor: str, kind: str, values: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(actor: str, kind: str, values: Mapping[str, Any]) -> tuple[int | None, dict[str, float]]:
    """A record's step and its numbers under their writer names (the module docstring)."""
    step = values.get("step")
    prefix = actor if kind == "step" else f"{actor}/{kind}"
    numbers: dict[str, float] = {}
    for name, value in values.items():
        if name in _NOT_SCALARS or not isinstance(value, int | float):
            continue
        number = float(value)
        if math.isfinite(number):
            numbers[f"{prefix}/{name}"] = number
    return (step if isinstance(step, int) and not isinstance(step, bool) else None), numbers


def check_writers_available(kinds: Sequence[str]) -> None:
    """``ConfigError`` at ``run.metric_writers`` when a writer's package is missing here."""
    for kind in kinds:
        module, install = _PACKAGES[kind]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"{kind!r} needs the {module} package on this machine ({install})", path="run.metric_writers"
            )


class TensorBoardWriter:
    """Scalars into TensorBoard event files under ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))
        self._steps = 0

    def write(self, actor: str, kind: str, values: Mapping[str, Any]) -> None:
        step, numbers = scalars(actor, kind, values)
        self._steps += 1
        for name, number in numbers.items():
            self._writer.add_scalar(name, number, global_step=self._steps if step is None else step)
        self._writer.flush()  # watched live: a step shows up as it is trained

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """A Weights & Biases run (offline by default: no account, nothing leaves the machine)."""

    def __init__(
        self, *, project: str, run_id: str, directory: Path, mode: WandbMode, config: Mapping[str, Any]
    ) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=run_id,
            id=re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64],  # a resume continues this W&B run
            resume="allow",
            dir=str(directory.parent),
            mode=mode,
            config=dict(config),
        )

    def write(self, actor: str, kind: str, values: Mapping[str, Any]) -> None:
        step, numbers = scalars(actor, kind, values)
        if numbers:
            self._run.log(numbers, step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # The W&B service writes the run file on its own; finish() returns before it is
        # flushed. Tearing the service down waits for it (the process is exiting anyway).
        wandb.teardown()


class RecordFanout:
    """Hands each record to every writer; a writer that fails is logged once and dropped."""

    def __init__(self, writers: Sequence[MetricWriter]) -> None:
        self.writers = list(writers)

    def write(self, actor: str, kind: str, values: Mapping[str, Any]) -> None:
        for writer in list(self.writers):
            try:
                writer.write(actor, kind, values)
            except Exception as exc:  # a writer is an extra view: it must not stop training
                log.warning(
                    "metric writer %s failed and is dropped: %s: %s", type(writer).__name__, type(exc).__name__, exc
                )
                self.writers.remove(writer)

    def close(self) -> None:
        for writer in self.writers:
            try:
                writer.close()
            except Exception as exc:  # at exit: the JSON lines hold everything it would have had
                log.warning("metric writer %s did not close: %s: %s", type(writer).__name__, type(exc).__name__, exc)
        self.writers.clear()


def open_writers(
    kinds: Sequence[str],
    *,
    run_dir: Path,
    run_id: str,
    wandb_project: str = "echo2",
    wandb_mode: WandbMode = "offline",
    config: Mapping[str, Any] | None = None,
) -> RecordFanout:
    """The writers ``[run] metric_writers`` names, for the process holding the learner."""
    writers: list[MetricWriter] = []
    for kind in kinds:
        if kind == "tensorboard":
            writers.append(TensorBoardWriter(run_dir / TENSORBOARD_DIR))
        elif kind == "wandb":
            writers.append(
                WandbWriter(
                    project=wandb_project,
                    run_id=run_id,
                    directory=run_dir / WANDB_DIR,
                    mode=wandb_mode,
                    config=config or {},
                )
            )
        else:
            raise ConfigError(
                f"unknown metric writer {kind!r} (known: {', '.join(METRIC_WRITERS)})", path="run.metric_writers"
            )
    return RecordFanout(writers)


__all__ = [
    "METRIC_WRITERS",
    "MetricWriter",
    "MetricWriterKind",
    "RecordFanout",
    "TensorBoardWriter",
    "WandbMode",
    "WandbWriter",
    "check_writers_available",
    "open_writers",
    "scalars",
]
