"""Delta-coded weight versions: the codec bit for bit, the dense fallback, and delta
versions over the relay (base mismatch, a dishonest payload, loss and repair)."""

from __future__ import annotations

import concurrent.futures
import random
import re

import msgspec
import numpy as np
import pytest
from tests.test_weights_relay import CHUNK, equal_to, harness

from echo2.messages import PolicyVersion, Snapshot, WeightChunk
from echo2.weights.broadcaster import DeltaForm
from echo2.weights.chunks import digest, flatten_tensors, make_manifest
from echo2.weights.delta import (
    BITMAP,
    GAPS,
    RAW,
    SAME,
    SEGMENT,
    DeltaError,
    DeltaRebuild,
    DeltaStats,
    decode,
    delta_manifest,
    encode,
    payload_chunk_bytes,
)

SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-45], dtype=np.float32)


def state(rng: np.random.Generator, elements: int = 300_000) -> dict[str, np.ndarray]:
    """bf16 bit patterns (uint16), fp32 with NaN / inf / -0.0, int8, and an odd dtype."""
    f32 = rng.standard_normal(elements // 4).astype(np.float32)
    f32[: len(SPECIALS)] = SPECIALS
    return {
        "bf16": rng.integers(0, 1 << 16, elements, dtype=np.uint16),
        "f32": f32,
        "i8": rng.integers(-128, 128, 1001, dtype=np.int8),
        "c64": (rng.standard_normal(37) + 1j).astype(np.complex64),  # 8-byte items
        "rec": np.zeros(5, dtype="V3"),  # 3-byte items: compared byte by byte
    }


def changed(tensors: dict[str, np.ndarray], rng: np.random.Generator, fraction: float) -> dict[str, np.ndarray]:
    out = {}
    for name, array in tensors.items():
        flat = array.copy().reshape(-1).view(np.uint8 if array.dtype.kind == "V" else array.dtype)
        raw = flat.view(np.uint8)
        hit = rng.random(raw.nbytes) < fraction * (1 if array.dtype.kind in "Vi" else 1 / array.itemsize)
        raw[hit] ^= rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
        out[name] = flat.view(array.dtype).reshape(array.shape)
    if fraction > 0:
        out["f32"].reshape(-1)[: len(SPECIALS)] = SPECIALS[::-1]  # specials replaced by specials
    return out


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.2, 0.9])
def test_decode_rebuilds_the_new_state_bit_for_bit(fraction: float) -> None:
    rng = np.random.default_rng(int(fraction * 100))
    before = state(rng)
    specs, base = flatten_tensors(before)
    _, new = flatten_tensors(changed(before, rng, fraction))
    payload, stats = encode(new, base, specs, segment_bytes=64 * 1024)
    out = np.full_like(base, 0xAA)
    decode(payload, base, out)
    assert out.tobytes() == new.tobytes()  # NaN payloads, -0.0 and inf included
    assert stats.changed == 0 if fraction == 0 else stats.changed > 0
    if fraction <= 0.01:
        assert stats.ratio < 0.05


def test_each_segment_takes_the_smallest_form_and_dense_updates_fall_back_to_raw() -> None:
    rng = np.random.default_rng(1)
    n = 1 << 16
    base = rng.integers(0, 1 << 16, 4 * n, dtype=np.uint16)
    new = base.copy()
    new[n + 100] ^= 1  # segment 1: one change (gaps)
    new[2 * n : 3 * n : 2] ^= 1  # segment 2: half the elements (bitmap beats gaps... or raw)
    new[3 * n :] = rng.integers(0, 1 << 16, n, dtype=np.uint16)  # segment 3: all new (raw)
    specs, b = flatten_tensors({"w": base})
    _, a = flatten_tensors({"w": new})
    payload, stats = encode(a, b, specs, segment_bytes=2 * n)
    modes = [SEGMENT.unpack_from(payload, 16 + i * SEGMENT.size)[0] for i in range(stats.segments)]
    assert modes[0] == SAME and modes[1] == GAPS and modes[2] in (BITMAP, RAW) and modes[3] == RAW
    out = np.empty_like(b)
    decode(payload, b, out)
    assert np.array_equal(out, a)
    # A fully rewritten state costs no more than dense (plus the table).
    _, fresh = flatten_tensors({"w": rng.integers(0, 1 << 16, 4 * n, dtype=np.uint16)})
    payload, stats = encode(fresh, b, specs, segment_bytes=2 * n)
    assert stats.raw_segments == stats.segments and payload.nbytes <= b.nbytes + 16 + 4 * SEGMENT.size


def test_inconsistent_payloads_raise_delta_error() -> None:
    rng = np.random.default_rng(3)
    specs, base = flatten_tensors({"w": rng.integers(0, 255, 50_000, dtype=np.uint8)})
    new = base.copy()
    new[::97] ^= 1
    payload, _ = encode(new, base, specs, segment_bytes=8192)
    out = np.empty_like(base)
    for bad in (payload[:-1], payload[:10], np.concatenate([payload, payload[:1]])):
        with pytest.raises(DeltaError):
            decode(bad, base, out)
    flipped = payload.copy()
    flipped[0] ^= 1  # magic
    with pytest.raises(DeltaError):
        decode(flipped, base, out)
    with pytest.raises(DeltaError):
        decode(payload, base[:-1], out[:-1])  # a base of another size


# -- rebuilding while the payload arrives ------------------------------------------------


def rebuild_case(seed: int, fraction: float = 0.02) -> tuple[np.ndarray, np.ndarray, object]:
    """(base, new, delta manifest) of a state of many small segments, so that the segment
    table spans several payload chunks and records span chunk boundaries."""
    rng = np.random.default_rng(seed)
    before = state(rng, 200_000)
    specs, base = flatten_tensors(before)
    _, new = flatten_tensors(changed(before, rng, fraction))
    snap = Snapshot(incarnation=1, version=2, tensors=specs, data=new, created_at_s=0.0)
    payload, stats = encode(new, base, specs, segment_bytes=4096)
    manifest = make_manifest(snap, 64 * 1024)
    delta = delta_manifest(manifest, PolicyVersion(1, 1), payload, stats, chunk_bytes=1024)
    return base, payload, delta


def land(rebuild: DeltaRebuild, payload: np.ndarray, order: list[int]) -> None:
    m = rebuild.payload.manifest
    for index in order:
        data = payload[index * m.chunk_bytes : (index + 1) * m.chunk_bytes].copy()
        assert rebuild.payload.offer(WeightChunk(incarnation=1, version=2, index=index, data=data)) == "stored"


@pytest.mark.parametrize("order", ["in order", "reversed", "shuffled"])
def test_a_rebuild_while_the_payload_arrives_in_any_order_verifies_the_new_state(order: str) -> None:
    base, payload, delta = rebuild_case(5)
    assert payload_chunk_bytes(payload.nbytes, 64 * 1024) < 64 * 1024  # a small payload: small chunks
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rebuild = DeltaRebuild(delta, base, pool.submit)
        chunks = list(range(len(rebuild.payload.manifest.chunk_digests)))
        table_chunks = -(-(16 + 48 * 100) // rebuild.payload.manifest.chunk_bytes)
        assert len(chunks) > 8 and table_chunks > 1  # the table alone spans chunks
        if order == "reversed":
            chunks.reverse()  # nothing decodes until the table's first chunk: then all of it
        elif order == "shuffled":
            random.Random(1).shuffle(chunks)
        land(rebuild, payload, chunks[:-1])
        assert not rebuild.result.done()  # the last chunk's segments are still missing
        land(rebuild, payload, chunks[-1:])
        assert rebuild.result.result(timeout=30) is True, rebuild.error
    assert rebuild.state.complete
    rebuilt = np.empty_like(base)
    decode(payload, base, rebuilt)
    assert np.array_equal(rebuild.state.buffer, rebuilt)
    assert [digest(rebuild.state.buffer[i : i + 65536]) for i in range(0, base.nbytes, 65536)] == (delta.chunk_digests)


def test_a_rebuild_whose_payload_lies_fails_without_touching_the_base() -> None:
    """A payload whose chunks match their (signed) digests but which rebuilds another state,
    or whose table is inconsistent: the rebuild fails, saying why; the base is intact."""
    base, payload, delta = rebuild_case(6)
    base_version = PolicyVersion(1, 1)
    kept = base.copy()
    body = payload.copy()
    body[-1] ^= 0x55  # the last record: decodes (or not) to other bytes
    table = payload.copy()
    table[16 + 8] ^= 1  # segment 0's state offset
    for bad, why in ((body, "digest|decompress|size|range|bitmap"), (table, "cover")):
        lie = delta_manifest(
            msgspec.structs.replace(delta, delta=None),
            base_version,
            bad,
            DeltaStats(1, 1, 1, 1, 0, 1),
            chunk_bytes=1024,
        )
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            rebuild = DeltaRebuild(lie, base, pool.submit)
            land(rebuild, bad, list(range(len(rebuild.payload.manifest.chunk_digests))))
            assert rebuild.result.result(timeout=30) is False
        assert re.search(why, rebuild.error), rebuild.error
        assert not rebuild.state.complete
    assert np.array_equal(base, kept)


# -- over the relay ----------------------------------------------------------------------


def versions(count: int, nbytes: int = 40 * CHUNK, fraction: float = 0.02) -> list[Snapshot]:
    """bf16-like states where ``fraction`` of the elements change from one to the next."""
    rng = np.random.default_rng(11)
    w = rng.integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    out = []
    for version in range(1, count + 1):
        specs, flat = flatten_tensors({"w": w, "b": np.arange(7, dtype=np.float32)})
        out.append(Snapshot(incarnation=1, version=version, tensors=specs, data=flat, created_at_s=0.0))
        w = w.copy()
        hit = rng.random(len(w)) < fraction
        w[hit] ^= rng.integers(1, 8, int(hit.sum()), dtype=np.uint16)
    return out


async def publish(h, snap: Snapshot) -> DeltaForm | None:  # type: ignore[no-untyped-def]
    """What the WeightPublisher does: prepare, delta form, publish."""
    snap, manifest = h.broadcaster.prepare(snap)
    delta = h.broadcaster.prepare_delta(snap, manifest)
    h.broadcaster.publish_nowait(snap, manifest, delta)
    return delta


@pytest.mark.parametrize("medium", ["inproc", "tcp"])
async def test_delta_versions_relay_digest_equal_under_loss_with_a_corrupt_chunk(medium: str) -> None:
    rng = random.Random(5)
    corrupted: list[int] = []

    def fault(seed: str, chunk: WeightChunk) -> WeightChunk | None:
        if chunk.version == 3 and not corrupted:
            corrupted.append(chunk.index)
            bad = np.array(chunk.data)
            bad[-1] ^= 0xFF
            return WeightChunk(incarnation=1, version=3, index=chunk.index, data=bad)
        return None if rng.random() < 0.10 else chunk

    snaps = versions(4)
    async with harness(mode="relay", fault=fault, medium=medium, delta_anchor_every=3) as h:
        names = ["a", "b", "c"]
        for name in names:
            h.add(name, gap_timeout_s=0.2)
        await h.broadcaster.wait_members(3)
        forms = []
        for snap in snaps:
            forms.append(await publish(h, snap))
            await h.wait_complete(names, snap.version)
            await h.broadcaster.wait_installed(snap.policy_version, 3)
            for name in names:
                assert equal_to(h.complete[name][-1], snap)
        # v1 has no base, v2 and v3 are deltas, v4 is the anchor (every 3rd).
        assert [f is not None for f in forms] == [False, True, True, False]
        for form in forms[1:3]:
            assert form is not None and form.payload.nbytes < 0.1 * snaps[0].data.nbytes
        stats = [h.receivers[n].statistics() for n in names]
        assert [s["delta_versions"] for s in stats] == [2, 2, 2]
        assert sum(s["corrupt_chunks"] for s in stats) >= 1  # the altered payload chunk, repaired
        assert h.broadcaster.counters["delta_versions"] == 2
        assert h.broadcaster.counters["repair_chunks_sent"] > 0


async def test_a_member_without_the_base_gets_the_dense_form() -> None:
    snaps = versions(2)
    async with harness(mode="relay", delta_anchor_every=8) as h:
        names = ["a", "b"]
        for name in names:
            h.add(name)
        await h.broadcaster.wait_members(2)
        await publish(h, snaps[0])
        await h.wait_complete(names, 1)
        await h.broadcaster.wait_installed(snaps[0].policy_version, 2)
        # "b" lost its copy of v1 (say its engine reloaded): the publisher still thinks it
        # holds v1 and sends the delta form, which "b" cannot use.
        h.receivers["b"]._base = None
        assert await publish(h, snaps[1]) is not None
        await h.wait_complete(names, 2)
        assert equal_to(h.complete["a"][-1], snaps[1]) and equal_to(h.complete["b"][-1], snaps[1])
        b = h.receivers["b"].counters
        assert (b["delta_base_missing"], b["dense_requests"], b["delta_versions"]) == (1, 1, 0)
        assert h.receivers["a"].counters["delta_versions"] == 1
        assert h.broadcaster.counters["delta_dense_requests"] == 1


async def test_a_delta_that_rebuilds_the_wrong_state_keeps_the_previous_version_and_repairs_dense() -> None:
    """A dishonest (or buggy) publisher's payload: its chunks match its own digests, but the
    state it rebuilds does not match the full-state digests, so nothing is installed from
    it, and the member asks for the dense form."""
    snaps = versions(2)
    async with harness(mode="relay", delta_anchor_every=8) as h:
        h.add("a")
        await h.broadcaster.wait_members(1)
        await publish(h, snaps[0])
        await h.wait_complete(["a"], 1)
        await h.broadcaster.wait_installed(snaps[0].policy_version, 1)
        manifest = make_manifest(snaps[1], CHUNK)
        wrong = snaps[1].data.copy()
        wrong[1000] ^= 1
        payload, stats = encode(wrong, snaps[0].data, snaps[1].tensors)
        lie = DeltaForm(payload, delta_manifest(manifest, snaps[0].policy_version, payload, stats), stats, 0.0)
        h.broadcaster.publish_nowait(snaps[1], manifest, lie)
        await h.wait_complete(["a"], 2)
        counters = h.receivers["a"].counters
        assert counters["delta_rejected"] == 1 and counters["dense_requests"] == 1
        assert [c.key.version for c in h.complete["a"]] == [1, 2]  # never the wrong state
        assert equal_to(h.complete["a"][-1], snaps[1])
        assert digest(h.complete["a"][-1].buffer) != digest(wrong)


@pytest.mark.parametrize("anchor_every", [0, 4])
async def test_a_member_keeps_its_delta_base_only_while_the_publisher_codes_deltas(anchor_every: int) -> None:
    """Keeping the last state as a delta base costs a whole state per member: with delta
    versions off (the default) no member holds one once the version is handed on."""
    snaps = versions(2)
    async with harness(mode="relay", delta_anchor_every=anchor_every) as h:
        h.add("a")
        await h.broadcaster.wait_members(1)
        for snap in snaps:
            await publish(h, snap)
            await h.wait_complete(["a"], snap.version)
            await h.broadcaster.wait_installed(snap.policy_version, 1)
        receiver = h.receivers["a"]
        held = receiver._base
        if anchor_every:
            assert held is not None and held[0] == snaps[1].policy_version
            assert receiver.counters["delta_versions"] == 1
        else:
            assert held is None and receiver.counters["delta_versions"] == 0
        assert equal_to(h.complete["a"][-1], snaps[1])


async def test_a_version_with_a_quarter_of_its_elements_changed_goes_dense() -> None:
    """Rebuilding a dense-ish delta scatters much of the state: from DELTA_MAX_CHANGED of
    the elements changed the publisher sends the dense form, even when the payload is
    small (30% of bf16-like elements changed by a little compresses to far less than dense)."""
    async with harness(mode="relay", delta_anchor_every=8) as h:
        light, heavy = versions(2, fraction=0.02), versions(2, fraction=0.30)
        for snaps, coded in ((light, True), (heavy, False)):
            h.broadcaster._delta_base = None
            await publish(h, snaps[0])
            snap, manifest = h.broadcaster.prepare(snaps[1])
            form = h.broadcaster.prepare_delta(snap, manifest)
            assert (form is not None) == coded
        assert h.broadcaster.counters["delta_fallbacks"] == 1
