"""Recorded ports: an endpoint's traffic, both ways, as codec frames in a bounded file.

What a replay relies on: every message received and sent is in the file in order, with
its direction, as the exact frames (large arrays included) that decode to the same typed
message; the file stops at its cap with a log line instead of growing; a record cut by a
killed writer is dropped and the ones before it are kept.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from echo2.errors import DecodeError
from echo2.launch.replay import compare_metrics, deliveries
from echo2.messages import PROTOCOL_VERSION, BatchRequest, Snapshot, TensorSpec
from echo2.transport import Codec, Transport
from echo2.transport.recording import Recorder, Recording, recording_header


def _snapshot(version: int) -> Snapshot:
    data = np.arange(100_000, dtype=np.uint8)  # over the inline limit: a frame of its own
    spec = TensorSpec(name="w", dtype="uint8", shape=(100_000,), offset=0, nbytes=100_000)
    return Snapshot(incarnation=0, version=version, tensors=[spec], data=data, created_at_s=1.0)


async def test_a_recorded_dealer_keeps_both_directions_as_frames_that_decode(
    transport: Transport, tmp_path: Path
) -> None:
    path = tmp_path / "recordings" / "learner.batch.rec"
    async with transport.router(name="buffer.batch", bind=["inproc://rec-batch"]) as router:
        async with transport.dealer(name="learner.batch", connect=["inproc://rec-batch"]) as dealer:
            dealer.record_to(path, actor="learner", port="batch", socket="dealer", max_bytes=10**7)
            for i in range(3):
                await dealer.send(BatchRequest(request_id=i, incarnation=0, version=i, num_groups=2))
                peer, request = await router.recv()
                assert isinstance(request, BatchRequest)
                await router.send(peer, _snapshot(i))
                reply = await dealer.recv()
                assert isinstance(reply, Snapshot)
    recording = Recording.read(path)
    assert recording.header.protocol_version == PROTOCOL_VERSION
    assert (recording.header.actor, recording.header.port, recording.header.socket) == ("learner", "batch", "dealer")
    assert {"BatchRequest", "Batch", "Snapshot"} <= set(recording.header.message_types)
    assert not recording.cut_tail
    assert [m.direction for m in recording.messages] == ["sent", "received"] * 3
    codec = Codec()
    decoded = [codec.decode(m.frames) for m in recording.messages]
    assert decoded[0::2] == [BatchRequest(request_id=i, incarnation=0, version=i, num_groups=2) for i in range(3)]
    replies = decoded[1::2]
    assert all(isinstance(r, Snapshot) for r in replies)
    assert [len(m.frames) for m in recording.messages[1::2]] == [2, 2, 2]  # header + array frame
    assert all(np.array_equal(r.data, _snapshot(0).data) for r in replies if isinstance(r, Snapshot))
    # A replay's pairing: each reply is due once the actor has sent the request before it.
    todo, sent = deliveries(recording.messages)
    assert [d.sent_before for d in todo] == [1, 2, 3] and sent == 3


async def test_a_recording_stops_at_its_cap_with_a_log_line(
    transport: Transport, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "source.out.rec"
    cap = 2_000
    async with transport.pull(name="sink", bind=["inproc://rec-cap"]) as pull:
        async with transport.push(name="source.out", connect=["inproc://rec-cap"]) as push:
            push.record_to(path, actor="source", port="out", socket="push", max_bytes=cap)
            with caplog.at_level(logging.WARNING, logger="echo2.transport.recording"):
                for i in range(100):
                    await push.send(BatchRequest(request_id=i, incarnation=0, version=0, num_groups=1))
            received = 0
            while received < 100:
                received += len(await pull.recv_many())
    assert path.stat().st_size <= cap
    recording = Recording.read(path)
    assert 0 < len(recording.messages) < 100
    codec = Codec(BatchRequest)
    assert [codec.decode(m.frames).request_id for m in recording.messages] == list(range(len(recording.messages)))
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # one line, not one per message
    assert "recording stopped at its cap" in caplog.records[0].message


def test_a_record_cut_mid_write_is_dropped_and_the_ones_before_kept(tmp_path: Path) -> None:
    path = tmp_path / "a.p.rec"
    recorder = Recorder(path, recording_header("a", "p", "pull", 0, BatchRequest))
    codec = Codec(BatchRequest)
    for i in range(3):
        recorder.received(codec.encode(BatchRequest(request_id=i, incarnation=0, version=0, num_groups=1)))
    recorder.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # a SIGKILL in the middle of the last record
    recording = Recording.read(path)
    assert recording.cut_tail
    assert [codec.decode(m.frames).request_id for m in recording.messages] == [0, 1]
    path.write_bytes(b"not a recording at all")
    with pytest.raises(DecodeError, match="not an echo2 recording"):
        Recording.read(path)


def test_metrics_compare_with_equality_and_leave_timings_out() -> None:
    recorded = [{"kind": "step", "step": 1, "loss": 0.1 + 0.2, "train_s": 1.0, "time_s": 3.0}]
    same = [{"kind": "step", "step": 1, "loss": 0.30000000000000004, "train_s": 9.0, "time_s": 4.0}]
    assert compare_metrics(recorded, same) == (1, [])
    off_by_one_ulp = [{"kind": "step", "step": 1, "loss": 0.3, "train_s": 1.0, "time_s": 3.0}]
    compared, differences = compare_metrics(recorded, off_by_one_ulp)
    assert compared == 1
    assert [(d.field, d.recorded, d.replayed) for d in differences] == [("loss", 0.1 + 0.2, 0.3)]


def test_a_second_incarnation_records_beside_the_first_never_over_it(tmp_path: Path) -> None:
    codec = Codec(BatchRequest)
    paths = []
    for incarnation in range(2):
        recorder = Recorder(tmp_path / "a.p.rec", recording_header("a", "p", "pull", 0, BatchRequest))
        recorder.received(
            codec.encode(BatchRequest(request_id=incarnation, incarnation=incarnation, version=0, num_groups=1))
        )
        recorder.close()
        paths.append(recorder.path)
    assert paths == [tmp_path / "a.p.rec", tmp_path / "a.p.rec.1"]
    assert [codec.decode(Recording.read(p).messages[0].frames).request_id for p in paths] == [0, 1]
