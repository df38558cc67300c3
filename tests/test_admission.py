"""Admission of untrusted work: what a hostile sampler sends cannot be scored, trained or credited.

Unit tests drive ``echo2.actors.admission.check_group`` with one defect per case. The
pipeline test runs the real PromptSource, two Rewarders (samplers round-robin over them)
and the Buffer in one process, with an honest and a hostile sampler written here as small
actors on the same channels a foreign sampler would use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import msgspec
import numpy as np
import pytest
from tests.polling import until
from tests.test_actors import WINDOW, _group, lease_record

from echo2 import ledger
from echo2.actor import Actor, Port, run_until_stopped
from echo2.actors.admission import RejectionTracker, check_group, check_lease
from echo2.actors.buffer import Buffer
from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
from echo2.actors.rewarder import Rewarder
from echo2.job import JobConfig
from echo2.messages import (
    AdmissionWindow,
    Hello,
    RejectReason,
    RolloutGroup,
    TaskLease,
    Welcome,
    WorkRequest,
)
from echo2.models import CharTokenizer
from echo2.models.tokenizer import EOS_ID
from echo2.pipeline import Pipeline
from echo2.tasks.addition import reversed_sum

pytestmark = pytest.mark.timeout(60)

# -- one defect per case ----------------------------------------------------------------


def _replace(**fields: object) -> Callable[[RolloutGroup], RolloutGroup]:
    return lambda g: msgspec.structs.replace(g, **fields)


DEFECTS: dict[str, tuple[Callable[[RolloutGroup], RolloutGroup], RejectReason]] = {
    "another task": (_replace(task_id="other"), "wrong_task"),
    "another attempt": (_replace(attempt=3), "wrong_task"),
    "another sampler's name": (_replace(sampler_id="someone"), "wrong_task"),
    "version 1_000_000": (_replace(version=1_000_000), "unpublished_version"),
    "a later incarnation": (_replace(incarnation=1), "unpublished_version"),
    "a negative version": (_replace(version=-1), "unpublished_version"),
    "three completions for two": (
        _replace(offsets=np.array([0, 4, 8, 8], np.int32), texts=["a", "b", "c"], finish_reasons=["eos"] * 3),
        "wrong_group_size",
    ),
    "float token ids": (_replace(token_ids=np.zeros(8, np.float32)), "bad_shape"),
    "2-d logprobs": (_replace(logprobs=np.zeros((2, 4), np.float32)), "bad_shape"),
    "offsets past the tokens": (_replace(offsets=np.array([0, 4, 9], np.int32)), "bad_shape"),
    "offsets going back": (_replace(offsets=np.array([0, 6, 8], np.int32)[[0, 2, 1]]), "bad_shape"),
    "one logprob short": (_replace(logprobs=np.full(7, -0.5, np.float32)), "bad_shape"),
    "one text for two": (_replace(texts=["975"]), "bad_shape"),
    "a completion too long": (
        _replace(
            token_ids=np.zeros(20, np.int32),
            logprobs=np.full(20, -0.1, np.float32),
            offsets=np.array([0, 17, 20], np.int32),
        ),
        "too_long",
    ),
    "an id past the vocabulary": (
        _replace(token_ids=np.array([0, 1, 2, 15, 0, 0, 0, 0], np.int32)),
        "token_out_of_vocab",
    ),
    "a negative id": (_replace(token_ids=np.array([0, -1, 2, 3, 0, 0, 0, 0], np.int32)), "token_out_of_vocab"),
    "a NaN logprob": (_replace(logprobs=np.array([-0.5, np.nan] + [-0.5] * 6, np.float32)), "bad_logprobs"),
    "an infinite logprob": (_replace(logprobs=np.array([-np.inf] + [-0.5] * 7, np.float32)), "bad_logprobs"),
    "a positive logprob": (_replace(logprobs=np.array([0.5] + [-0.5] * 7, np.float32)), "bad_logprobs"),
    "another prompt": (_replace(prompt_token_ids=np.arange(1, 9, dtype=np.int32)), "prompt_mismatch"),
    "a shorter prompt": (_replace(prompt_token_ids=np.arange(7, dtype=np.int32)), "prompt_mismatch"),
}


def test_a_well_formed_group_of_its_lease_is_admitted() -> None:
    group = _group("t", version=0)
    record = lease_record(group)
    assert check_lease(group, record) is None
    assert check_group(group, record, WINDOW) is None


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_defect_is_rejected_with_its_reason(defect: str) -> None:
    edit, reason = DEFECTS[defect]
    honest = _group("t", version=0)
    record = lease_record(honest)
    found = check_group(edit(honest), record, WINDOW)
    assert found is not None and found[0] == reason, found


def test_a_group_without_its_leases_token_or_lease_is_not_the_holders() -> None:
    group = _group("t", version=0)
    assert check_lease(group, None) is not None and check_lease(group, None)[0] == "unknown_lease"  # type: ignore[index]
    forged = msgspec.structs.replace(group, lease_token=b"\x00" * 16)
    assert check_lease(forged, lease_record(group)) == ("wrong_token", "the lease's token was not echoed")


def test_a_version_older_than_the_bound_is_stale() -> None:
    group = _group("t", version=2)
    window = AdmissionWindow(incarnation=0, newest=7, oldest=4, vocab_size=15)
    assert check_group(group, lease_record(group), window) == ("stale_version", "version 2 < 4")
    assert check_group(msgspec.structs.replace(group, version=4), lease_record(group), window) is None


def test_rejections_quarantine_only_within_the_window() -> None:
    now = [0.0]
    tracker = RejectionTracker(limit=3, window_s=10.0, clock=lambda: now[0])
    assert not tracker.add("s") and not tracker.add("s")
    now[0] = 11.0  # both fell out of the window
    assert not tracker.add("s") and not tracker.add("other")
    assert not tracker.add("s") and tracker.add("s")


# -- a running pipeline: honest and hostile samplers ------------------------------------

TOKENIZER = CharTokenizer()


class OldRolloutGroup(RolloutGroup, frozen=True, tag="RolloutGroup"):
    """A group from a sampler of the earlier protocol revision, which sent the answer back."""

    answer: str = ""


def answer_group(lease: TaskLease, name: str, texts: list[str], **fields: object) -> RolloutGroup:
    """A well-formed group for ``lease`` whose completions are ``texts``."""
    ids = [[*TOKENIZER.encode(t), EOS_ID] for t in texts]
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int32)
    values = dict(
        lease_id=lease.lease_id,
        task_id=lease.task_id,
        attempt=lease.attempt,
        sampler_id=name,
        incarnation=0,
        version=0,
        prompt=lease.prompt,
        prompt_token_ids=np.asarray(TOKENIZER.encode_prompt(lease.prompt), np.int32),
        token_ids=np.concatenate([np.asarray(i, np.int32) for i in ids]),
        logprobs=np.full(int(offsets[-1]), -0.25, np.float32),
        offsets=offsets,
        texts=texts,
        finish_reasons=["eos"] * len(texts),
        lease_token=lease.token,
    )
    values.update(fields)
    cls = OldRolloutGroup if "answer" in values else RolloutGroup
    return cls(**values)  # type: ignore[arg-type]


def right_answer(lease: TaskLease) -> str:
    a, b = lease.prompt.rstrip("=").split("+")
    return reversed_sum(int(a), int(b))


def hostile_groups(leases: list[TaskLease], name: str) -> list[RolloutGroup]:
    """One group per lease, each wrong in its own way (the first claims every answer right)."""
    lease = leases[0]
    g = lease.group_size
    wrong = ["000"] * g
    out = [answer_group(lease, name, wrong, answer="000")]  # forged answer, old key
    edits: list[dict[str, object]] = [
        {"lease_token": b"\x01" * 16},
        {"attempt": 7},
        {"version": 1_000_000},
        {"token_ids": None},  # OOV, filled below
        {"logprobs": None},  # NaN
        {"offsets": None},  # inconsistent
        {"texts": None},  # a right answer's text over the ids of a wrong one
    ]
    for lease, edit in zip(leases[1:], edits, strict=False):
        group = answer_group(lease, name, [right_answer(lease)] * g)
        if "token_ids" in edit:
            edit = {"token_ids": group.token_ids + 100}
        elif "logprobs" in edit:
            edit = {"logprobs": np.full_like(group.logprobs, np.nan)}
        elif "offsets" in edit:
            edit = {"offsets": group.offsets[::-1].copy()}
        elif "texts" in edit:
            group, edit = answer_group(lease, name, wrong), {"texts": group.texts}
        out.append(msgspec.structs.replace(group, **edit))
    for lease in leases[1 + len(edits) :]:  # the rest: over-long completions
        out.append(answer_group(lease, name, ["1" * 9] * g))
    return out


class ScriptedSampler(Actor):
    """A sampler without an engine: it answers its leases with ``script(leases)``'s groups.

    ``hold`` leases are collected before anything is sent (so a hostile burst is one
    batch); an honest one (``hold = 1``) answers each lease correctly and asks for the next.
    """

    kind: ClassVar[str] = "scripted_sampler"
    ports: ClassVar[dict[str, Port]] = {"tasks": Port("dealer", bind=False), "rollouts": Port("push", bind=False)}
    script: Callable[[list[TaskLease], str], list[RolloutGroup]] = staticmethod(
        lambda leases, name: [answer_group(lease, name, [right_answer(lease)] * lease.group_size) for lease in leases]
    )
    hold = 1
    extra: Callable[[TaskLease, str], list[RolloutGroup]] | None = None

    async def setup(self, ctx) -> None:  # type: ignore[no-untyped-def]
        await super().setup(ctx)
        self._tasks = ctx.open("tasks", identity=self.name.encode())
        self._rollouts = ctx.open("rollouts")
        self.leases_received = 0

    async def run(self) -> None:
        await run_until_stopped(self.ctx.stopping, self._serve())

    async def _serve(self) -> None:
        await self._tasks.send(Hello(peer_id=self.name, role="sampler"))
        while not isinstance(await self._tasks.recv(), Welcome):
            pass
        await self._tasks.send(WorkRequest(sampler_id=self.name, credits=self.hold, incarnation=0, installed_version=0))
        held: list[TaskLease] = []
        while True:
            for message in await self._tasks.recv_many():
                if isinstance(message, TaskLease):
                    self.leases_received += 1
                    held.append(message)
            if len(held) < self.hold:
                continue
            for group in self.script(held, self.name):
                await self._rollouts.send(group)
            if self.extra is not None:
                for group in self.extra(held[0], self.name):
                    await self._rollouts.send(group)
            await self._tasks.send(
                WorkRequest(sampler_id=self.name, credits=len(held), incarnation=0, installed_version=0)
            )
            held = []


async def test_hostile_sampler_is_refused_counted_quarantined_and_honest_work_goes_on(tmp_path: Path) -> None:
    tasks = 40
    job = JobConfig(group_size=2, groups_per_step=4, staleness=1, max_new_tokens=5)
    source = PromptSource(
        "prompt_source",
        PromptSourceConfig(max_tasks=tasks, max_inflight_groups=1000, quarantine_rejections=6, lease_ttl_s=30.0),
        job,
    )
    rewarders = [Rewarder("rewarder-0", job=job), Rewarder("rewarder-1", job=job)]
    buffer = Buffer("buffer", job=job)
    honest = ScriptedSampler("honest", job=job)
    evil = ScriptedSampler("evil", job=job)
    evil.hold = 9
    evil.script = hostile_groups  # type: ignore[method-assign,assignment]

    def framing(lease: TaskLease, name: str) -> list[RolloutGroup]:
        # Forgeries in the honest sampler's name, without any lease's token: counted under
        # the name they claim, and neither quarantine it nor touch the lease.
        group = answer_group(lease, "honest", [right_answer(lease)] * lease.group_size)
        return [msgspec.structs.replace(group, lease_token=bytes([i]) * 16) for i in range(10)]

    evil.extra = framing
    # The hostile sampler connects first and takes the first leases.
    async with Pipeline([source, *rewarders, buffer, evil, honest], run_dir=tmp_path) as pipeline:
        await until(lambda: buffer.counters["groups_stored"] >= tasks, 40, "every task stored once")
        stats, ps = buffer.statistics(), source.statistics()
        pipeline.request_stop()

    # Quarantine acts when the rejections come back, so the hostile sampler may have had
    # another burst of leases or two meanwhile: every burst is refused the same way.
    evil_rejections = stats.rejected_by_sampler["evil"]
    reasons = {
        "wrong_token",
        "wrong_task",
        "unpublished_version",
        "token_out_of_vocab",
        "bad_logprobs",
        "bad_shape",
        "too_long",
    }
    assert set(evil_rejections) == reasons, evil_rejections
    # Framed: counted under the name claimed, and nothing more. (``unknown_lease`` once the
    # lease they name has closed; which one depends on which Rewarder looks first.)
    framed = stats.rejected_by_sampler["honest"]
    assert sum(framed.values()) % 10 == 0 and set(framed) <= {"wrong_token", "unknown_lease"}, framed
    assert ps.quarantined_samplers == 1 and source._quarantined == {"evil"}
    assert ps.leases_rejected >= 6  # the holder's own rejections (a wrong token proves nothing)
    rejected = sum(evil_rejections.values()) + sum(framed.values())
    assert sum(r.counters["groups_rejected"] for r in rewarders) == rejected
    assert all(r.counters["groups_scored"] > 0 for r in rewarders), "both rewarders scored"

    events = ledger.read([tmp_path]).events
    accepted = {e.task: e for e in events if isinstance(e, ledger.Accepted)}
    assert len(accepted) == tasks  # each task stored once: rejected leases were re-issued
    # Forged groups were admitted (well-formed), but scored against the trusted answer, on
    # the text the trusted side decodes from their ids (not the texts they claim).
    stored = {g.group.task_id: g for g in buffer._store}
    forged = [t for t, e in accepted.items() if e.sampler == "evil"]
    assert forged and all(stored[t].rewards.tolist() == [0.0, 0.0] for t in forged)
    honest_rewards = [stored[t].rewards.tolist() for t, e in accepted.items() if e.sampler == "honest"]
    assert len(honest_rewards) == tasks - len(forged) and all(r == [1.0, 1.0] for r in honest_rewards)
    # Every task whose holder was rejected was re-issued, and stored from the honest sampler.
    rejected_tasks = {e.task for e in events if isinstance(e, ledger.Rejected) and e.holder}
    assert len(rejected_tasks) >= 6 and all(accepted[t].sampler == "honest" for t in rejected_tasks)
    assert [e.sampler for e in events if isinstance(e, ledger.Quarantined)] == ["evil"]


async def test_a_sampler_too_old_to_be_trained_from_gets_no_leases_until_it_installs(transport) -> None:  # type: ignore[no-untyped-def]
    from tests.test_actors import running

    from echo2.messages import LearnerProgress

    source = PromptSource("ps", job=JobConfig(staleness=1, groups_per_step=2))
    async with running(source, transport) as p:
        sampler = transport.dealer(name="s0", connect=[f"inproc://{p}/tasks"], identity=b"s0")
        completions = transport.push(name="buf.completions", connect=[f"inproc://{p}/completions"])
        try:
            # The learner is at version 5, S = 1: work from versions below 4 cannot train.
            await completions.send(LearnerProgress(next_version=5, groups_trained=0, groups_dropped_after_store=0))
            await until(lambda: source._next_version == 5, 10, "the learner's progress")
            await sampler.send(Hello(peer_id="s0", role="sampler"))
            assert isinstance(await sampler.recv(), Welcome)
            await sampler.send(WorkRequest(sampler_id="s0", credits=2, incarnation=0, installed_version=3))
            await until(lambda: source.counters["leases_withheld_old_version"] > 0, 10, "the request to be weighed")
            assert source.counters["leases_issued"] == 0
            # Installing version 4 is reported with no new credit; the credit it held is served.
            await sampler.send(WorkRequest(sampler_id="s0", credits=0, incarnation=0, installed_version=4))
            leases = [await sampler.recv(), await sampler.recv()]
            assert all(isinstance(lease, TaskLease) and lease.token and len(lease.token) == 16 for lease in leases)
            assert leases[0].token != leases[1].token
            assert not hasattr(leases[0], "answer")
        finally:
            sampler.close()
            completions.close()


# -- the main job under attack ----------------------------------------------------------


def attacked_run(tmp_path: Path, *, groups: int, steps: int) -> tuple[dict, object, list]:  # type: ignore[type-arg]
    """The main job with a hostile sampler beside the two honest ones (``benchmarks/hostile.py``
    runs it): (its figures, the audit, the ledger)."""
    import importlib.util

    from echo2.tools.audit import audit

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hostile.py"
    spec = importlib.util.spec_from_file_location("echo2_benchmark_hostile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = module.run_case(tmp_path / "attacked", steps=steps, groups=groups)
    assert figures["exit_code"] == 0, figures
    run = Path(figures["run_dir"])
    return figures, audit([run]), ledger.read([run]).events


@pytest.mark.slow  # a launched job: ~40 s on 2 busy cores (the pipeline test above is the short one)
@pytest.mark.timeout(200)
def test_the_main_job_trains_on_with_a_hostile_sampler_and_audits_clean(tmp_path: Path) -> None:
    figures, report, events = attacked_run(tmp_path, groups=600, steps=8)
    assert figures["steps"] == 8
    assert report.ok, report  # type: ignore[attr-defined]
    refused = report.rejected_by_sampler["evil"]  # type: ignore[attr-defined]
    # Each attack of the rotation that reached admission was refused for its own reason.
    assert {"unpublished_version", "token_out_of_vocab", "bad_logprobs", "bad_shape", "too_long"} <= set(refused)
    assert "evil" in report.quarantined  # type: ignore[attr-defined]
    trained_from = {e.sampler for e in events if isinstance(e, ledger.Trained)}
    assert {"sampler-0", "sampler-1"} <= trained_from
    impossible = [e for e in events if isinstance(e, ledger.Trained) and e.version > e.learner_version]
    assert impossible == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ten_thousand_hostile_groups_leave_the_learner_running_and_the_audit_clean(tmp_path: Path) -> None:
    from echo2.rundir import RunDir

    figures, report, _ = attacked_run(tmp_path, groups=10_000, steps=60)
    assert figures["steps"] == 60
    assert report.ok, report  # type: ignore[attr-defined]
    (done,) = RunDir(Path(figures["run_dir"])).metrics(
        "evil", "hostile_done"
    )  # every hostile group went out while training ran
    assert done["sent"] >= 10_000
    assert sum(report.rejected_by_sampler["evil"].values()) >= 9_000  # type: ignore[attr-defined]


async def test_a_sampler_whose_logprobs_stay_far_from_the_learners_is_quarantined(transport) -> None:  # type: ignore[no-untyped-def]
    from tests.test_actors import running

    config = PromptSourceConfig(quarantine_mismatch=0.5, quarantine_mismatch_steps=3)
    source = PromptSource("ps", config, JobConfig())
    async with running(source, transport):
        source.observe_mismatch(1, {"honest": 0.02, "liar": 2.0})
        source.observe_mismatch(1, {"honest": 0.02, "liar": 2.0})  # a heartbeat repeating step 1
        source.observe_mismatch(2, {"honest": -0.03, "liar": -1.5})
        assert source._quarantined == set()  # two steps, not three
        source.observe_mismatch(3, {"honest": 0.01, "liar": float("nan")})
        assert source._quarantined == {"liar"}
        assert source.statistics().quarantined_samplers == 1
        source.observe_mismatch(4, {"honest": 0.9})  # one step far off is not a streak
        assert source._quarantined == {"liar"}


def meta_reward(prompt, completion: str) -> float:  # type: ignore[no-untyped-def]
    """Test reward: what the trusted record's ``meta`` says, whatever the completion."""
    return float(prompt.meta["worth"]) if prompt.answer == "trusted" else -1.0


async def test_the_reward_sees_the_trusted_prompts_answer_and_meta(transport) -> None:  # type: ignore[no-untyped-def]
    from tests.test_actors import lease_records_served, running

    from echo2.messages import GroupRejected, ScoredGroup

    rewarder = Rewarder("rw", job=JobConfig(reward="tests.test_admission:meta_reward"))
    async with running(rewarder, transport) as p:
        rollouts = transport.push(name="s.rollouts", connect=[f"inproc://{p}/rollouts"])
        scored = transport.pull(name="buf.scored", bind=[f"inproc://{p}/peer-scored"])
        leases = transport.router(name="ps.leases", bind=[f"inproc://{p}/peer-leases"])
        try:
            group = _group("t", version=0)
            record = msgspec.structs.replace(lease_record(group, answer="trusted"), meta={"worth": 0.75})
            unknown = msgspec.structs.replace(group, lease_id=99)
            async with lease_records_served(leases, {group.lease_id: record}):
                await rollouts.send(
                    OldRolloutGroup(**{f: getattr(group, f) for f in group.__struct_fields__}, answer="x")
                )
                await rollouts.send(unknown)
                got = [await scored.recv(), await scored.recv()]
            (result,) = [m for m in got if isinstance(m, ScoredGroup)]
            (refused,) = [m for m in got if isinstance(m, GroupRejected)]
            assert result.rewards.tolist() == [0.75, 0.75]
            assert (refused.lease_id, refused.reason, refused.holder) == (99, "unknown_lease", False)
        finally:
            for endpoint in (rollouts, scored, leases):
                endpoint.close()
