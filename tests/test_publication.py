"""Publication that adapts (issue 13 item 3): while broadcast keeps up every snapshot is
published at once; when T_bcast > kappa x T_train a newer snapshot waits for the version in
flight to land, within the staleness budget, and the publisher says what S or payload size
would restore overlap (``echo2.capacity.publication``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from echo2.actors.weight_publisher import WeightPublisher, WeightPublisherConfig
from echo2.capacity.model import broadcast_remedy
from echo2.capacity.publication import PublicationPolicy
from echo2.job import JobConfig
from echo2.messages import Snapshot, TensorSpec, WeightManifest, WeightsInstalled, WeightSubscribe
from echo2.transport import Transport
from echo2.transport.endpoint import DealerEndpoint, PushEndpoint

pytestmark = pytest.mark.timeout(60)


def test_the_remedy_names_the_kappa_s_and_payload_that_restore_overlap() -> None:
    assert broadcast_remedy(kappa=2, T_train_s=1.0, T_bcast_s=2.0, bytes_per_version=10**8) is None  # holds
    remedy = broadcast_remedy(kappa=2, T_train_s=1.0, T_bcast_s=5.0, bytes_per_version=10**8)
    assert remedy is not None
    assert (remedy.kappa, remedy.staleness) == (5, 6)  # 5 x 1 s >= 5 s; the default kappa is S - 1
    assert remedy.bytes_per_version == 4 * 10**7  # 2 s of 5 s at the same rate
    with pytest.raises(ValueError):
        broadcast_remedy(kappa=0, T_train_s=1.0, T_bcast_s=5.0, bytes_per_version=1)


def _learner(policy: PublicationPolicy, versions: range, step_s: float, t0: float = 100.0) -> None:
    for version in versions:
        policy.snapshot_arrived(version, t0 + version * step_s)


def test_every_snapshot_is_published_at_once_while_broadcast_keeps_up() -> None:
    policy = PublicationPolicy(staleness=3)
    _learner(policy, range(0, 6, 2), step_s=1.0)  # kappa 2, one version a second
    policy.published(4, members=3, now_s=104.0)
    policy.reached(4, 0.5)  # landed in half a second
    assert policy.hold_s(newest=6, now_s=106.0) == 0.0
    assert policy.t_bcast_s(106.0) == (0.5, False)
    assert policy.bottleneck(t_train_s=1.0, bytes_per_version=10**6, now_s=106.0) is None
    assert policy.held == 0


def test_a_newer_snapshot_waits_while_the_version_in_flight_can_land_within_s() -> None:
    policy = PublicationPolicy(staleness=4)
    _learner(policy, range(0, 12, 2), step_s=1.0)  # versions 0..10 at 100..110 s: one a second
    policy.published(10, members=3, now_s=110.0)
    policy.snapshot_arrived(12, 112.0)
    # v10 is useful until the learner passes 10 + 4 = 14: two more seconds from 112 s.
    assert policy.hold_s(newest=12, now_s=112.0) == pytest.approx(2.0)
    assert policy.held == 1
    # Past that, nobody could be trained from v10: the newest goes at once.
    assert policy.hold_s(newest=12, now_s=114.5) == 0.0
    # A version nobody was there to receive is not waited for.
    policy.published(12, members=0, now_s=114.5)
    policy.snapshot_arrived(14, 114.6)
    assert policy.hold_s(newest=14, now_s=114.6) == 0.0


def test_versions_that_never_land_raise_the_t_bcast_estimate_and_the_bottleneck_is_named() -> None:
    policy = PublicationPolicy(staleness=3)
    _learner(policy, range(0, 10, 2), step_s=0.5)
    policy.published(2, members=3, now_s=101.0)
    policy.published(4, members=3, now_s=104.0)  # v2 streamed 3 s without landing
    assert policy.t_bcast_s(104.5) == (3.0, True)
    bottleneck = policy.bottleneck(t_train_s=0.25, bytes_per_version=8 * 10**6, now_s=104.5)
    assert bottleneck is not None and bottleneck.lower_bound and bottleneck.kappa == 2
    assert (bottleneck.remedy.kappa, bottleneck.remedy.staleness) == (12, 13)
    line = bottleneck.describe(staleness=3, bytes_per_version=8 * 10**6)
    assert "T_bcast >3.00 s exceeds kappa x T_train = 2 x 0.250 s" in line
    assert "S >= 13" in line and "at most 1.33 MB per version (now 8 MB" in line


# -- the actor ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _with_a_member(
    publisher: WeightPublisher, transport: Transport
) -> AsyncIterator[tuple[PushEndpoint, DealerEndpoint]]:
    """The publisher running, a learner's snapshot PUSH and one subscribed member that never
    opens its relay inbox (so it installs nothing unless told it did)."""
    from tests.test_actors import running

    async with running(publisher, transport) as p:
        learner = transport.push(name="learner", connect=[f"inproc://{p}/snapshots"])
        member = transport.dealer(name="m", connect=[f"inproc://{p}/weights"], identity=b"m/1")
        try:
            await member.send(WeightSubscribe(sampler_id="m", relay_address="tcp://127.0.0.1:1"))
            await publisher.broadcaster.wait_members(1)
            yield learner, member
        finally:
            learner.close()
            member.close()


def _snapshot(version: int, train_s: float = 0.05) -> Snapshot:
    data = np.full(64 * 1024, version % 251, dtype=np.uint8)
    spec = TensorSpec(name="w", dtype="uint8", shape=(data.size,), offset=0, nbytes=data.size)
    return Snapshot(
        incarnation=0, version=version, tensors=[spec], data=data, created_at_s=time.time(), train_s=train_s
    )


async def test_a_publisher_whose_member_never_installs_publishes_less_often_and_says_why(
    transport: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    """A member that subscribes and takes the manifest but never installs: every version
    stays in flight. Snapshots every 50 ms (S = 8, kappa 2): with adaptive publication a
    version is superseded only once the learner passed it by S, so about one snapshot in
    four is published, and the log names what would restore overlap; "every" publishes
    each one."""
    published: dict[str, int] = {}
    for mode in ("adaptive", "every"):
        job = JobConfig(staleness=8)
        publisher = WeightPublisher("pub", WeightPublisherConfig(publication=mode, member_ttl_s=60.0), job)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="echo2.pub"):
            async with _with_a_member(publisher, transport) as (learner, _):
                for version in range(0, 40, 2):
                    await learner.send(_snapshot(version))
                    await asyncio.sleep(0.05)  # the learner's pace: one snapshot per 50 ms
                await asyncio.sleep(0.2)
                stats = publisher.statistics()
                published[mode] = stats.published
                if mode == "adaptive":
                    assert stats.held > 0 and stats.broadcast_bound
                    assert stats.t_bcast_s > 0.1 and stats.t_bcast_lower_bound
        if mode == "adaptive":
            lines = [r.getMessage() for r in caplog.records if "broadcast is the bottleneck" in r.getMessage()]
            assert len(lines) == 1 and "S >=" in lines[0] and "per version" in lines[0], lines
    # "every": each of the 20 unless the loop took several at once; adaptive: about 1 in 4.
    assert 1 <= published["adaptive"] <= published["every"] // 2, published


async def test_an_installed_version_releases_the_waiting_snapshot_at_once(transport: Transport) -> None:
    publisher = WeightPublisher("pub", WeightPublisherConfig(member_ttl_s=60.0), JobConfig(staleness=20))
    async with _with_a_member(publisher, transport) as (learner, member):
        for version in (0, 2, 4):
            await learner.send(_snapshot(version))
            await asyncio.sleep(0.05)
        # v0 in flight (S = 20: it may take long), v2 skipped, v4 waiting.
        while not isinstance(manifest := await member.recv(), WeightManifest):
            pass
        assert manifest.version == 0 and publisher.statistics().published == 1
        await member.send(WeightsInstalled(sampler_id="m", incarnation=0, version=0, install_s=0.0, time_s=time.time()))
        while not isinstance(manifest := await member.recv(), WeightManifest):
            pass
        assert manifest.version == 4  # the newest, right after v0 landed
        assert publisher.statistics().skipped == 1
