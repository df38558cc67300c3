"""WeightBroadcaster + WeightReceivers in one process: relay, repair, late joiners, faults."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator

import numpy as np
import pytest
from tests.polling import until
from tests.ports import port_bases

from echo2.messages import Snapshot, WeightChunk
from echo2.transport import Transport
from echo2.weights import (
    NO_LINK,
    WeightBroadcaster,
    WeightReceiver,
    relay_plan,
)
from echo2.weights.chunks import (
    SnapshotAssembler,
    digest,
    flatten_tensors,
    make_manifest,
)
from echo2.weights.link import LinkSpec

CHUNK = 64 * 1024


def snapshot(version: int, nbytes: int = 40 * CHUNK + 123, incarnation: int = 1) -> Snapshot:
    rng = np.random.default_rng(version)
    specs, flat = flatten_tensors(
        {
            "w": rng.integers(0, 255, nbytes - 3, dtype=np.uint8),
            "b": np.arange(3, dtype=np.uint8),
        }
    )
    return Snapshot(
        incarnation=incarnation,
        version=version,
        tensors=specs,
        data=flat,
        created_at_s=0.0,
    )


class Harness:
    def __init__(
        self,
        transport: Transport,
        broadcaster: WeightBroadcaster,
        url: str,
        group: asyncio.TaskGroup,
        data_plane: str = "zmq",
        shm_dir: str | None = None,
    ):
        self.data_plane = data_plane
        self.shm_dir = shm_dir
        self.transport = transport
        self.broadcaster = broadcaster
        self.url = url
        self.group = group
        self.receivers: dict[str, WeightReceiver] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.complete: dict[str, list[SnapshotAssembler]] = {}
        self.completed = asyncio.Event()
        """Set each time a receiver completes a version (cleared by its waiters)."""

    def add(
        self,
        name: str,
        link: LinkSpec = NO_LINK,
        gap_timeout_s: float = 0.3,
        verify_manifest=None,  # type: ignore[no-untyped-def]
        shm: bool = True,
        dial: str = "",
        finish_within: int = 0,
    ) -> WeightReceiver:
        control = self.transport.dealer(name=f"{name}.weights", connect=[self.url], identity=name.encode())
        self.complete[name] = []

        def done(assembler: SnapshotAssembler) -> None:
            self.complete[name].append(assembler)
            self.completed.set()
            asyncio.get_running_loop().create_task(receiver.report_installed(assembler.key, 0.0))

        receiver = WeightReceiver(
            self.transport,
            control,
            name=name,
            link=link,
            gap_timeout_s=gap_timeout_s,
            announce_s=0.1,
            send_timeout_s=1.0,
            chunk_bytes_hint=CHUNK,
            on_complete=done,
            verify_manifest=verify_manifest,
            data_plane=self.data_plane,
            shm_dir=self.shm_dir if shm else None,
            dial=dial,
            finish_within=finish_within,
        )
        receiver.open()
        self.receivers[name] = receiver
        self.tasks[name] = self.group.create_task(receiver.run())
        return receiver

    def kill(self, name: str) -> None:
        self.tasks[name].cancel()
        self.receivers[name].close()

    async def wait_complete(self, names: list[str], version: int, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while True:
                self.completed.clear()
                if all(any(a.key[1] == version for a in self.complete[n]) for n in names):
                    return
                await self.completed.wait()


@contextlib.asynccontextmanager
async def harness(
    mode: str = "relay",
    stripes: int = 2,
    link: LinkSpec = NO_LINK,
    fault=None,
    medium: str = "inproc",
    shm_dir: str | None = None,
    delta_anchor_every: int = 0,
    dial_in: str = "",
) -> AsyncIterator[Harness]:
    """``medium``: "inproc" (ZeroMQ PULL inboxes), "tcp" (chunk-stream inboxes, the default
    over tcp) or "tcp-zmq" (ZeroMQ PULL inboxes over tcp). ``shm_dir``: shared memory for
    members added with ``shm=True`` (None: every member gets chunks)."""
    transport = Transport()
    bind = "inproc://test-weights" if medium == "inproc" else "tcp://127.0.0.1:0"
    router = transport.router(name="pub.weights", bind=[bind])
    broadcaster = WeightBroadcaster(
        transport,
        router,
        mode=mode,
        stripes=stripes,
        chunk_bytes=CHUNK,
        link=link,
        member_ttl_s=1.0,
        send_timeout_s=1.0,
        fault=fault,
        shm_dir=shm_dir,
        delta_anchor_every=delta_anchor_every,
        dial_in=dial_in,
    )
    try:
        async with asyncio.TaskGroup() as group:
            main = group.create_task(broadcaster.run())
            data_plane = "stream" if medium == "tcp" else "zmq"
            h = Harness(transport, broadcaster, router.endpoints[0], group, data_plane, shm_dir)
            try:
                yield h
            finally:
                main.cancel()
                for task in h.tasks.values():
                    task.cancel()
    finally:
        broadcaster.close()
        for receiver in h.receivers.values():
            receiver.close()
        transport.close()


def equal_to(assembler: SnapshotAssembler, snap: Snapshot) -> bool:
    return digest(assembler.buffer) == digest(snap.data) and assembler.complete


def test_relay_plans_cover_every_member_with_every_stripe() -> None:
    names = [f"s{i}" for i in range(5)]
    assert relay_plan(names, "star") == (1, [c for c in relay_plan(names, "star")[1]])
    stripes, chains = relay_plan(names, "striped", 3)
    assert stripes == 3 and len(chains) == 3
    assert all(sorted(c.members) == names for c in chains)
    assert len({c.members[0] for c in chains}) == 3  # distinct seeds
    assert relay_plan(names, "relay")[1][0].members == names
    assert relay_plan([], "relay") == (1, [])


MEDIA = ["inproc", "tcp"]


@pytest.mark.parametrize("medium", [*MEDIA, "tcp-zmq"])
@pytest.mark.parametrize(("mode", "n"), [("relay", 3), ("striped", 4), ("star", 2)])
async def test_every_mode_delivers_digest_equal_versions(mode: str, n: int, medium: str) -> None:
    async with harness(mode=mode, medium=medium) as h:
        names = [f"s{i}" for i in range(n)]
        for name in names:
            h.add(name)
        await h.broadcaster.wait_members(n)
        snap = snapshot(1)
        h.broadcaster.publish_nowait(snap)
        await h.wait_complete(names, 1)
        for name in names:
            assert equal_to(h.complete[name][-1], snap)
        async with asyncio.timeout(5):
            t = await h.broadcaster.wait_bcast((1, 1))
        assert t > 0
        stats = {name: h.receivers[name].statistics() for name in names}
        if mode != "star":
            assert sum(s["chunks_forwarded"] for s in stats.values()) > 0
            assert h.broadcaster.counters["chunks_sent"] == len(make_manifest(snap, CHUNK).chunk_digests)
        assert all(s["repair_requests"] == 0 for s in stats.values()), stats
        if medium == "tcp":
            assert all(h.receivers[name].relay_address.startswith("chunkstream://") for name in names)
            # Streamed chunks land in their place in the assembly buffer (no copy); only
            # one that outruns its manifest is read into a buffer of its own.
            in_place = sum(s["stream_chunks_in_place"] for s in stats.values())
            copied = sum(s["stream_chunks_copied"] for s in stats.values())
            assert in_place + copied == sum(s["chunks_received"] for s in stats.values())
            assert in_place > copied


@pytest.mark.parametrize("medium", MEDIA)
async def test_dropped_and_corrupted_chunks_are_repaired_and_counted(medium: str) -> None:
    rng = random.Random(7)
    corrupted: list[int] = []

    def fault(seed: str, chunk: WeightChunk) -> WeightChunk | None:
        if not corrupted and chunk.index == 5:
            corrupted.append(chunk.index)
            bad = np.array(chunk.data)
            bad[0] ^= 0xFF
            return WeightChunk(
                incarnation=chunk.incarnation,
                version=chunk.version,
                index=chunk.index,
                data=bad,
            )
        return None if rng.random() < 0.10 else chunk

    async with harness(mode="relay", fault=fault, medium=medium) as h:
        names = ["a", "b", "c"]
        for name in names:
            h.add(name, gap_timeout_s=0.2)
        await h.broadcaster.wait_members(3)
        for version in (1, 2):
            corrupted.clear()
            snap = snapshot(version)
            h.broadcaster.publish_nowait(snap)
            await h.wait_complete(names, version)
            for name in names:
                assert equal_to(h.complete[name][-1], snap)
        stats = [h.receivers[n].statistics() for n in names]
        assert sum(s["corrupt_chunks"] for s in stats) == 2  # one per version, counted
        assert sum(s["repair_requests"] for s in stats) >= 2
        assert h.broadcaster.counters["repair_chunks_sent"] > 0


async def test_a_peer_holding_a_chunk_place_cannot_stall_the_version() -> None:
    """A peer that opens a chunk stream, sends a header and goes quiet holds that chunk's
    place in the buffer; the stalled version drops it, and the repair lands."""
    import socket

    from echo2.weights.stream import HEADER, MAGIC, parse_address

    def fault(seed: str, chunk: WeightChunk) -> WeightChunk | None:
        return None if chunk.index == 0 else chunk  # chunk 0 only comes by repair

    async with harness(mode="relay", fault=fault, medium="tcp") as h:
        receiver = h.add("a", gap_timeout_s=0.3)
        await h.broadcaster.wait_members(1)
        host, port = parse_address(receiver.relay_address)
        rogue = socket.create_connection((host, port))
        try:
            snap = snapshot(1)
            manifest = make_manifest(snap, CHUNK)
            h.broadcaster.publish_nowait(snap, manifest)
            async with asyncio.timeout(5):
                while receiver.assembling != (1, 1):  # the manifest is in: places exist
                    await asyncio.sleep(0.005)
            rogue.sendall(HEADER.pack(MAGIC, 1, 1, 1, 0, CHUNK))  # claims chunk 0, sends nothing
            await h.wait_complete(["a"], 1, timeout_s=10)
        finally:
            rogue.close()
        assert equal_to(h.complete["a"][-1], snap)
        assert receiver.counters["stalled_streams_dropped"] >= 1


async def test_forged_or_older_manifests_are_rejected() -> None:
    async with harness() as h:
        receiver = h.add("a")
        await h.broadcaster.wait_members(1)
        h.broadcaster.publish_nowait(snapshot(3))
        await h.wait_complete(["a"], 3)
        forged = make_manifest(snapshot(4))
        forged = type(forged)(
            **{
                **{f: getattr(forged, f) for f in forged.__struct_fields__},
                "digest": b"\0" * 32,
            }
        )
        await receiver._on_manifest(forged)
        assert receiver.counters["manifests_rejected"] == 1
        assert receiver.assembling is None
        await receiver._on_manifest(make_manifest(snapshot(2)))
        assert receiver.counters["manifests_stale"] == 1
        assert receiver.assembling is None and receiver.complete_key == (1, 3)


@pytest.mark.parametrize("medium", MEDIA)
async def test_late_joiner_installs_latest_without_a_new_publication(medium: str) -> None:
    async with harness(medium=medium) as h:
        h.add("a")
        await h.broadcaster.wait_members(1)
        snap = snapshot(5)
        h.broadcaster.publish_nowait(snap)
        await h.wait_complete(["a"], 5)
        published = h.broadcaster.counters["published"]
        h.add("late")
        await h.wait_complete(["late"], 5, timeout_s=5)
        assert equal_to(h.complete["late"][-1], snap)
        assert h.broadcaster.counters["published"] == published
        assert h.broadcaster.counters["late_joiner_manifests"] >= 1


@pytest.mark.parametrize("medium", MEDIA)
async def test_successors_of_a_relay_killed_mid_transfer_complete(medium: str) -> None:
    # 8 Mbit/s uplinks: ~2.6 MB takes ~2.6 s per hop, so the kill lands mid-transfer.
    slow = LinkSpec(uplink_mbps=8.0)
    async with harness(mode="relay", link=LinkSpec(uplink_mbps=32.0), medium=medium) as h:
        names = ["a", "b", "c", "d"]
        for name in names:
            h.add(name, link=slow, gap_timeout_s=0.3)
        await h.broadcaster.wait_members(4)
        snap = snapshot(1)
        h.broadcaster.publish_nowait(snap)
        async with asyncio.timeout(5):
            while h.receivers["b"].counters["chunks_received"] < 3:
                await asyncio.sleep(0.01)
        assert not h.complete["b"]
        h.kill("b")
        await h.wait_complete(["a", "c", "d"], 1, timeout_s=60)  # a hang guard, not a speed claim
        for name in ("a", "c", "d"):
            assert equal_to(h.complete[name][-1], snap)
        assert h.receivers["c"].counters["repair_requests"] >= 1


@pytest.mark.parametrize("medium", MEDIA)
async def test_a_newer_version_supersedes_one_still_streaming(medium: str) -> None:
    async with harness(mode="relay", link=LinkSpec(uplink_mbps=20.0), medium=medium) as h:
        h.add("a")
        h.add("b")
        await h.broadcaster.wait_members(2)
        h.broadcaster.publish_nowait(snapshot(1))
        # Version 1 is on the wire (the 20 Mbit/s uplink takes ~1 s for its 2.6 MB): supersede it.
        async with asyncio.timeout(10):
            while h.receivers["a"].counters["chunks_received"] == 0:
                await asyncio.sleep(0.005)
        assert not h.complete["a"] and not h.complete["b"]
        snap = snapshot(2)
        h.broadcaster.publish_nowait(snap)
        await h.wait_complete(["a", "b"], 2, timeout_s=10)
        assert all(equal_to(h.complete[n][-1], snap) for n in ("a", "b"))
        assert h.broadcaster.counters["superseded"] == 1


async def test_members_on_the_publishers_host_map_versions_from_shared_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with harness(mode="relay", medium="tcp", shm_dir=str(tmp_path)) as h:
        h.add("local1")
        h.add("local2")
        h.add("remote", shm=False)
        await h.broadcaster.wait_members(3)
        for version in (1, 2):
            snap = snapshot(version)
            h.broadcaster.publish_nowait(snap)
            await h.wait_complete(["local1", "local2", "remote"], version)
            for name in ("local1", "local2", "remote"):
                assert equal_to(h.complete[name][-1], snap)
        n_chunks = len(make_manifest(snap, CHUNK).chunk_digests)
        for name in ("local1", "local2"):
            stats = h.receivers[name].statistics()
            assert stats["shm_versions"] == 2 and stats["chunks_received"] == 2 * n_chunks
            assert stats.get("stream_chunks_in_place", 0) == 0 and stats["repair_requests"] == 0
        remote = h.receivers["remote"].statistics()
        assert remote["stream_chunks_in_place"] + remote["stream_chunks_copied"] == 2 * n_chunks
        assert h.broadcaster.counters["shm_versions_written"] == 2
        assert h.broadcaster.counters["chunks_sent"] == 2 * n_chunks  # to the remote member only
        assert len(list(tmp_path.iterdir())) == 1  # the older version's file is gone
        h.add("late")  # a late joiner on the host maps the latest at once
        await h.wait_complete(["late"], 2)
        assert equal_to(h.complete["late"][-1], snap)
        assert h.receivers["late"].counters["shm_versions"] == 1
    assert list(tmp_path.iterdir()) == []  # closing the publisher removes its files


async def test_a_corrupt_or_missing_shared_memory_version_is_repaired(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from echo2.weights import broadcaster, shm
    from echo2.weights import receiver as receiver_module

    def write_then_flip(directory: str, name: str, data: np.ndarray) -> str:
        path = shm.write_snapshot(directory, name, data)
        with open(path, "r+b") as f:  # one flipped byte in chunk 3
            f.seek(3 * CHUNK + 10)
            byte = f.read(1)
            f.seek(3 * CHUNK + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        return path

    monkeypatch.setattr(broadcaster, "write_snapshot", write_then_flip)
    async with harness(mode="relay", shm_dir=str(tmp_path)) as h:
        receiver = h.add("a", gap_timeout_s=0.2)
        await h.broadcaster.wait_members(1)
        snap = snapshot(1)
        h.broadcaster.publish_nowait(snap)
        await h.wait_complete(["a"], 1)
        assert equal_to(h.complete["a"][-1], snap)
        assert receiver.counters["corrupt_chunks"] == 1 and receiver.counters["repair_requests"] >= 1

        def gone(path: str, nbytes: int) -> np.ndarray:
            raise FileNotFoundError(path)

        monkeypatch.setattr(receiver_module, "map_snapshot", gone)
        snap = snapshot(2)
        h.broadcaster.publish_nowait(snap)
        await h.wait_complete(["a"], 2)
        assert equal_to(h.complete["a"][-1], snap)
        assert receiver.counters["shm_failures"] == 1


def test_t_bcast_is_recorded_for_superseded_versions_and_for_those_that_never_reach_it() -> None:
    """Issue 13: when broadcast is the bottleneck, most versions are superseded before
    enough members install them; each still gets one ``broadcast`` record: its T_bcast when
    late installs reach the threshold, else (once it leaves the tracked window) what it got."""
    from echo2.messages import WeightsInstalled
    from echo2.weights.broadcaster import TRACKED_VERSIONS, _Version

    records: list[dict] = []  # type: ignore[type-arg]
    transport = Transport()
    router = transport.router(name="pub.weights", bind=["inproc://test-t-bcast"])
    try:
        broadcaster = WeightBroadcaster(transport, router, chunk_bytes=CHUNK, gamma=1.0, on_bcast=records.append)

        def publish(version: int) -> None:  # what _stream does before it sends anything
            v = _Version(snapshot(version, nbytes=CHUNK), make_manifest(snapshot(version, nbytes=CHUNK), CHUNK))
            v.bcast.active, v.bcast.published_s = frozenset({"a", "b"}), 0.0
            broadcaster._latest = v
            broadcaster._track(v.bcast)

        def installed(name: str, version: int) -> None:
            broadcaster._on_installed(
                WeightsInstalled(sampler_id=name, incarnation=1, version=version, install_s=0.0, time_s=0.0)
            )

        publish(1)
        publish(2)  # v1 superseded with no install yet
        installed("a", 1)
        installed("b", 1)  # a slow member finished the version it was on
        assert [(r["version"], r["superseded"], r["installed"]) for r in records] == [(1, True, 2)]
        assert records[0]["t_bcast_s"] > 0 and broadcaster.t_bcast[(1, 1)] == records[0]["t_bcast_s"]
        installed("a", 2)  # half of v2's members: below gamma = 1's threshold
        for version in range(3, 3 + TRACKED_VERSIONS):
            publish(version)
        late = [r for r in records if r["version"] == 2]
        assert late == [{**late[0], "t_bcast_s": None, "installed": 1, "active": 2, "superseded": True}]
        installed("b", 2)  # no longer tracked: nothing more is recorded for it
        assert len([r for r in records if r["version"] == 2]) == 1
    finally:
        router.close()
        transport.close()


@pytest.mark.parametrize("stale", [False, True], ids=["this-version", "older-version"])
async def test_a_chunk_trickling_in_slower_than_the_gap_timeout_is_not_repaired(stale: bool) -> None:
    """Progress is counted in bytes of the version being assembled: a stream that delivers
    a chunk over more than a gap timeout (a loss-bound path), within the straggler deadline,
    is neither dropped nor raced by a repair, and the version completes from it. Bytes of an older version (a slow
    predecessor still draining) are no progress: the missing chunk is repaired meanwhile."""
    import socket

    from echo2.weights.stream import HEADER, MAGIC, parse_address

    def fault(seed: str, chunk: WeightChunk) -> WeightChunk | None:
        return None if chunk.index == 0 else chunk  # chunk 0 comes only by the slow stream

    gap_s = 0.3
    async with harness(mode="relay", fault=fault, medium="tcp") as h:
        receiver = h.add("a", gap_timeout_s=gap_s)
        await h.broadcaster.wait_members(1)
        host, port = parse_address(receiver.relay_address)
        slow = socket.create_connection((host, port))
        try:
            snap = snapshot(1)
            h.broadcaster.publish_nowait(snap, make_manifest(snap, CHUNK))
            async with asyncio.timeout(5):
                while receiver.assembling != (1, 1):  # the manifest is in: places exist
                    await asyncio.sleep(0.005)
            body = memoryview(snap.data[:CHUNK].tobytes())
            slow.sendall(HEADER.pack(MAGIC, 1, 1, 0 if stale else 1, 0, CHUNK))
            pieces = 16
            try:
                for at in range(0, CHUNK, CHUNK // pieces):  # 1.5 gap timeouts for the whole chunk
                    slow.sendall(body[at : at + CHUNK // pieces])
                    await asyncio.sleep(1.5 * gap_s / pieces)  # the slow path, not a synchronisation
            except (BrokenPipeError, ConnectionResetError):
                assert stale  # a stalled version drops streams stuck mid-chunk: only this one
            await h.wait_complete(["a"], 1, timeout_s=10)
        finally:
            slow.close()
        assert equal_to(h.complete["a"][-1], snap)
        stats = receiver.statistics()
        if stale:
            assert stats["repair_requests"] >= 1 and stats["repair_missing_bytes"] == CHUNK
        else:
            assert receiver.counters["stalled_streams_dropped"] == 0
            assert stats["repair_requests"] == 0 and stats["repair_missing_bytes"] == 0


async def test_repair_bytes_stay_within_the_bytes_missing() -> None:
    """Every chunk the publisher's stream drops is repaired about once (the issue 13 floor:
    repair bytes received <= 1.2x the bytes missing when requested)."""
    rng = random.Random(3)

    def fault(seed: str, chunk: WeightChunk) -> WeightChunk | None:
        return None if rng.random() < 0.25 else chunk

    async with harness(mode="star", fault=fault, medium="tcp") as h:
        receiver = h.add("a", gap_timeout_s=0.2)
        await h.broadcaster.wait_members(1)
        snap = snapshot(1)
        h.broadcaster.publish_nowait(snap)
        await h.wait_complete(["a"], 1)
        assert equal_to(h.complete["a"][-1], snap)
        stats = receiver.statistics()
        assert stats["repair_missing_bytes"] > 0
        missing = stats["repair_missing_bytes"]
        assert missing <= stats["requested_bytes_received"] <= 1.2 * missing
        assert h.broadcaster.counters["repair_bytes_sent"] <= 1.2 * missing
        assert stats["repair_bytes_requested"] >= stats["repair_missing_bytes"]


async def test_a_member_that_accepts_no_connection_dials_and_gets_every_version() -> None:
    """Behind NAT: no inbox; it dials the publisher's listener, which sends its chunks (and
    repairs) down those connections, and the others still relay among themselves."""
    (base,) = port_bases(1, span=1)
    dial_in = f"tcp://127.0.0.1:{base}"
    async with harness(mode="relay", medium="tcp", dial_in=dial_in) as h:
        h.add("open-a")
        natted = h.add("natted", dial=dial_in)
        h.add("open-b")
        assert natted.relay_address == "dial://natted" and natted._stream_socket is None  # nothing listens
        await h.broadcaster.wait_members(3)
        for version in (1, 2):
            snap = snapshot(version)
            h.broadcaster.publish_nowait(snap)
            await h.wait_complete(["open-a", "natted", "open-b"], version)
            assert equal_to(h.complete["natted"][-1], snap)
        assert h.broadcaster.dial_listener.counters["dialed"] >= 1
        assert h.broadcaster.streams_to("natted") >= 1
        # The publisher wants more streams to it than it dialed: it asks, the member dials them.
        h.broadcaster._counts["dial://natted"].n = 3
        h.broadcaster.publish_nowait(snapshot(3))
        await h.wait_complete(["natted"], 3)
        assert natted._dialer is not None
        await until(lambda: natted._dialer is not None and natted._dialer.connections >= 3, what="3 dialed streams")
        trees = h.broadcaster.relay_trees
        assert [t.members for t in trees if "natted" in t.members] == [["natted"]]  # fed directly
        assert natted.statistics()["stream_bytes_received"] > 0


async def test_a_dialer_not_a_member_is_refused() -> None:
    from echo2.weights.dial import DialListener, admits, answer_frame

    dialed: list[str] = []

    def on_dialed(name: str, sock: socket.socket) -> None:
        dialed.append(name)
        sock.close()

    listener = DialListener(admits(lambda: [b""], lambda: {"member"}, "pub"), on_dialed)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as group:
        serving = group.create_task(listener.serve(server, group))
        for name in ("stranger", "member"):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setblocking(False)
            challenge = await loop.sock_recv(sock, 40)
            await loop.sock_sendall(sock, answer_frame(name, "pub", challenge[8:], b""))
            await until(
                lambda: (
                    listener.counters["dialed"] + listener.counters["refused"] == len(dialed) + 1
                    or dialed == ["member"]
                )
            )
            sock.close()
        serving.cancel()
    assert dialed == ["member"] and listener.counters["refused"] == 1


async def test_a_member_holding_half_a_version_finishes_it_before_the_next() -> None:
    """Each newer version used to cancel the older: a slow member then installed nothing.
    Within the staleness budget, a member with half of a version finishes it (the rest
    repaired from the publisher, which keeps it), then takes the newer one."""
    async with harness(mode="star", link=LinkSpec(uplink_mbps=16.0), medium="tcp") as h:
        h.add("finisher", finish_within=3)
        h.add("eager")  # finish_within=0: the newer version always takes over
        await h.broadcaster.wait_members(2)
        older, newer = snapshot(1, 24 * CHUNK), snapshot(3, 24 * CHUNK)
        h.broadcaster.publish_nowait(older)
        chunks = len(make_manifest(older, CHUNK).chunk_digests)
        await until(lambda: h.receivers["finisher"].counters["chunks_received"] > chunks // 2, what="half of v1")
        h.broadcaster.publish_nowait(newer)
        await h.wait_complete(["finisher", "eager"], 3, timeout_s=20)
        assert [a.key[1] for a in h.complete["finisher"]] == [1, 3]
        assert equal_to(h.complete["finisher"][0], older) and equal_to(h.complete["finisher"][1], newer)
        assert [a.key[1] for a in h.complete["eager"]] == [3]
        assert h.receivers["finisher"].counters["versions_finished"] == 1


async def test_a_last_chunk_straggling_on_its_stream_is_repaired_on_another() -> None:
    """One stream of many backing off after losses trickles the version's last chunk: after
    the straggler deadline that stream is dropped and the chunk repaired, well before the
    trickle would have ended."""
    from echo2.weights.stream import HEADER, MAGIC, parse_address

    def fault(seed: str, chunk: WeightChunk) -> WeightChunk | None:
        return None if chunk.index == 0 else chunk  # chunk 0 comes only by the straggler

    gap_s = 0.3
    async with harness(mode="relay", fault=fault, medium="tcp") as h:
        receiver = h.add("a", gap_timeout_s=gap_s)
        await h.broadcaster.wait_members(1)
        host, port = parse_address(receiver.relay_address)
        straggler = socket.create_connection((host, port))
        try:
            snap = snapshot(1)
            h.broadcaster.publish_nowait(snap, make_manifest(snap, CHUNK))
            await until(lambda: receiver.assembling == (1, 1), what="the manifest")
            straggler.sendall(HEADER.pack(MAGIC, 1, 1, 1, 0, CHUNK))
            loop = asyncio.get_running_loop()
            started = loop.time()
            for at in range(CHUNK):  # a byte every 20 ms: never quiet, done after ~20 minutes
                if h.complete["a"]:
                    break
                try:
                    straggler.sendall(snap.data[at : at + 1].tobytes())
                except (BrokenPipeError, ConnectionResetError):
                    break  # dropped by the receiver
                await asyncio.sleep(0.02)  # the straggling path, not a synchronisation
            await h.wait_complete(["a"], 1, timeout_s=10)
            assert loop.time() - started < 10 * receiver.straggler_deadline_s()
        finally:
            straggler.close()
        assert equal_to(h.complete["a"][-1], snap)
        assert receiver.counters["stalled_streams_dropped"] >= 1 and receiver.counters["repair_requests"] >= 1
        assert receiver.statistics()["repair_missing_bytes"] == CHUNK
