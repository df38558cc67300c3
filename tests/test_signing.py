"""Signed manifests: samplers install only weights the learner's key signed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from tests.test_weights_relay import CHUNK, equal_to, harness, snapshot

from echo2.tools.keys import main as keys_main
from echo2.weights.chunks import ManifestRejected, make_manifest
from echo2.weights.signing import ManifestSigner, ManifestVerifier


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert keys_main([str(tmp_path), "--sign", "learner", "forger"]) == 0
    return tmp_path


def test_signature_covers_identity_layout_and_digest(keys: Path) -> None:
    signer = ManifestSigner(keys / "learner.sign.pem")
    verifier = ManifestVerifier(keys / "learner.sign.pub.pem")
    manifest = signer.sign(make_manifest(snapshot(3), CHUNK))
    verifier.verify(manifest)
    for change in ({"version": 4}, {"incarnation": 2}, {"digest": b"\0" * 32}, {"total_bytes": 1}):
        with pytest.raises(ManifestRejected):
            verifier.verify(msgspec.structs.replace(manifest, **change))
    with pytest.raises(ManifestRejected, match="not signed"):
        verifier.verify(make_manifest(snapshot(3), CHUNK))
    forged = ManifestSigner(keys / "forger.sign.pem").sign(make_manifest(snapshot(3), CHUNK))
    with pytest.raises(ManifestRejected, match="bad manifest signature"):
        verifier.verify(forged)


async def test_receivers_install_only_the_learners_signed_versions(keys: Path) -> None:
    learner = ManifestSigner(keys / "learner.sign.pem")
    forger = ManifestSigner(keys / "forger.sign.pem")
    verify = ManifestVerifier(keys / "learner.sign.pub.pem").verify
    async with harness(mode="relay") as h:
        h.add("s0", verify_manifest=verify)
        await h.broadcaster.wait_members(1)
        forged = snapshot(1)
        h.broadcaster.publish_nowait(forged, forger.sign(make_manifest(forged, CHUNK)))
        async with asyncio.timeout(10):
            while h.receivers["s0"].statistics()["manifests_rejected"] == 0:
                await asyncio.sleep(0.01)
        assert h.complete["s0"] == []
        good = snapshot(2)
        h.broadcaster.publish_nowait(good, learner.sign(make_manifest(good, CHUNK)))
        await h.wait_complete(["s0"], 2)
        assert equal_to(h.complete["s0"][-1], good)
        assert [a.key[1] for a in h.complete["s0"]] == [2]
