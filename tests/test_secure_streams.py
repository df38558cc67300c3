"""Chunk streams under [security]: mutual TLS, admission by plan, nothing in the clear."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from echo2.errors import ConfigError, TransportError
from echo2.messages import Snapshot, WeightChunk
from echo2.tools.keys import main as keys_main
from echo2.transport import Transport
from echo2.weights import WeightBroadcaster, WeightReceiver
from echo2.weights.chunks import SnapshotAssembler, digest, flatten_tensors, iter_chunks, make_manifest
from echo2.weights.secure import StreamTLS, load_stream_tls, make_stream_cert
from echo2.weights.stream import ChunkStreamSender, ChunkStreamServer

CHUNK = 64 * 1024


def snapshot(version: int, nbytes: int = 24 * CHUNK + 5) -> Snapshot:
    data = np.random.default_rng(version).integers(0, 255, nbytes, dtype=np.uint8)
    specs, flat = flatten_tensors({"w": data})
    return Snapshot(incarnation=1, version=version, tensors=specs, data=flat, created_at_s=0.0)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run CA with certificates for the publisher, three members and an intruder."""
    directory = tmp_path_factory.mktemp("keys")
    assert keys_main(["--tls", str(directory), "pub", "s0", "s1", "s2", "mallory"]) == 0
    return directory


def tls(keys: Path, name: str) -> StreamTLS:
    return load_stream_tls(keys, name)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


class Run:
    """A publisher and TLS receivers over tcp in this process."""

    def __init__(self, keys: Path, transport: Transport, broadcaster: WeightBroadcaster, url: str, group) -> None:  # type: ignore[no-untyped-def]
        self.keys, self.transport, self.broadcaster, self.url, self.group = keys, transport, broadcaster, url, group
        self.receivers: dict[str, WeightReceiver] = {}
        self.complete: dict[str, list[SnapshotAssembler]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def add(self, name: str) -> WeightReceiver:
        control = self.transport.dealer(name=f"{name}.weights", connect=[self.url], identity=name.encode())
        self.complete[name] = []
        receiver = WeightReceiver(
            self.transport,
            control,
            name=name,
            gap_timeout_s=0.5,
            announce_s=0.1,
            send_timeout_s=1.0,
            chunk_bytes_hint=CHUNK,
            on_complete=self.complete[name].append,
            stream_tls=tls(self.keys, name),
        )
        receiver.open()
        self.receivers[name] = receiver
        self.tasks.append(self.group.create_task(receiver.run()))
        return receiver

    async def wait_version(self, names: list[str], version: int) -> None:
        await until(lambda: all(any(a.key.version == version for a in self.complete[n]) for n in names))


@contextlib.asynccontextmanager
async def secure_run(keys: Path, mode: str = "relay") -> AsyncIterator[Run]:
    transport = Transport()
    router = transport.router(name="pub.weights", bind=["tcp://127.0.0.1:0"])
    broadcaster = WeightBroadcaster(
        transport,
        router,
        name="pub",
        mode=mode,
        stripes=1,
        chunk_bytes=CHUNK,
        member_ttl_s=2.0,
        send_timeout_s=1.0,
        stream_tls=tls(keys, "pub"),
    )
    run: Run | None = None
    try:
        async with asyncio.TaskGroup() as group:
            main = group.create_task(broadcaster.run())
            run = Run(keys, transport, broadcaster, router.endpoints[0], group)
            try:
                yield run
            finally:
                main.cancel()
                for task in run.tasks:
                    task.cancel()
    finally:
        broadcaster.close()
        for receiver in run.receivers.values() if run is not None else ():
            receiver.close()
        transport.close()


async def test_a_tls_relay_delivers_a_version_that_verifies(keys: Path) -> None:
    async with secure_run(keys, mode="relay") as run:
        names = ["s0", "s1", "s2"]
        for name in names:
            run.add(name)
        await run.broadcaster.wait_members(len(names))
        snap = snapshot(1)
        run.broadcaster.publish_nowait(snap)
        await run.wait_version(names, 1)
        stats = {name: run.receivers[name].statistics() for name in names}
    for name in names:
        assembled = run.complete[name][-1]
        assert assembled.complete and digest(assembled.buffer) == digest(snap.data)
    # Bytes came down the chain in TLS (publisher -> head, member -> member), into place.
    assert sum(s["chunks_forwarded"] for s in stats.values()) > 0
    assert sum(s["stream_tls_admitted"] for s in stats.values()) >= len(names)
    assert sum(s["stream_chunks_in_place"] for s in stats.values()) > 0
    assert all(s["stream_refused_identity"] == s["stream_refused_handshake"] == 0 for s in stats.values())


async def test_an_inbox_refuses_a_stranger_and_a_member_outside_the_plan_and_keeps_running(
    keys: Path, tmp_path: Path
) -> None:
    make_stream_cert(tmp_path / "other-ca", "s0-impostor")  # a valid cert, from another CA
    snap = snapshot(2)
    stray = next(iter_chunks(snap, make_manifest(snap, CHUNK)))
    async with secure_run(keys, mode="star") as run:
        receiver = run.add("s0")
        await run.broadcaster.wait_members(1)
        intruders = {
            "stranger": ChunkStreamSender(receiver.relay_address, tls=tls(tmp_path / "other-ca", "s0-impostor").client),
            "mallory": ChunkStreamSender(receiver.relay_address, tls=tls(keys, "mallory").client),
        }
        try:
            for sender in intruders.values():
                # May look sent (the kernel took it) or fail: either way nothing is delivered.
                with contextlib.suppress(TransportError):
                    await sender.send(stray)
            await until(
                lambda: (
                    receiver.statistics()["stream_refused_handshake"] == 1
                    and receiver.statistics()["stream_refused_identity"] == 1
                )
            )
        finally:
            for sender in intruders.values():
                sender.close()
        assert receiver.statistics()["stream_chunks_in_place"] + receiver.statistics()["stream_chunks_copied"] == 0
        run.broadcaster.publish_nowait(snap)  # the inbox still serves its publisher
        await run.wait_version(["s0"], 2)
        stats = receiver.statistics()
    assert digest(run.complete["s0"][-1].buffer) == digest(snap.data)
    assert stats["stream_tls_admitted"] == 1 and stats["repair_requests"] == 0


async def test_a_sender_refuses_an_inbox_that_is_not_the_member_the_plan_names(keys: Path) -> None:
    delivered: list[WeightChunk] = []
    server = ChunkStreamServer(
        delivered.append, lambda key, index, size: None, lambda chunk: None, tls=tls(keys, "s1").server
    )
    async with asyncio.TaskGroup() as group:
        port = await server.start("127.0.0.1", group=group)
        sender = ChunkStreamSender(f"chunkstream://127.0.0.1:{port}", tls=tls(keys, "pub").client, peer="s0")
        try:
            with pytest.raises(TransportError, match="'s1', not 's0'"):
                await sender.send(WeightChunk(incarnation=1, version=1, index=0, data=np.zeros(8, np.uint8)))
        finally:
            sender.close()
            server.close()
    assert delivered == [] and sender.closed


async def _observed(keys: Path, secure: bool, chunks: list[WeightChunk]) -> tuple[bytes, list[WeightChunk]]:
    """Send ``chunks`` through a relay that records every byte; returns (bytes, delivered)."""
    delivered: list[WeightChunk] = []
    server = ChunkStreamServer(
        delivered.append,
        lambda key, index, size: None,
        lambda chunk: None,
        tls=tls(keys, "s0").server if secure else None,
        admit=lambda identity: identity == "pub",
    )
    seen = bytearray()
    pipes: list[asyncio.StreamWriter] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        while data := await reader.read(1 << 16):
            if record:
                seen.extend(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    async with asyncio.TaskGroup() as group:
        port = await server.start("127.0.0.1", group=group)

        async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
            pipes.extend((client_writer, server_writer))
            group.create_task(pipe(client_reader, server_writer, record=True))
            group.create_task(pipe(server_reader, client_writer, record=False))

        proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
        address = f"chunkstream://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
        sender = ChunkStreamSender(address, tls=tls(keys, "pub").client if secure else None, peer="s0")
        try:
            for chunk in chunks:
                await sender.send(chunk)
            await until(lambda: len(delivered) == len(chunks))
        finally:
            sender.close()
            server.close()
            proxy.close()
            for writer in pipes:
                writer.transport.abort()
    return bytes(seen), delivered


async def test_a_passive_observer_between_sender_and_inbox_sees_no_weights(keys: Path) -> None:
    snap = snapshot(3)
    chunks = list(iter_chunks(snap, make_manifest(snap, CHUNK)))
    seen_plain, _ = await _observed(keys, secure=False, chunks=chunks)
    seen_tls, delivered = await _observed(keys, secure=True, chunks=chunks)
    assert [bytes(c.data) for c in delivered] == [bytes(c.data) for c in chunks]  # through the relay, intact
    samples = [bytes(c.data[at : at + 32]) for c in chunks[:-1] for at in (0, CHUNK // 2)]  # 32 bytes each
    assert all(s in seen_plain for s in samples)  # the observer would see a plain stream's weights
    assert len(seen_tls) >= snap.data.nbytes
    assert not any(s in seen_tls for s in samples)


async def test_a_peer_admitted_only_once_its_plan_arrives_waits_instead_of_being_refused(keys: Path) -> None:
    allowed: set[str] = set()
    delivered: list[WeightChunk] = []
    server = ChunkStreamServer(
        delivered.append,
        lambda key, index, size: None,
        lambda chunk: None,
        tls=tls(keys, "s1").server,
        admit=allowed.__contains__,
        admit_wait_s=30.0,
    )
    async with asyncio.TaskGroup() as group:
        port = await server.start("127.0.0.1", group=group)
        sender = ChunkStreamSender(f"chunkstream://127.0.0.1:{port}", tls=tls(keys, "s0").client, peer="s1")
        try:
            await sender.send(WeightChunk(incarnation=1, version=1, index=0, data=np.arange(8, dtype=np.uint8)))
            await until(lambda: len(server._parked) == 1)
            assert delivered == []
            allowed.add("s0")  # the plan naming s0 as our predecessor arrived
            server.readmit()
            await until(lambda: len(delivered) == 1)
        finally:
            sender.close()
            server.close()
    assert server.counters["refused_identity"] == 0 and server.counters["tls_admitted"] == 1
    assert bytes(delivered[0].data) == bytes(range(8))


def test_missing_or_foreign_certificates_are_one_line_config_errors(keys: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no nobody\.stream\.crt .*python -m echo2\.keys --tls"):
        load_stream_tls(keys, "nobody")
    make_stream_cert(tmp_path, "s0")  # another CA's s0, dropped into our keys dir under a new name
    (tmp_path / "stray").mkdir()
    for suffix in ("crt", "key"):
        (tmp_path / "stray" / f"s0.stream.{suffix}").write_bytes((tmp_path / f"s0.stream.{suffix}").read_bytes())
    (tmp_path / "stray" / "stream-ca.crt").write_bytes((keys / "stream-ca.crt").read_bytes())
    with pytest.raises(ConfigError, match="not signed by") as failure:
        load_stream_tls(tmp_path / "stray", "s0")
    assert "\n" not in str(failure.value)


def test_the_keys_tool_never_overwrites_a_certificate(keys: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (keys / "s0.stream.crt").read_bytes()
    assert keys_main(["--tls", str(keys), "s0"]) == 2
    assert "exists" in capsys.readouterr().err
    assert (keys / "s0.stream.crt").read_bytes() == before
    assert (keys / "s0.stream.key").stat().st_mode & 0o077 == 0
    assert (keys / "stream-ca.key").stat().st_mode & 0o077 == 0


def test_dry_run_names_the_actor_whose_stream_certificate_is_missing(keys: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from echo2.launch import main as launch_main

    root = Path(__file__).resolve().parents[1]
    topology = tmp_path / "topology.toml"
    topology.write_text(
        (root / "examples" / "topology.toml").read_text() + f'\n[security]\ncurve = true\nkeys_dir = "{tmp_path}"\n'
    )
    assert launch_main([str(topology), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "security.stream_tls (actor " in err and "python -m echo2.keys --tls" in err
