"""The transport contract, checked once per medium (inproc, ipc, tcp).

Every contract test takes ``url_factory`` and so runs three times (the last tests, the
protocol document's example sampler, are tcp only); the ``transport`` fixture fails any test
that leaves an endpoint open. Synchronization is by handshake (XPUB sees the
subscription) or by the data itself, never by sleeping. The only timeouts are negative
checks ("this send is still blocked") and hang guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import zmq

from echo2.errors import ClosedError, EndOfStream
from echo2.messages import EndOfStreamMsg, Hello, Message, WeightChunk, Welcome, WorkRequest
from echo2.transport import Codec, Endpoint, SocketOptions, Transport

pytestmark = pytest.mark.timeout(10)

MiB = 1 << 20
BLOCKED_FOR_S = 0.3  # how long a send must stay pending to count as blocked


def work(i: int, sampler: str = "sampler-0") -> WorkRequest:
    return WorkRequest(sampler_id=sampler, credits=i)


def chunk(i: int, data: np.ndarray) -> WeightChunk:
    return WeightChunk(incarnation=1, version=2, index=i, data=data)


async def recv_n(endpoint: Endpoint, n: int) -> list:
    """Receive exactly ``n`` messages (or ``(peer, message)`` pairs from a ROUTER)."""
    out: list = []
    while len(out) < n:
        out.extend(await endpoint.recv_many(n - len(out)))  # type: ignore[attr-defined]
    return out


async def let_loop_run(turns: int = 5) -> None:
    """Give every ready task a few turns (not a timing wait: no wall-clock involved)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def assert_blocked(task: asyncio.Task) -> None:
    """Negative check: ``task`` stays pending while its peer does not read."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), BLOCKED_FOR_S)
    assert not task.done()


@contextlib.contextmanager
def raw_socket(transport: Transport, kind: int, url: str, **options: object) -> Iterator[zmq.Socket]:
    """A plain sync pyzmq socket on the transport's own context (inproc requires it)."""
    context = zmq.Context.shadow(transport._context.underlying)
    sock = context.socket(kind)
    try:
        sock.linger = 0
        sock.rcvtimeo = sock.sndtimeo = 5000
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        sock.connect(url)
        yield sock
    finally:
        sock.close(linger=0)


def malformed_messages() -> list[list[bytes]]:
    """Multipart messages that are not valid echo2 messages, one per failure class."""
    rng = random.Random(20240611)
    codec = Codec()
    valid = codec.encode(work(7))[0]
    with_frame = codec.encode(chunk(0, np.zeros(128 * 1024, np.uint8)))
    return [
        [b""],
        [b"\xe2"],
        [b"\xe2\x01"],
        *[[rng.randbytes(n)] for n in (3, 17, 200, 5000)],
        [b"\x00" + valid[1:]],  # bad magic byte
        [valid[:2] + b"\xc1"],  # reserved msgpack byte
        [bytes([0xE2, 0x7F]) + valid[2:]],  # other protocol version
        [valid[: len(valid) // 2]],  # truncated
        [valid, b"unreferenced extra frame"],
        [with_frame[0]],  # refers to a frame that is missing
        [b"\xe2\x01" + b"\x81\xa4type\xa4Nope"],  # unknown type tag
    ]


# ------------------------------------------------------------------------------ ordering


async def test_push_pull_preserves_order(transport: Transport, url_factory) -> None:
    n = 600
    big = np.arange(96 * 1024, dtype=np.uint8)  # a separate frame, interleaved with small
    messages: list[Message] = [chunk(i, big) if i % 100 == 0 else work(i) for i in range(n)]
    async with (
        transport.open("pull", name="pull", bind=[url_factory()]) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):
        async with asyncio.TaskGroup() as tg:
            sender = tg.create_task(push.send_many(messages))
            got = await recv_n(pull, n)
        assert sender.result() == n
    assert [getattr(m, "credits", None) for m in got] == [getattr(m, "credits", None) for m in messages]
    assert [m.index for m in got if isinstance(m, WeightChunk)] == list(range(0, n, 100))
    assert all(np.array_equal(m.data, big) for m in got if isinstance(m, WeightChunk))


async def test_dealer_router_preserves_order_both_ways(transport: Transport, url_factory) -> None:
    n = 500
    async with (
        transport.open("router", name="router", bind=[url_factory()]) as router,
        transport.open("dealer", name="dealer", connect=[router.endpoints[0]], identity=b"dealer-1") as dealer,
    ):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(dealer.send_many(work(i) for i in range(n)))
            upstream = await recv_n(router, n)
        assert {peer for peer, _ in upstream} == {b"dealer-1"}
        assert [m.credits for _, m in upstream] == list(range(n))

        async def reply() -> None:
            for i in range(n):
                assert await router.send(b"dealer-1", work(i, sampler="router"))

        async with asyncio.TaskGroup() as tg:
            tg.create_task(reply())
            downstream = await recv_n(dealer, n)
        assert [(m.sampler_id, m.credits) for m in downstream] == [("router", i) for i in range(n)]


async def test_pub_sub_preserves_order_after_handshake(transport: Transport, url_factory) -> None:
    n = 500
    async with (
        transport.open("pub", name="pub", bind=[url_factory()]) as pub,
        transport.open("sub", name="sub", connect=[pub.endpoints[0]], subscribe=[b"weights|"]) as sub,
    ):
        assert await pub.wait_subscriber(b"weights|") == b"weights|"
        for i in range(n):
            assert await pub.publish(b"weights|", work(i))
            await pub.publish(b"other|", work(-1))  # not subscribed: filtered at the publisher
        got = await recv_n(sub, n)
        assert [m.credits for m in got] == list(range(n))
        with_topic = await asyncio.gather(pub.publish(b"weights|", work(n)), sub.recv_many_with_topic())
        assert with_topic[1] == [(b"weights|", work(n))]


# ------------------------------------------------------------------------- end of stream


async def test_end_of_stream_after_every_producer(transport: Transport, url_factory) -> None:
    k, producers = 300, 3
    async with contextlib.AsyncExitStack() as stack:
        pull = await stack.enter_async_context(
            transport.open("pull", name="pull", bind=[url_factory()], producers=producers)
        )
        pushers = [
            await stack.enter_async_context(transport.open("push", name=f"push-{p}", connect=[pull.endpoints[0]]))
            for p in range(producers)
        ]

        async def produce(p: int, push: Endpoint) -> None:
            for i in range(k):
                await push.send(work(i, sampler=f"p{p}"))  # type: ignore[attr-defined]
            await push.send_eos(f"p{p}")  # type: ignore[attr-defined]

        async with asyncio.TaskGroup() as tg:
            for p, push in enumerate(pushers):
                tg.create_task(produce(p, push))
            got = [m async for m in pull]

        assert len(got) == producers * k
        assert not any(isinstance(m, EndOfStreamMsg) for m in got)
        for p in range(producers):
            assert [m.credits for m in got if m.sampler_id == f"p{p}"] == list(range(k))
        with pytest.raises(EndOfStream):
            await pull.recv()
        with pytest.raises(EndOfStream):
            await pull.recv_many()
        assert [m async for m in pull] == []
        stats = pull.statistics()
        assert stats.eos_received == producers
        assert stats.received == producers * (k + 1)


async def test_repeated_end_of_stream_from_one_producer_counts_once(transport: Transport, url_factory) -> None:
    async with (
        transport.open("pull", name="pull", bind=[url_factory()], producers=2) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):
        await push.send_eos("a")
        await push.send_eos("a")
        await push.send(work(1))
        assert await pull.recv() == work(1)  # not ended: only one distinct producer is done
        await push.send_eos("b")
        with pytest.raises(EndOfStream):
            await pull.recv()


# -------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("method", ["recv", "recv_many"])
async def test_cancelled_receive_loses_nothing(transport: Transport, url_factory, method: str) -> None:
    async with (
        transport.open("pull", name="pull", bind=[url_factory()]) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):
        waiting = asyncio.ensure_future(getattr(pull, method)())
        await let_loop_run()
        assert not waiting.done()  # blocked: nothing was sent
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await push.send(work(1))
        await push.send(work(2))
        assert await recv_n(pull, 2) == [work(1), work(2)]
        assert pull.statistics().received == 2


async def test_cancelling_a_consumer_mid_stream_loses_nothing(transport: Transport, url_factory) -> None:
    """Consumers are cancelled repeatedly while a producer streams; a new one resumes."""
    n = 3000
    received: list[int] = []
    async with (
        transport.open("pull", name="pull", bind=[url_factory()], producers=1) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):

        async def produce() -> None:
            for i in range(n):
                await push.send(work(i))
                if i % 64 == 0:
                    await asyncio.sleep(0)  # interleave with the consumer
            await push.send_eos("producer")

        async def consume(stop_after: int | None, reached: asyncio.Event) -> None:
            async for message in pull:
                received.append(message.credits)
                if stop_after is not None and len(received) >= stop_after:
                    reached.set()
                await asyncio.sleep(0)  # a consumer that awaits between messages

        async with asyncio.TaskGroup() as tg:
            tg.create_task(produce())
            for stop_after in (1, 150, 900, 1700, 2500):
                reached = asyncio.Event()
                consumer = tg.create_task(consume(stop_after, reached))
                await reached.wait()
                consumer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await consumer
            # A consumer cancelled while blocked in a receive, not between messages.
            blocked = tg.create_task(pull.recv())
            await let_loop_run(1)
            blocked.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                received.append((await blocked).credits)
            # Drains to the end of the stream (a lost message would hang: bound it).
            await asyncio.wait_for(consume(None, asyncio.Event()), 5)
    assert received == list(range(n))


async def test_breaking_out_of_async_for_keeps_the_rest(transport: Transport, url_factory) -> None:
    n = 50
    async with (
        transport.open("pull", name="pull", bind=[url_factory()]) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):
        await push.send_many(work(i) for i in range(n))
        async for message in pull:
            first = message
            break
        rest = await asyncio.wait_for(recv_n(pull, n - 1), 5)
    assert [first.credits, *(m.credits for m in rest)] == list(range(n))


# -------------------------------------------------------------------------- back-pressure


async def test_push_blocks_at_hwm_until_the_receiver_reads(transport: Transport, url_factory) -> None:
    # 80 x 1 MiB exceeds the HWMs (2 messages each side) plus every kernel socket buffer.
    m, data, options = 80, np.zeros(MiB, np.uint8), SocketOptions(hwm=2)
    async with (
        transport.open("pull", name="pull", bind=[url_factory()], options=options) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]], options=options, on_full="block") as push,
    ):
        async with asyncio.TaskGroup() as tg:
            sender = tg.create_task(push.send_many(chunk(i, data) for i in range(m)))
            await assert_blocked(sender)
            assert push.statistics().sent < m
            assert push.statistics().dropped == 0
            got = await recv_n(pull, m)
        assert sender.result() == m
    assert [c.index for c in got] == list(range(m))


@pytest.mark.parametrize("kind", ["pub", "router"])
async def test_blocking_fan_out_waits_for_a_slow_peer(transport: Transport, url_factory, kind: str) -> None:
    """XPUB (XPUB_NODROP) and ROUTER (ROUTER_MANDATORY) wait too, instead of failing.

    A second, idle peer with room in its pipe makes the socket look writable while the slow
    peer's pipe is full.
    """
    m, data, options = 60, np.zeros(MiB, np.uint8), SocketOptions(hwm=2)
    peer_kind = "sub" if kind == "pub" else "dealer"
    topics = {b"slow": [b"w|"], b"idle": [b"idle|"]} if kind == "pub" else {}
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(transport.open(kind, name=kind, bind=[url_factory()], options=options))
        peers = [
            await stack.enter_async_context(
                transport.open(
                    peer_kind,
                    name=f"{peer_kind}-{identity.decode()}",
                    connect=[server.endpoints[0]],
                    options=options,
                    identity=identity,
                    subscribe=topics.get(identity, []),
                )
            )
            for identity in (b"slow", b"idle")
        ]
        slow = peers[0]
        if kind == "pub":
            assert {await server.wait_subscriber(), await server.wait_subscriber()} == {
                b"w|",
                b"idle|",
            }
            send = lambda message: server.publish(b"w|", message)  # noqa: E731
        else:
            for peer in peers:
                await peer.send(work(0))  # introduce the peer to the router
            assert {peer for peer, _ in await recv_n(server, 2)} == {b"slow", b"idle"}
            send = lambda message: server.send(b"slow", message)  # noqa: E731

        async def produce() -> int:
            return sum([await send(chunk(i, data)) for i in range(m)])

        async with asyncio.TaskGroup() as tg:
            sender = tg.create_task(produce())
            await assert_blocked(sender)
            got = await recv_n(slow, m)
        assert sender.result() == m
        assert [c.index for c in got] == list(range(m))
        assert server.statistics().dropped == 0


async def test_pub_drops_and_counts_at_hwm(transport: Transport, url_factory) -> None:
    attempted, options = 2000, SocketOptions(hwm=1)
    message = chunk(0, np.zeros(64 * 1024, np.uint8))
    async with (
        transport.open("pub", name="pub", bind=[url_factory()], options=options, on_full="drop") as pub,
        transport.open("sub", name="sub", connect=[pub.endpoints[0]], options=options, subscribe=[b"t|"]) as sub,
    ):
        await pub.wait_subscriber(b"t|")
        delivered = sum([await pub.publish(b"t|", message) for _ in range(attempted)])
        stats = pub.statistics()
        assert stats.dropped > 0
        assert stats.sent == delivered
        assert stats.sent + stats.dropped == attempted
        assert (await sub.recv()).index == 0  # the subscriber still gets what was sent


async def test_router_send_to_unknown_peer_is_unroutable(transport: Transport, url_factory) -> None:
    async with transport.open("router", name="router", bind=[url_factory()]) as router:
        assert await router.send(b"nobody", work(1)) is False
        assert await router.send(b"nobody", work(2)) is False
        stats = router.statistics()
        assert (stats.unroutable, stats.sent, stats.bytes_sent) == (2, 0, 0)


# -------------------------------------------------------------------------- hostile input


async def test_malformed_frames_into_pull_are_counted_and_dropped(transport: Transport, url_factory) -> None:
    bad = malformed_messages()
    async with transport.open("pull", name="pull", bind=[url_factory()]) as pull:
        with raw_socket(transport, zmq.PUSH, pull.endpoints[0]) as raw:
            for frames in bad:
                raw.send_multipart(frames)
            raw.send_multipart(Codec().encode(work(42)))
            assert await pull.recv() == work(42)
            raw.send_multipart(Codec().encode(work(43)))
            assert await pull.recv() == work(43)
        stats = pull.statistics()
        assert stats.decode_errors == len(bad)
        assert stats.received == len(bad) + 2


async def test_malformed_frames_into_router_are_counted_and_dropped(transport: Transport, url_factory) -> None:
    bad = malformed_messages()
    async with transport.open("router", name="router", bind=[url_factory()]) as router:
        with raw_socket(transport, zmq.DEALER, router.endpoints[0], ROUTING_ID=b"raw") as raw:
            for frames in bad:
                raw.send_multipart(frames)
            raw.send_multipart(Codec().encode(work(42)))
            assert await router.recv() == (b"raw", work(42))
            assert await router.send(b"raw", work(43))  # the peer is still routable
            assert Codec().decode(raw.recv_multipart()) == work(43)
        assert router.statistics().decode_errors == len(bad)


async def test_malformed_frames_into_sub_are_counted_and_dropped(transport: Transport, url_factory) -> None:
    bad = [[b"t|"]] + [[b"t|", *frames] for frames in malformed_messages()]
    async with transport.open("sub", name="sub", bind=[url_factory()], subscribe=[b"t|"]) as sub:
        # The SUB sends its subscription to a new peer only while its socket is serviced,
        # so the receive is pending before the raw publisher waits for the handshake.
        receiving = asyncio.ensure_future(sub.recv())
        with raw_socket(transport, zmq.XPUB, sub.endpoints[0]) as raw:
            assert await asyncio.to_thread(raw.recv) == b"\x01t|"
            for frames in bad:
                raw.send_multipart(frames)
            raw.send_multipart([b"t|", *Codec().encode(work(42))])
            assert await receiving == work(42)
        assert sub.statistics().decode_errors == len(bad)


# ------------------------------------------------------------------------------ lifecycle


async def test_close_is_idempotent_and_later_use_raises(transport: Transport, url_factory) -> None:
    pull = transport.open("pull", name="pull", bind=[url_factory()])
    push = transport.open("push", name="push", connect=[pull.endpoints[0]])
    router = transport.open("router", name="router", bind=[url_factory()])
    dealer = transport.open("dealer", name="dealer", connect=[router.endpoints[0]])
    pub = transport.open("pub", name="pub", bind=[url_factory()])
    sub = transport.open("sub", name="sub", connect=[pub.endpoints[0]])
    everything = [pull, push, router, dealer, pub, sub]
    assert len(transport.open_endpoints) == len(everything)
    for endpoint in everything:
        endpoint.close()
        endpoint.close()
        await endpoint.aclose()
        assert endpoint.closed
    assert transport.open_endpoints == []

    calls = [
        lambda: push.send(work(0)),
        lambda: push.send_many([work(0)]),
        lambda: push.send_eos("p"),
        pull.recv,
        pull.recv_many,
        lambda: anext(aiter(pull)),
        lambda: router.send(b"x", work(0)),
        router.recv,
        lambda: dealer.send(work(0)),
        dealer.recv,
        lambda: pub.publish(b"t|", work(0)),
        pub.wait_subscriber,
        sub.recv,
        sub.recv_many_with_topic,
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            await call()
    with pytest.raises(ClosedError):
        pub.subscriptions_nowait()
    with pytest.raises(ClosedError):
        sub.subscribe(b"t|")
    assert pull.statistics().sent == 0  # statistics stay readable after close


async def test_close_wakes_a_blocked_call_with_closed_error(transport: Transport, url_factory) -> None:
    pull = transport.open("pull", name="pull", bind=[url_factory()])
    # No peer: a PUSH send blocks at once (without bundling, which accepts one bundle first).
    push = transport.open("push", name="push", options=SocketOptions(coalesce=1))
    pub = transport.open("pub", name="pub", bind=[url_factory()])
    blocked = [
        asyncio.ensure_future(pull.recv()),
        asyncio.ensure_future(push.send(work(0))),
        asyncio.ensure_future(pub.wait_subscriber()),
    ]
    await let_loop_run()
    assert not any(task.done() for task in blocked)
    for endpoint in (pull, push, pub):
        endpoint.close()
    results = await asyncio.gather(*blocked, return_exceptions=True)
    assert [type(r) for r in results] == [ClosedError] * 3
    assert not any(task.cancelled() for task in blocked)


async def test_transport_close_closes_everything_and_is_idempotent(url_factory) -> None:
    transport = Transport()
    pull = transport.open("pull", name="pull", bind=[url_factory()])
    push = transport.open("push", name="push", connect=[pull.endpoints[0]])
    transport.close()
    transport.close()
    assert pull.closed and push.closed and transport.open_endpoints == []
    with pytest.raises(ClosedError):
        await push.send(work(0))


# ----------------------------------------------------------------------------- statistics


async def test_statistics_count_messages_and_bytes(transport: Transport, url_factory) -> None:
    codec = Codec()
    big = np.arange(800_000, dtype=np.uint8)  # a separate frame
    messages: Sequence[Message] = [work(i) for i in range(9)] + [chunk(0, big)]
    # Bytes on the wire: the nine small messages, sent back to back, travel as one bundle.
    size = len(Codec.bundle([codec.encode(m)[0] for m in messages[:9]])) + sum(
        len(memoryview(f).cast("B")) for f in codec.encode(messages[9])
    )
    async with (
        transport.open("pull", name="pull", bind=[url_factory()]) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):
        assert await push.send_many(messages) == len(messages)
        got = await recv_n(pull, len(messages))
        sent, received = push.statistics(), pull.statistics()
    assert got[:9] == messages[:9]
    assert np.array_equal(got[9].data, big)
    assert not got[9].data.flags.writeable
    assert (sent.name, sent.sent, sent.bytes_sent) == ("push", 10, size)
    assert (received.name, received.received, received.bytes_received) == ("pull", 10, size)
    assert received.decode_errors == received.dropped == received.queued == 0
    assert sent.received == received.sent == 0


# ------------------------------------------------------------------------------- bundles


async def test_small_messages_sent_back_to_back_travel_in_bundles_in_order(transport: Transport, url_factory) -> None:
    url = url_factory()
    push = transport.open("push", name="push", bind=[url])
    with raw_socket(transport, zmq.PULL, push.endpoints[0]) as pull:
        sent = [work(i) for i in range(200)]
        for message in sent:  # no await suspends here: one turn of the loop
            await push.send(message)
        await push.flush()
        codec, got, wire_messages = Codec(), [], 0
        while len(got) < len(sent):
            decoded = codec.decode_any(pull.recv_multipart())
            wire_messages += 1
            got.extend(decoded if isinstance(decoded, list) else [decoded])
        push.close()
    assert got == sent
    assert wire_messages == 4  # 200 = 64 + 64 + 64 + 8
    assert push.statistics().sent == 200


async def test_a_bundle_leaves_when_the_loop_turns_without_flush(transport: Transport, url_factory) -> None:
    async with (
        transport.open("pull", name="pull", bind=[url_factory()]) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):
        await push.send(work(1))
        await push.send(work(2))  # both wait in the bundle until this task yields
        assert push.statistics().queued == 2
        assert await recv_n(pull, 2) == [work(1), work(2)]  # awaiting turns the loop


async def test_a_large_message_waits_for_the_bundle_before_it(transport: Transport, url_factory) -> None:
    big = np.arange(MiB, dtype=np.uint8)
    async with (
        transport.open("pull", name="pull", bind=[url_factory()]) as pull,
        transport.open("push", name="push", connect=[pull.endpoints[0]]) as push,
    ):
        await push.send(work(1))
        await push.send(chunk(0, big))
        await push.send(work(2))
        got = await recv_n(pull, 3)
    assert got[0] == work(1) and got[2] == work(2)
    assert np.array_equal(got[1].data, big)


async def test_with_no_peer_a_push_accepts_one_bundle_then_blocks(transport: Transport) -> None:
    push = transport.open("push", name="push", options=SocketOptions(coalesce=4))
    for i in range(3):
        await push.send(work(i))  # the bundle takes them; ZeroMQ has no peer to queue to
    fourth = asyncio.ensure_future(push.send(work(3)))
    await assert_blocked(fourth)
    push.close()
    with pytest.raises(ClosedError):
        await fourth
    assert push.statistics().sent == 0


async def test_close_with_linger_delivers_the_pending_bundle(transport: Transport, url_factory) -> None:
    pull = transport.open("pull", name="pull", bind=[url_factory()])
    push = transport.open("push", name="push", connect=[pull.endpoints[0]])
    await push.send(work(1))
    await push.send(work(2))
    push.close(linger_ms=2000)  # before the loop turned: the bundle is still in the endpoint
    assert push.statistics().sent == 2
    assert await recv_n(pull, 2) == [work(1), work(2)]
    pull.close()


@pytest.mark.parametrize(
    "body",
    [
        b"\x90",  # empty bundle
        b"\x91" + Codec().encode(WorkRequest(sampler_id="s", credits=1))[0][2:],  # one message
        b"\x92" + Codec().encode(WorkRequest(sampler_id="s", credits=1))[0][2:] + b"\x01",  # bad element
        b"\x92" + b"\xa1x" * 2,  # elements that are not messages
    ],
)
async def test_malformed_bundles_are_counted_and_dropped(transport: Transport, url_factory, body: bytes) -> None:
    async with transport.open("pull", name="pull", bind=[url_factory()]) as pull:
        with raw_socket(transport, zmq.PUSH, pull.endpoints[0]) as push:
            push.send(b"\xe2\x01" + body)
            good = Codec().encode(work(7))
            push.send_multipart(good)
            assert await pull.recv() == work(7)
        assert pull.statistics().decode_errors == 1


async def test_a_bundle_with_data_frames_is_malformed(transport: Transport, url_factory) -> None:
    codec = Codec()
    bundle = Codec.bundle([codec.encode(work(i))[0] for i in range(2)])
    async with transport.open("pull", name="pull", bind=[url_factory()]) as pull:
        with raw_socket(transport, zmq.PUSH, pull.endpoints[0]) as push:
            push.send_multipart([bundle, b"extra"])
            push.send_multipart(codec.encode(work(7)))
            assert await pull.recv() == work(7)
        assert pull.statistics().decode_errors == 1


# ----------------------------------------------------------------------- protocol document


def _doc_example(tmp_path: Path, tasks_address: str) -> list[str]:
    """The command that runs docs/protocol.md's example sampler as ``stranger``, with
    ``tasks`` at ``tasks_address`` (a resolved topology of its own; the other addresses
    lead nowhere: these tests end before it uses them)."""
    from tests.test_foreign_sampler import example_code

    (tmp_path / "sampler.py").write_text(example_code())
    entry = {"name": "stranger", "ports": {"tasks": {"connect": [tasks_address]}, "rollouts": {"connect": []},
                                           "weights": {"connect": ["tcp://127.0.0.1:9"]}}}  # fmt: skip
    resolved = {"hosts": {"h": {"address": "127.0.0.1"}}, "processes": {"p": {"host": "h", "actors": [entry]}}}
    (tmp_path / "resolved.json").write_text(json.dumps(resolved))
    return [sys.executable, str(tmp_path / "sampler.py"), str(tmp_path / "resolved.json"), "stranger"]


async def test_protocol_doc_example_retries_a_busy_name_checks_the_model_and_asks_for_work(
    transport: Transport, tmp_path: Path
) -> None:
    """The plain pyzmq + msgpack sampler of docs/protocol.md against an echo2 ROUTER: Hello
    under a routing id of its own, Hello again after a refusal with a delay, and, welcomed
    for the built-in model (whose tokenizer digest it computes itself), its first work state."""
    from echo2.models.identity import model_identity

    async with transport.open("router", name="tasks", bind=["tcp://127.0.0.1:0"]) as router:
        client = await asyncio.create_subprocess_exec(*_doc_example(tmp_path, router.endpoints[0]))
        try:
            peer, hello = await router.recv()
            assert peer.startswith(b"stranger/") and hello == Hello(peer_id="stranger", role="sampler")
            busy = Welcome(server_id="tasks", accepted=False, refusal="name_in_use", retry_after_s=0.1)
            assert await router.send(peer, busy)
            assert await router.recv() == (peer, hello)  # again, on the same connection
            assert await router.send(peer, Welcome(server_id="tasks", accepted=True, model=model_identity("")))
            # Its work state: it can hold 8 leases and holds none (docs/protocol.md section 2).
            assert await router.recv() == (peer, WorkRequest(sampler_id="stranger", max_leases=8, sync=1))
        finally:
            with contextlib.suppress(ProcessLookupError):
                client.kill()
            await client.wait()
        assert router.statistics().decode_errors == 0


@pytest.mark.parametrize("ending", ["permanent refusal", "another model"])
async def test_protocol_doc_example_stops_when_refused_or_told_of_another_model(
    transport: Transport, tmp_path: Path, ending: str
) -> None:
    from echo2.messages import ModelIdentity

    if ending == "permanent refusal":
        welcome = Welcome(server_id="tasks", accepted=False, refusal="protocol_version", reason="speaks version 2")
    else:
        other = ModelIdentity(model_id="other", tokenizer_digest="ab", architecture_digest="cd", vocab_size=49152)
        welcome = Welcome(server_id="tasks", accepted=True, model=other)
    async with transport.open("router", name="tasks", bind=["tcp://127.0.0.1:0"]) as router:
        client = await asyncio.create_subprocess_exec(
            *_doc_example(tmp_path, router.endpoints[0]), stderr=asyncio.subprocess.PIPE
        )
        peer, _ = await router.recv()
        assert await router.send(peer, welcome)
        _, err = await client.communicate()
    assert client.returncode != 0
    assert ("speaks version 2" if ending == "permanent refusal" else "another model") in err.decode()
