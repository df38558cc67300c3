"""Weights under [security]: sealed content (one encryption at the publisher, one decryption
per member, ciphertext relayed unchanged) and chunk stream inboxes that admit only the plan."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from tests.polling import until

from echo2.errors import TransportError
from echo2.messages import Snapshot, WeightChunk, WeightManifest
from echo2.transport import Transport
from echo2.weights import WeightBroadcaster, WeightReceiver
from echo2.weights.chunks import ManifestRejected, SnapshotAssembler, flatten_tensors, iter_chunks, make_manifest
from echo2.weights.seal import MAX_CHUNK_BYTES, counter_block, opener_for, seal_version
from echo2.weights.signing import ManifestSigner, ManifestVerifier, make_signing_keypair
from echo2.weights.stream import ChunkStreamSender, ChunkStreamServer, StreamCredentials

CHUNK = 64 * 1024


def snapshot(version: int, nbytes: int = 24 * CHUNK + 5) -> Snapshot:
    data = np.random.default_rng(version).integers(0, 255, nbytes, dtype=np.uint8)
    specs, flat = flatten_tensors({"w": data})
    return Snapshot(incarnation=1, version=version, tensors=specs, data=flat, created_at_s=0.0)


def n_chunks(snap: Snapshot) -> int:
    return -(-snap.data.nbytes // CHUNK)


class Run:
    """A publisher and receivers over tcp chunk streams in this process."""

    def __init__(self, transport: Transport, broadcaster: WeightBroadcaster, url: str, group: Any) -> None:
        self.transport, self.broadcaster, self.url, self.group = transport, broadcaster, url, group
        self.receivers: dict[str, WeightReceiver] = {}
        self.complete: dict[str, list[SnapshotAssembler]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def add(self, name: str, *, sealed: bool = True, shm_dir: str | None = None) -> WeightReceiver:
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
            sealed=sealed,
            shm_dir=shm_dir,
        )
        receiver.open()
        self.receivers[name] = receiver
        self.tasks.append(self.group.create_task(receiver.run()))
        return receiver

    async def wait_version(self, names: list[str], version: int) -> None:
        await until(lambda: all(any(a.key.version == version for a in self.complete[n]) for n in names))


@contextlib.asynccontextmanager
async def sealed_run(mode: str = "relay", sealed: bool = True, shm_dir: str | None = None) -> AsyncIterator[Run]:
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
        sealed=sealed,
        shm_dir=shm_dir,
    )
    run: Run | None = None
    try:
        async with asyncio.TaskGroup() as group:
            main = group.create_task(broadcaster.run())
            run = Run(transport, broadcaster, router.endpoints[0], group)
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


async def test_a_sealed_relay_installs_the_plaintext_and_relays_ciphertext_unopened() -> None:
    async with sealed_run(mode="relay") as run:
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
        assert assembled.complete and assembled.manifest.seal_key
        assert np.array_equal(assembled.plaintext, snap.data)  # installs exactly the weights
        assert not np.array_equal(assembled.buffer, snap.data)  # what it received and forwards
        # Opened once per member; what it forwarded was the ciphertext it verified (its
        # successor checks the publisher's ciphertext digests), not a re-encryption.
        assert assembled.chunks_opened == n_chunks(snap)
    assert all(np.array_equal(run.complete[n][-1].buffer, run.complete["s0"][-1].buffer) for n in names)
    assert stats["s0"]["chunks_forwarded"] == stats["s1"]["chunks_forwarded"] == n_chunks(snap)
    # Every inbox admitted exactly its sender (publisher -> s0 -> s1 -> s2), none refused.
    assert [stats[n]["stream_admitted"] for n in names] == [1, 1, 1]
    assert all(s["stream_refused"] == s["stream_refused_handshake"] == 0 for s in stats.values())


async def test_a_member_joining_after_the_publish_is_admitted_and_installs_the_sealed_version() -> None:
    """A late joiner gets the latest version by repair from the publisher; its sealed inbox
    admits that stream only with the plan's secret, so the plan must reach it too (without
    it, a remote sampler that started after the learner's first publish never installed)."""
    async with sealed_run(mode="relay") as run:
        run.add("early")
        await run.broadcaster.wait_members(1)
        snap = snapshot(1)
        run.broadcaster.publish_nowait(snap)
        await run.wait_version(["early"], 1)
        run.add("late")
        await run.wait_version(["late"], 1)
        stats = run.receivers["late"].statistics()
    assert np.array_equal(run.complete["late"][-1].plaintext, snap.data)
    assert stats["stream_admitted"] >= 1 and stats["stream_refused"] == 0


async def test_shared_memory_on_the_publishers_host_holds_ciphertext_and_members_open_it(tmp_path: Path) -> None:
    async with sealed_run(mode="relay", shm_dir=str(tmp_path)) as run:
        run.add("local", shm_dir=str(tmp_path))
        run.add("remote")
        await run.broadcaster.wait_members(2)
        snap = snapshot(5)
        run.broadcaster.publish_nowait(snap)
        await run.wait_version(["local", "remote"], 5)
        (path,) = tmp_path.iterdir()
        on_disk = np.fromfile(path, dtype=np.uint8)
        local, remote = run.complete["local"][-1], run.complete["remote"][-1]
        assert run.receivers["local"].counters["shm_versions"] == 1
    assert np.array_equal(on_disk, remote.buffer) and not np.array_equal(on_disk, snap.data)
    assert np.array_equal(local.plaintext, snap.data) and np.array_equal(remote.plaintext, snap.data)
    assert local.chunks_opened == n_chunks(snap)


async def test_an_inbox_refuses_strangers_and_keeps_serving_its_publisher() -> None:
    snap = snapshot(2)
    sealed, manifest = seal_version(snap, CHUNK)
    forged = next(iter_chunks(sealed, manifest))
    async with sealed_run(mode="star") as run:
        receiver = run.add("s0")
        await run.broadcaster.wait_members(1)
        run.broadcaster.publish_nowait(snapshot(1))  # a plan exists: s0 knows a stream secret
        await run.wait_version(["s0"], 1)
        address = receiver.relay_address
        intruders = {
            # Claims to be the publisher but holds a secret of its own making.
            "guesser": ChunkStreamSender(address, credentials=StreamCredentials("pub", "s0", os.urandom(32))),
            # Speaks plain chunk frames, as to an open inbox.
            "plain": ChunkStreamSender(address),
        }
        try:
            for sender in intruders.values():
                # May look sent (the kernel took it) or fail: either way nothing is delivered.
                with contextlib.suppress(TransportError):
                    await sender.send(forged)
            await until(
                lambda: (
                    receiver.statistics()["stream_refused"] == 1
                    and receiver.statistics()["stream_refused_handshake"] == 1
                )
            )
        finally:
            for sender in intruders.values():
                sender.close()
        before = receiver.statistics()
        run.broadcaster.publish_nowait(snap)  # the inbox still serves its publisher
        await run.wait_version(["s0"], 2)
        stats = receiver.statistics()
    assert np.array_equal(run.complete["s0"][-1].plaintext, snap.data)
    assert before["corrupt_chunks"] == 0 and before["stream_admitted"] == 1  # the forged chunk never landed
    assert stats["stream_refused"] == 1 and stats["repair_requests"] == 0


async def test_a_member_given_a_wrong_content_key_refuses_the_version_and_installs_the_next() -> None:
    async with sealed_run(mode="star") as run:
        receiver = run.add("s0")
        await run.broadcaster.wait_members(1)
        send = run.broadcaster._send

        async def wrong_key_for_v1(peer: bytes, message: Any) -> bool:
            if isinstance(message, WeightManifest) and message.version == 1:
                message = msgspec.structs.replace(message, seal_key=os.urandom(32))
            return await send(peer, message)

        run.broadcaster._send = wrong_key_for_v1  # type: ignore[method-assign]
        run.broadcaster.publish_nowait(snapshot(1))
        await until(lambda: receiver.counters["seal_rejected"] >= 1)
        assert run.complete["s0"] == []  # nothing decrypted into garbage, nothing installed
        snap = snapshot(2)
        run.broadcaster.publish_nowait(snap)
        await run.wait_version(["s0"], 2)
    assert np.array_equal(run.complete["s0"][-1].plaintext, snap.data)


async def test_without_security_streams_are_plain_and_inboxes_open() -> None:
    async with sealed_run(mode="relay", sealed=False) as run:
        for name in ("s0", "s1"):
            run.add(name, sealed=False)
        await run.broadcaster.wait_members(2)
        snap = snapshot(3)
        run.broadcaster.publish_nowait(snap)
        await run.wait_version(["s0", "s1"], 3)
        stats = run.receivers["s1"].statistics()
    for name in ("s0", "s1"):
        assembled = run.complete[name][-1]
        assert not assembled.manifest.seal_key and assembled.chunks_opened == 0
        assert assembled.plaintext is assembled.buffer and np.array_equal(assembled.buffer, snap.data)
    assert stats["stream_admitted"] == 0 and stats["stream_chunks_in_place"] > 0


async def _observed(chunks: list[WeightChunk], credentials: StreamCredentials | None) -> tuple[bytes, list[bytes]]:
    """Send ``chunks`` through a TCP proxy that records every byte; returns (bytes seen,
    bodies delivered). With ``credentials`` the inbox challenges and checks them."""
    delivered: list[bytes] = []
    secret = credentials.secret if credentials is not None else b""
    server = ChunkStreamServer(
        lambda chunk: delivered.append(bytes(chunk.data)),
        lambda key, index, size: None,
        lambda chunk: None,
        authenticate=None if credentials is None else _only("pub", "s0", secret),
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
        port = await server.start("127.0.0.1")

        async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
            pipes.extend((client_writer, server_writer))
            group.create_task(pipe(client_reader, server_writer, record=True))
            group.create_task(pipe(server_reader, client_writer, record=False))

        proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
        sender = ChunkStreamSender(
            f"chunkstream://127.0.0.1:{proxy.sockets[0].getsockname()[1]}", credentials=credentials
        )
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


def _only(sender: str, receiver: str, secret: bytes) -> Callable[[bytes, str, bytes], bool]:
    from echo2.weights.stream import stream_mac

    return lambda challenge, name, mac: name == sender and mac == stream_mac(secret, challenge, sender, receiver)


async def test_a_passive_observer_sees_only_ciphertext() -> None:
    snap = snapshot(3)
    plain_chunks = list(iter_chunks(snap, make_manifest(snap, CHUNK)))
    sealed, manifest = seal_version(snap, CHUNK)
    sealed_chunks = list(iter_chunks(sealed, manifest))
    seen_plain, _ = await _observed(plain_chunks, None)
    credentials = StreamCredentials("pub", "s0", os.urandom(32))
    seen_sealed, delivered = await _observed(sealed_chunks, credentials)
    assert delivered == [bytes(c.data) for c in sealed_chunks]  # through the proxy, intact
    samples = [bytes(c.data[at : at + 32]) for c in plain_chunks[:-1] for at in (0, CHUNK // 2)]
    assert all(s in seen_plain for s in samples)  # the observer would see a plain stream's weights
    assert len(seen_sealed) >= snap.data.nbytes
    assert not any(s in seen_sealed for s in samples)
    assert credentials.secret not in seen_sealed and manifest.seal_key not in seen_sealed


async def test_a_sender_admitted_only_once_its_plan_arrives_waits_instead_of_being_refused() -> None:
    secret = os.urandom(32)
    plan_arrived = False
    delivered: list[WeightChunk] = []
    check = _only("s0", "s1", secret)
    server = ChunkStreamServer(
        delivered.append,
        lambda key, index, size: None,
        lambda chunk: None,
        authenticate=lambda challenge, name, mac: plan_arrived and check(challenge, name, mac),
        admit_wait_s=30.0,
    )
    port = await server.start("127.0.0.1")
    sender = ChunkStreamSender(f"chunkstream://127.0.0.1:{port}", credentials=StreamCredentials("s0", "s1", secret))
    try:
        await sender.send(WeightChunk(incarnation=1, version=1, index=0, data=np.arange(8, dtype=np.uint8)))
        await until(lambda: len(server._parked) == 1)
        assert delivered == []
        plan_arrived = True  # the plan naming s0 as our predecessor arrived
        server.readmit()
        await until(lambda: len(delivered) == 1)
    finally:
        sender.close()
        server.close()
    assert server.counters["refused"] == 0 and server.counters["admitted"] == 1
    assert bytes(delivered[0].data) == bytes(range(8))


def test_counter_blocks_never_repeat_across_versions_and_chunks() -> None:
    # Every (incarnation, version, index) starts its own block, and a chunk's blocks
    # (at most MAX_CHUNK_BYTES / 16) never run into the next index's range.
    blocks = {counter_block(inc, ver, i) for inc in (1, 2) for ver in range(50) for i in range(200)}
    assert len(blocks) == 2 * 50 * 200
    first, next_index = (int.from_bytes(counter_block(1, 7, i), "big") for i in (3, 4))
    assert next_index - first == MAX_CHUNK_BYTES // 16
    # Identical plaintext chunks, and the same version sealed twice, never encrypt alike.
    same = Snapshot(incarnation=1, version=1, tensors=[], data=np.zeros(4 * CHUNK, np.uint8), created_at_s=0.0)
    specs, _ = flatten_tensors({"w": same.data})
    same = msgspec.structs.replace(same, tensors=specs)
    (a, ma), (b, _) = seal_version(same, CHUNK), seal_version(same, CHUNK)
    chunks = [bytes(a.data[i * CHUNK : (i + 1) * CHUNK]) for i in range(4)]
    assert len(set(chunks)) == 4 and not np.array_equal(a.data, b.data)
    assert len(set(ma.chunk_digests)) == 4


def test_a_signed_sealed_manifest_cannot_be_given_another_key(tmp_path: Path) -> None:
    public, private = make_signing_keypair(tmp_path, "learner")
    _, manifest = seal_version(snapshot(4), CHUNK)
    signed = ManifestSigner(private).sign(manifest)
    ManifestVerifier(public).verify(signed)
    key = os.urandom(32)
    from echo2.weights.seal import key_check

    forged = msgspec.structs.replace(signed, seal_key=key, seal_check=key_check(key, signed.digest))
    assert opener_for(forged) is not None  # consistent with itself...
    with pytest.raises(ManifestRejected):
        ManifestVerifier(public).verify(forged)  # ...but not what was signed
    with pytest.raises(ManifestRejected, match="seal_check mismatch"):
        opener_for(msgspec.structs.replace(signed, seal_key=key))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launched_job_under_security_trains_from_sealed_versions(tmp_path: Path) -> None:
    """The real entry point with ``[security] curve = true``: every version broadcast is
    sealed, members install it, and the run completes."""
    import subprocess
    import sys

    from echo2.rundir import RunDir
    from echo2.tools.keys import main as keys_main

    root = Path(__file__).resolve().parents[1]
    keys = tmp_path / "keys"
    assert keys_main([str(keys), "local"]) == 0  # the one host of a topology without [hosts]
    (keys / "allowed").mkdir()
    (keys / "allowed" / "local.key").write_bytes((keys / "local.key").read_bytes())
    topology = tmp_path / "topology.toml"
    topology.write_text(
        (root / "examples" / "topology.toml").read_text() + f'\n[security]\ncurve = true\nkeys_dir = "{keys}"\n'
    )
    overrides = ["max_steps=8", "eval_every=0", "eval_prompts=20", "checkpoint_every=0"]
    command = [sys.executable, "-m", "echo2.launch", str(topology), "--run-dir", str(tmp_path / "runs")]
    for override in overrides:
        command += ["--set", f"actors.learner.config.{override}"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    broadcasts = RunDir(run).metrics("weight_publisher", "broadcast")
    assert broadcasts and all(b["sealed"] and b["installed"] >= 1 for b in broadcasts)
