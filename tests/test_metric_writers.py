"""TensorBoard and Weights & Biases writers of the learner's metrics (issue 19 item 3).

Off by default (``[run] metric_writers``). Each writer is read back with its own tool's
reader and compared with what the learner wrote to ``metrics/learner.jsonl``: TensorBoard's
``EventAccumulator``; W&B in offline mode (no account) through its run file, a LevelDB-style
log of protobuf records (``_wandb_history``). A launched run with both is behind ``-m slow``.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from echo2.actor import Actor, ActorConfig, Port
from echo2.errors import ConfigError
from echo2.observe.writers import (
    RecordFanout,
    TensorBoardWriter,
    WandbWriter,
    check_writers_available,
    scalars,
)
from echo2.rundir import RunDir
from echo2.runtime import ProcessRuntime

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    {"step": 1, "loss": 0.25, "reward_mean": 0.5, "unix_s": 1.7e9, "mismatch_by_sampler": {"s": 0.0}},
    {"step": 2, "loss": -0.125, "reward_mean": 0.75, "eval_pass_at_1": 0.5, "evaluated": True},
    {"step": 3, "loss": 0.0625, "reward_mean": 1.0, "note": "text stays in the JSON lines"},
]


def test_scalars_are_the_numbers_of_a_record_named_by_actor_and_kind() -> None:
    step, numbers = scalars("learner", "step", STEPS[1])
    assert step == 2
    assert numbers == {
        "learner/loss": -0.125,
        "learner/reward_mean": 0.75,
        "learner/eval_pass_at_1": 0.5,
        "learner/evaluated": 1.0,
    }
    assert scalars("learner", "step", STEPS[0])[1].keys() == {"learner/loss", "learner/reward_mean"}
    assert scalars("publisher", "broadcast", {"t_s": 2, "nan": float("nan")}) == (
        None,
        {"publisher/broadcast/t_s": 2.0},
    )


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator_module = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="the tensorboard package"
    )
    accumulator = accumulator_module.EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_writer_events_read_back_as_written(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install 'echo2[tensorboard]'")
    writer = TensorBoardWriter(tmp_path / "tb")
    for record in STEPS:
        writer.write("learner", "step", record)
    writer.close()
    read = _tensorboard_scalars(tmp_path / "tb")
    assert read["learner/loss"] == [(1, 0.25), (2, -0.125), (3, 0.0625)]  # exact in float32
    assert read["learner/eval_pass_at_1"] == [(2, 0.5)]


class _Learnerish(Actor):
    """Records like a learner and completes the run (so its records go to the writers)."""

    kind = "learnerish"
    completes_run = True
    ports: ClassVar[dict[str, Port]] = {}

    async def run(self) -> None:
        for record in STEPS:
            self.ctx.record("step", **record)


class _Bystander(Actor):
    kind = "bystander"
    ports: ClassVar[dict[str, Port]] = {}

    async def run(self) -> None:
        self.ctx.record("step", step=1, loss=99.0)


class _Collect:
    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []
        self.fail = fail
        self.closed = False

    def write(self, actor: str, kind: str, values: Any) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.seen.append((actor, kind, dict(values)))

    def close(self) -> None:
        self.closed = True


async def test_the_runtime_hands_the_learners_records_to_the_writers_and_drops_a_failing_one(tmp_path: Path) -> None:
    good, broken = _Collect(), _Collect(fail=True)
    fanout = RecordFanout([broken, good])
    actors = [_Learnerish("learner", ActorConfig()), _Bystander("other", ActorConfig())]
    runtime = ProcessRuntime(actors, {}, run_dir=tmp_path, metric_writers=fanout, drain_timeout_s=1.0)
    await asyncio.wait_for(runtime.run(), 10)
    assert [values["loss"] for actor, _, values in good.seen] == [0.25, -0.125, 0.0625]
    assert {actor for actor, _, _ in good.seen} == {"learner"}  # the learner's metrics only
    assert good.closed and fanout.writers == []  # closed at exit; the broken one dropped at its first write
    lines = RunDir(tmp_path).metrics("learner")
    assert [line["loss"] for line in lines] == [0.25, -0.125, 0.0625]  # the JSON lines are unaffected


def test_a_writer_whose_package_is_missing_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run\.metric_writers: 'wandb' needs the wandb package"):
        check_writers_available(["wandb"])


# -- W&B, offline ----------------------------------------------------------------------


def _wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The ``history`` records of an offline W&B run file: a 7-byte header (``:W&B``, magic,
    version), then LevelDB log blocks of 32 KiB whose chunks (crc32, length, type: 1 full,
    2 first, 3 middle, 4 last) carry serialized ``wandb_internal_pb2.Record``s."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="the wandb package")
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    position, pending, history = 7, b"", []
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        _, length, kind = struct.unpack_from("<IHB", data, position)
        if kind == 0:  # zeroes past the last record
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return history


@pytest.mark.slow  # W&B starts a service process: ~10 s
def test_wandb_writer_offline_needs_no_account_and_logs_what_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="pip install 'echo2[wandb]'")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = WandbWriter(
        project="echo2-test", run_id="run-1", directory=tmp_path / "wandb", mode="offline", config={"a": 1}
    )
    for record in STEPS:
        writer.write("learner", "step", record)
    writer.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert [(h["_step"], h["learner/loss"]) for h in history] == [(1, 0.25), (2, -0.125), (3, 0.0625)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_launched_run_writes_the_learners_metrics_to_tensorboard_and_wandb(tmp_path: Path) -> None:
    """The main job in one process, 12 steps, both writers on: each holds every step's loss
    and reward as metrics/learner.jsonl does."""
    pytest.importorskip("tensorboard", reason="pip install 'echo2[tensorboard]'")
    pytest.importorskip("wandb", reason="pip install 'echo2[wandb]'")
    sets = [
        'run.metric_writers=["tensorboard", "wandb"]',
        "actors.learner.config.max_steps=12",
        "actors.learner.config.eval_every=6",
        "actors.learner.config.eval_prompts=16",
        "actors.learner.config.checkpoint_every=0",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "echo2.launch", str(ROOT / "examples" / "colocated.toml"), "--run-dir", str(tmp_path)]
        + [arg for value in sets for arg in ("--set", value)],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=ROOT,
        env={**os.environ, "WANDB_SILENT": "true"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    steps = [r for r in RunDir(run_dir).metrics("learner") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    board = _tensorboard_scalars(run_dir / "tensorboard")
    assert [s for s, _ in board["learner/loss"]] == list(range(1, 13))
    for (_, value), record in zip(board["learner/loss"], steps, strict=True):
        assert value == pytest.approx(record["loss"], rel=1e-6, abs=1e-9)  # float32 in the event file
    assert [s for s, _ in board["learner/accuracy"]] == [6, 12]  # held-out pass@1 on evaluation steps
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert [h["learner/loss"] for h in history] == [r["loss"] for r in steps]
    assert [h["_step"] for h in history] == list(range(1, 13))
