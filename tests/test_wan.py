"""The WAN test bed (benchmarks/wan): its network comes and goes cleanly, its links do what
they are set to, and the main job trains across hosts with one launcher per namespace.

Needs root and network namespaces; skipped with the reason otherwise. One bed at a time
per prefix: these tests use their own prefix, so a benchmark running beside them keeps its bed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is a package at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks.wan import netbed  # noqa: E402
from benchmarks.wan.bench import TOPOLOGY, bed_hosts, job_overrides  # noqa: E402
from benchmarks.wan.job import JobResult, run_job  # noqa: E402
from benchmarks.wan.netbed import Bed, LinkShape, nat_available  # noqa: E402
from benchmarks.wan.probe import validate  # noqa: E402

PREFIX = "e2wantest"
_unavailable = netbed.available()
pytestmark = pytest.mark.skipif(_unavailable is not None, reason=_unavailable or "")


def _namespaces() -> list[str]:
    return netbed.namespaces_with_prefix(PREFIX)


def test_the_bed_is_torn_down_on_error_and_a_stale_one_at_the_next_start() -> None:
    hosts = {"learner": ("10.77.0.1", LinkShape()), "edge-a": ("10.77.0.2", LinkShape(rate_mbit=50, delay_ms=5))}
    with pytest.raises(RuntimeError, match="boom"), Bed(hosts, prefix=PREFIX) as bed:
        assert sorted(_namespaces()) == sorted([f"{PREFIX}-sw", f"{PREFIX}-learner", f"{PREFIX}-edge-a"])
        sleeper = bed.popen("edge-a", ["sleep", "60"])
        raise RuntimeError("boom")
    assert _namespaces() == []
    assert sleeper.poll() is not None, "a process the bed started outlived it"
    # A crashed run leaves a namespace with a process inside: the next bed removes both.
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-edge-z"], check=True)
    stale = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-edge-z", "sleep", "60"])
    assert netbed.wait_for(
        lambda: bool(
            subprocess.run(["ip", "netns", "pids", f"{PREFIX}-edge-z"], capture_output=True, text=True).stdout.strip()
        ),
        10,
    )
    with Bed(hosts, prefix=PREFIX):
        assert f"{PREFIX}-edge-z" not in _namespaces()
    assert stale.wait(timeout=10) == -9
    assert _namespaces() == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_links_have_the_configured_delay_loss_and_rate() -> None:
    shaped = LinkShape(rate_mbit=40, delay_ms=20, loss=0.02)
    hosts = {"learner": ("10.77.0.1", LinkShape()), "edge-a": ("10.77.0.2", shaped)}
    with Bed(hosts, prefix=PREFIX, congestion_control="bbr") as bed:
        link = validate(bed, "learner", "edge-a", pings=500, gap_ms=2.0, bulk_s=4.0)
    assert link["rtt_ms_configured"] == 40.0
    assert 40.0 <= link["rtt_ms_median"] <= 50.0, link  # the relay adds ~1-2 ms per direction
    # 500 probes, round-trip loss 1 - 0.98^2 = 3.96%: binomial sd 0.87%, so +-2.5 sd.
    assert 0.018 <= link["loss_round_trip_measured"] <= 0.062, link
    assert link["tcp_goodput_mbit"] <= 40.0 * 1.02, link  # the tbf cap holds
    assert link["tcp_goodput_mbit"] >= 40.0 * 0.3, link  # and bbr gets a fair share of it through 2% loss


@pytest.fixture(scope="module")
def multihost_run(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """The example multi-host topology, learner and two edges, 10 ms each way on the edges."""
    hosts = bed_hosts(TOPOLOGY, LinkShape(rate_mbit=100, delay_ms=10), ["learner", "edge-a", "edge-b"])
    overrides = [*job_overrides(30.0), "actors.learner.config.max_steps=20"]
    with Bed(hosts, prefix=PREFIX) as bed:
        return run_job(
            bed, TOPOLOGY, tmp_path_factory.mktemp("wan"), learner_host="learner", overrides=overrides,
            exit_grace_s=10.0, timeout_s=200.0,
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_trains_across_hosts_and_every_launcher_exits(multihost_run: JobResult) -> None:
    run = multihost_run
    assert run.exit_codes["learner"] == 0, run.run_dirs["learner"]
    assert run.summary["steps"] == 20 and run.summary["stopped_by"] == "max_steps"
    for edge, sampler in (("edge-a", "sampler-a"), ("edge-b", "sampler-b")):
        assert any(e["sampler"] == sampler for e in run.accepted), f"{sampler} delivered nothing"
        assert max(run.installs.get(sampler, [-1])) > 0, f"{sampler} installed no trained version"
        assert run.link_bytes[edge]["rx_bytes"] >= run.broadcasts[0]["bytes"], "weights crossed no link"
        assert run.exit_codes[edge] is not None, f"{edge}'s launcher did not exit"
    assert run.audit["exit_code"] == 0, run.audit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_launcher_exits_by_itself_within_10_s_of_the_learner(multihost_run: JobResult) -> None:
    late = {h: t for h, t in multihost_run.exit_after_learner_s.items() if t is None or t > 10.0}
    assert not late, f"launchers still running 10 s after the learner's exited: {late}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_curve_across_hosts_trains_allowed_keys_and_refuses_an_unlisted_one(tmp_path: Path) -> None:
    """``[security] curve = true`` across namespaces: hosts whose keys are allowed train
    (weights sealed, every cross-host socket CURVE), and a host whose key is not on the
    allow-list is refused at the handshake: its sampler delivers nothing, the run goes on."""
    from echo2.tools.keys import main as make_keys

    keys = tmp_path / "keys"
    assert make_keys([str(keys), "learner", "edge-a", "edge-b"]) == 0
    (keys / "allowed").mkdir()
    for host in ("learner", "edge-a"):  # edge-b's public key is never handed to the owner
        (keys / "allowed" / f"{host}.key").write_bytes((keys / f"{host}.key").read_bytes())
    hosts = bed_hosts(TOPOLOGY, LinkShape(rate_mbit=100, delay_ms=10), ["learner", "edge-a", "edge-b"])
    overrides = [
        *job_overrides(30.0),
        "actors.learner.config.max_steps=12",
        "security.curve=true",
        f'security.keys_dir="{keys}"',
    ]
    with Bed(hosts, prefix=PREFIX) as bed:
        run = run_job(
            bed, TOPOLOGY, tmp_path / "job", learner_host="learner", overrides=overrides,
            exit_grace_s=5.0, timeout_s=200.0,
        )  # fmt: skip
    assert run.exit_codes["learner"] == 0, run.run_dirs["learner"]
    assert run.summary["steps"] == 12
    delivered = {e["sampler"] for e in run.accepted}
    assert "sampler-a" in delivered and max(run.installs.get("sampler-a", [-1])) > 0
    assert "sampler-b" not in delivered, "a host with an unlisted key delivered work"
    assert run.audit["exit_code"] == 0, run.audit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sampler_whose_link_drops_for_12_s_trains_again_after_it_returns(tmp_path: Path) -> None:
    """The issue's outage: 12 s of total loss on one edge once training runs. Before, the
    sampler reconnected and idled for the rest of the run (credit lost with the torn
    connection); now its work state repairs credit and leases, and it delivers again. The
    seconds it takes are the benchmark's to report (``python -m benchmarks.wan --conditions
    outage``); this checks that it happens and that nothing is lost or trained twice."""
    from benchmarks.wan.job import Outage

    hosts = bed_hosts(TOPOLOGY, LinkShape(rate_mbit=100, delay_ms=10), ["learner", "edge-a", "edge-b"])
    with Bed(hosts, prefix=PREFIX) as bed:
        run = run_job(
            bed, TOPOLOGY, tmp_path, learner_host="learner", overrides=job_overrides(45.0),
            outage=Outage("edge-b", after_s=10.0, duration_s=12.0), exit_grace_s=10.0, timeout_s=240.0,
        )  # fmt: skip
    assert run.outage is not None
    up = float(run.outage["up_unix_s"])
    after = [e for e in run.accepted if e["sampler"] == "sampler-b" and float(e["t"]) > up]
    assert after, "sampler-b delivered nothing after its link returned"
    assert run.audit["exit_code"] == 0, run.audit
    assert all(code == 0 for code in run.exit_codes.values()), run.exit_codes


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(nat_available() is not None, reason=nat_available() or "")
def test_a_sampler_behind_nat_dials_for_its_weights_and_trains(tmp_path: Path) -> None:
    """edge-b sits behind a masquerading router that lets no connection in (its host says
    ``inbound = false``): its sampler dials the publisher, installs versions and delivers
    work, while edge-a takes its chunks on its relay inbox's fixed port."""
    hosts = bed_hosts(TOPOLOGY, LinkShape(rate_mbit=100, delay_ms=10), ["learner", "edge-a", "edge-b"])
    overrides = [*job_overrides(30.0), "actors.learner.config.max_steps=12", "hosts.edge-b.inbound=false"]
    with Bed(hosts, prefix=PREFIX, nat={"edge-b": "192.168.77.2"}) as bed:
        run = run_job(
            bed, TOPOLOGY, tmp_path / "job", learner_host="learner", overrides=overrides,
            exit_grace_s=10.0, timeout_s=200.0,
        )  # fmt: skip
    assert run.exit_codes["learner"] == 0, run.run_dirs["learner"]
    assert run.summary["steps"] == 12
    assert max(run.installs.get("sampler-b", [-1])) > 0, "the sampler behind NAT installed no trained version"
    assert any(e["sampler"] == "sampler-b" for e in run.accepted), "the sampler behind NAT delivered nothing"
    assert run.stats["weight_publisher"]["dialed_streams"] >= 1
    assert run.audit["exit_code"] == 0, run.audit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_trains_over_ipv6(tmp_path: Path) -> None:
    addresses = {"learner": "fd77::1", "edge-a": "fd77::2"}
    hosts = {name: (address, LinkShape() if name == "learner" else LinkShape(rate_mbit=100, delay_ms=10))
             for name, address in addresses.items()}  # fmt: skip
    overrides = [
        *job_overrides(90.0),
        "actors.learner.config.max_steps=6",
        *(f'hosts.{name}.address="{address}"' for name, address in addresses.items()),
    ]
    with Bed(hosts, prefix=PREFIX) as bed:
        run = run_job(
            bed, TOPOLOGY, tmp_path / "job", learner_host="learner", overrides=overrides,
            exit_grace_s=10.0, timeout_s=200.0,
        )  # fmt: skip
    assert run.exit_codes["learner"] == 0, run.run_dirs["learner"]
    assert run.summary["steps"] == 6
    assert max(run.installs.get("sampler-a", [-1])) > 0
    assert run.link_bytes["edge-a"]["rx_bytes"] >= run.broadcasts[0]["bytes"], "weights crossed no link"
    assert run.audit["exit_code"] == 0, run.audit
