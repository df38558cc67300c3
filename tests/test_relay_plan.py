"""Relay plans that stay shallow as N grows, and members placed by what was measured of them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tests.test_secure_streams import sealed_run
from tests.test_secure_streams import snapshot as sealed_snapshot
from tests.test_weights_relay import CHUNK, equal_to, harness, snapshot

from echo2.messages import RelayPlan
from echo2.weights.link import LinkSpec
from echo2.weights.plan import (
    MAX_DEPTH,
    Placement,
    RelayTree,
    member_view,
    reach_order,
    relay_fanout,
    relay_plan,
    tree_depth,
)


def names(n: int) -> list[str]:
    return [f"s{i:03d}" for i in range(n)]


def depth_of(tree: RelayTree) -> int:
    """Members on the longest path from the root, followed up through ``parent``."""
    longest = 0
    for member in tree.members:
        hops, at = 1, member
        while (parent := tree.parent(at)) is not None:
            hops, at = hops + 1, parent
        longest = max(longest, hops)
    return longest


def test_a_relay_is_one_chain_up_to_the_depth_bound_then_trees_of_growing_fanout() -> None:
    assert [relay_fanout(n) for n in (1, 2, MAX_DEPTH)] == [1, 1, 1]
    fanouts = [relay_fanout(n) for n in (MAX_DEPTH + 1, 32, 64, 128, 256, 1024, 4096)]
    assert fanouts == sorted(fanouts) and fanouts[0] == 2 and fanouts[-1] > fanouts[0]
    for n in (7, 32, 100, 256, 1000):
        assert tree_depth(n, relay_fanout(n)) <= MAX_DEPTH
        assert tree_depth(n, relay_fanout(n) - 1) > MAX_DEPTH  # the smallest fan-out that fits
    assert relay_fanout(256, max_depth=256) == 1
    assert tree_depth(5, 1) == 5 and tree_depth(7, 2) == 3 and tree_depth(8, 2) == 4


@pytest.mark.parametrize("n", [7, 32, 129, 256])
def test_relay_trees_reach_every_member_once_per_stripe_shallowly_and_each_member_forwards_one_copy(n: int) -> None:
    members = names(n)
    stripes, chains = relay_plan(members, "relay")
    fanout = relay_fanout(n)
    assert stripes == fanout == len(chains)
    assert sorted(c.stripe for c in chains) == list(range(stripes))
    copies = dict.fromkeys(members, 0.0)  # versions' worth each member forwards
    for chain in chains:
        assert sorted(chain.members) == members and chain.fanout == fanout
        assert depth_of(chain) <= MAX_DEPTH
        fed = [child for member in chain.members for child in chain.children(member)]
        assert sorted(fed) == sorted(chain.members[1:])  # each fed exactly once, the root by the publisher
        for member in chain.members:
            copies[member] += len(chain.children(member)) / stripes
            for child in chain.children(member):
                assert chain.parent(child) == member
    assert len({c.members[0] for c in chains}) == stripes  # distinct seeds
    # Like a chain, no member uploads much more than one copy of a version.
    assert max(copies.values()) <= 1.0 + 1e-9
    assert sum(copies.values()) == pytest.approx(n - 1)


def test_striped_trees_keep_the_stripe_count_and_the_depth_bound() -> None:
    stripes, chains = relay_plan(names(200), "striped", 3)
    assert stripes == 3 and all(depth_of(c) <= MAX_DEPTH for c in chains)
    assert len({c.members[0] for c in chains}) == 3
    # Up to the bound striped mode keeps its rotated chains.
    stripes, chains = relay_plan(names(5), "striped", 3)
    assert all(c.fanout == 1 and depth_of(c) == 5 for c in chains)


@pytest.mark.parametrize("n", [4, 40])
def test_members_marked_leaves_forward_to_nobody_and_come_last(n: int) -> None:
    members = names(n)
    slow = {members[0], members[2]}
    _, chains = relay_plan(members, "relay", leaves=slow)
    for chain in chains:
        assert chain.members[-2:] == [members[0], members[2]]
        # Nobody else waits for them: in a chain one feeds the other, in a tree neither feeds.
        assert all(set(chain.children(m)) <= slow for m in slow)
        if chain.fanout > 1:
            assert all(not chain.children(m) for m in slow)


@pytest.mark.parametrize(("n", "mode"), [(5, "relay"), (100, "relay"), (40, "striped"), (3, "star")])
def test_each_member_is_sent_its_own_place_in_the_trees(n: int, mode: str) -> None:
    members = names(n)
    stripes, trees = relay_plan(members, mode, 2)
    plan = RelayPlan(
        incarnation=0,
        version=3,
        stripes=stripes,
        chains=[],
        addresses={m: f"tcp://{m}:1" for m in members},
        publisher="pub",
        stream_secret=b"k" * 32,
    )
    for member in members:
        view = member_view(plan, trees, member)
        assert (view.stripes, view.publisher, view.stream_secret) == (stripes, "pub", b"k" * 32)
        assert all(len(c.members) <= 2 and member in c.members for c in view.chains)
        for tree in trees:
            # Read as chains (the next member of each chain it heads; the one before it in
            # each chain), the view says what the tree says: whom to feed, whom to admit.
            mine = [c for c in view.chains if c.stripe == tree.stripe]
            fed = [c.members[1] for c in mine if c.members[0] == member and len(c.members) == 2]
            feeders = [c.members[0] for c in mine if c.members[-1] == member and len(c.members) == 2]
            assert fed == tree.children(member)
            assert feeders == ([p] if (p := tree.parent(member)) else [])
            assert mine, "a member in the plan is in a chain of every stripe"
        assert set(view.addresses) == {m for t in trees for m in t.children(member)}
    outsider = member_view(plan, trees, "late")
    assert outsider.chains == [] and outsider.stream_secret == b"k" * 32


def test_plans_and_manifests_go_out_in_the_order_chunks_reach_members() -> None:
    _, trees = relay_plan(names(40), "relay")
    order = reach_order(trees)
    assert sorted(order) == names(40)
    assert set(order[: len(trees)]) == {t.members[0] for t in trees}  # the seeds first
    # Then by depth: a member is sent its plan no later than those one level deeper in
    # the tree where it sits highest.
    place = {m: i for i, m in enumerate(order)}
    depth = {m: min(t.members.index(m) for t in trees) for m in order}
    assert all(place[a] < place[b] for a in order for b in order if depth[a] < depth[b])


def test_placement_sends_a_member_that_lags_its_feeders_to_the_tail() -> None:
    placement = Placement()
    chain = [RelayTree(0, ["a", "b", "c", "d"])]
    # a (the head) takes 2 s to hold the version, the others a few ms after their feeder.
    for _ in range(2):
        placement.observe(chain, {"a": 2.0, "b": 2.01, "c": 2.02, "d": 2.03}, elapsed_s=3.0)
    order, leaves = placement.order(["a", "b", "c", "d"])
    assert order == ["b", "c", "d", "a"] and leaves == {"a"}
    assert relay_plan(order, "relay", leaves=leaves)[1][0].members == ["b", "c", "d", "a"]
    # Measured well again, it comes back (hysteresis: not at the first good version).
    for _ in range(10):
        placement.observe([RelayTree(0, ["b", "c", "d", "a"])], {"b": 0.01, "c": 0.02, "d": 0.03, "a": 0.04}, 1.0)
    assert placement.order(["a", "b", "c", "d"]) == (["a", "b", "c", "d"], set())


def test_placement_charges_a_member_that_never_finishes_though_its_feeders_did() -> None:
    placement = Placement()
    chain = [RelayTree(0, ["a", "b", "c"])]
    placement.observe(chain, {"a": 0.01}, elapsed_s=4.0)  # b never held it; c could not (b feeds it)
    assert placement.lag_s("b") == pytest.approx(3.99)
    assert placement.lag_s("c") is None  # nothing to tell: its feeder never held it
    order, leaves = placement.order(["a", "b", "c"])
    assert order[-1] == "b" and not leaves  # a chain's tail; too few members to spare a leaf


def test_placement_charges_a_member_whose_best_served_child_lags_then_forgets() -> None:
    placement = Placement(forget_after=3, max_leaf_fraction=0.5)
    tree = [RelayTree(0, ["r", "x", "y", "a", "b", "c", "d"], 2)]
    # x (children a, b) forwards slowly: even its better-served child lags 1.5 s.
    ready = {"r": 0.01, "x": 0.02, "y": 0.03, "a": 1.6, "b": 1.7, "c": 0.04, "d": 0.05}
    placement.observe(tree, ready, elapsed_s=2.0)
    placement.observe(tree, ready, elapsed_s=2.0)
    _, leaves = placement.order(list(ready))
    assert "x" in leaves and "y" not in leaves
    # As a leaf it feeds nobody; after ``forget_after`` versions it may forward again.
    leafy = [RelayTree(0, ["r", "y", "c", "d", "a", "b", "x"], 2)]
    for _ in range(3):
        placement.observe(leafy, dict.fromkeys(ready, 0.05), elapsed_s=1.0)
    assert "x" not in placement.order(list(ready))[1]


def test_placement_of_unmeasured_and_departed_members() -> None:
    placement = Placement()
    assert placement.order(["b", "a"]) == (["a", "b"], set())
    placement.observe([RelayTree(0, ["a", "b"])], {"a": 5.0, "b": 5.01}, 6.0)
    placement.forget("a")
    assert placement.lag_s("a") is None and placement.order(["a", "b", "c"])[1] == set()


@pytest.mark.parametrize(
    "link",
    [LinkSpec(latency_ms=800.0), LinkSpec(downlink_mbps=4.0)],
    ids=["far: 800 ms one way", "slow: 4 Mbit/s down"],
)
async def test_a_slow_or_far_member_goes_to_the_tail_and_the_others_install_without_waiting(link: LinkSpec) -> None:
    """Issue 13 item 3: chains ordered by measurement, not by name. ``a-slow`` sorts first
    by name, so the first version's chain waits on it; once measured, it is the tail, and
    every other member holds the next version before it does."""
    async with harness(mode="relay", medium="tcp") as h:
        h.add("a-slow", link=link)
        others = ["b", "c", "d"]
        for name in others:
            h.add(name)
        await h.broadcaster.wait_members(4)
        h.broadcaster.publish_nowait(snapshot(1, nbytes=8 * CHUNK))  # ~1 s for the slow one
        await h.wait_complete(["a-slow", *others], 1)
        assert h.broadcaster.relay_trees[0].members[0] == "a-slow"  # by name: unmeasured
        snap = snapshot(2, nbytes=8 * CHUNK)
        h.broadcaster.publish_nowait(snap)
        await h.wait_complete(others, 2)
        assert not any(a.key[1] == 2 for a in h.complete["a-slow"]), "the others waited for the slow member"
        assert h.broadcaster.relay_trees[0].members == [*others, "a-slow"]
        await h.wait_complete(["a-slow"], 2)
        assert all(equal_to(h.complete[name][-1], snap) for name in ["a-slow", *others])


@pytest.mark.parametrize("medium", ["inproc", "tcp"])
async def test_a_relay_tree_delivers_digest_equal_versions_to_every_member(medium: str) -> None:
    async with harness(mode="relay", medium=medium) as h:
        h.broadcaster.max_depth = 3  # 7 members: 2 stripes, each a binary tree
        members = names(7)
        for name in members:
            h.add(name)
        await h.broadcaster.wait_members(len(members))
        for version in (1, 2):
            snap = snapshot(version)
            h.broadcaster.publish_nowait(snap)
            await h.wait_complete(members, version)
            assert all(equal_to(h.complete[name][-1], snap) for name in members)
        trees = h.broadcaster.relay_trees
        assert len(trees) == 2 and all(t.fanout == 2 for t in trees)
        stats = [h.receivers[name].statistics() for name in members]
        assert sum(s["chunks_forwarded"] for s in stats) > 0
        assert all(s["repair_requests"] == 0 for s in stats), stats
        async with asyncio.timeout(5):
            assert await h.broadcaster.wait_bcast((1, 2)) > 0


async def test_a_sealed_relay_tree_admits_each_member_s_feeders_and_no_one_else() -> None:
    """Under [security] an inbox admits the publisher and whoever feeds it in the plan:
    in a tree each member's view names its parent in every stripe, so every stream is
    admitted and none refused, and every member installs the plaintext."""
    async with sealed_run(mode="relay") as run:
        run.broadcaster.max_depth = 3  # 7 members: 2 stripes, each a binary tree
        members = names(7)
        for name in members:
            run.add(name)
        await run.broadcaster.wait_members(len(members))
        snap = sealed_snapshot(1)
        run.broadcaster.publish_nowait(snap)
        await run.wait_version(members, 1)
        stats = {name: run.receivers[name].statistics() for name in members}
    assert all(np.array_equal(run.complete[n][-1].plaintext, snap.data) for n in members)
    assert sum(s["chunks_forwarded"] for s in stats.values()) > 0
    assert all(s["stream_refused"] == s["stream_refused_handshake"] == 0 for s in stats.values()), stats
    assert all(s["repair_requests"] == 0 for s in stats.values()), stats
