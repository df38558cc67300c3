"""Learner: trains the policy with off-policy GRPO on admissible batches from the Buffer.

Role: the one expensive actor. Each step it asks the Buffer for ``groups_per_step``
admissible groups (``BatchRequest(version)``), packs them into training rows
(``echo2.rl.step.pack_groups``: group z-score advantages over the completions the Rewarder
kept) and hands the rows to its trainer (``echo2.training``), chosen by configuration:

* one AdamW step of ``echo2.rl.step.optimiser_step`` (the variant and every deviation are
  described there). By default (``old_policy = "sampler"``) pi_old of the PPO ratio is the
  policy that sampled each rollout: the clip is the trust region around it and the
  truncated IS weight is 1. With ``old_policy = "learner"`` pi_old is the learner's own
  policy at the step start: the ratio is 1, the clip inactive, and ``min(pi_learner /
  pi_sampler, is_cap)`` alone corrects for staleness. Token mean over every response token
  of the batch, optional ``kl_beta * k3`` to the initial policy, linear warm-up, gradient
  clipping. ``loss`` picks another off-policy correction instead (masked IS at the token,
  sequence or geometric-mean level, GSPO, CISPO: ``echo2.rl.corrections``);
* a simulated step (``simulated_train_s > 0``): the step sleeps, the weights stay;
* a step shared over data-parallel ranks (kind ``distributed_learner``, ``echo2.actors.distributed_learner``).

Only once the step has returned are its groups accounted as trained (staleness histogram,
``trained`` ledger events; ``echo2.training.accounting``), the same way in every mode.
Every ``kappa`` steps (default ``max(1, S - 1)``) it hands an immutable snapshot to the
WeightPublisher. The time spent waiting for a batch is the bubble; the next request is
sent before the current step trains, so the transfer overlaps compute.

Evaluation (at the start, every ``eval_every`` steps and at the end): one greedy completion
per held-out prompt, reported as pass@1 of the task's correctness predicate and, apart, as
the mean training reward (``echo2.tasks.evaluation``); a task that declares no predicate gets
no pass@1 (null in ``summary.json``).

Deviations from the paper: none in the objective; the paper's batch is 128 prompts x 16
samples, the default here is 16 x 8 for the tiny model.

Input: ``batch`` (DEALER) — ``Batch`` replies from the Buffer.
Output: ``Snapshot`` on ``snapshots`` (PUSH, to the WeightPublisher); metrics in
``run_dir/metrics/<name>.jsonl``; ``summary.json``; checkpoints.

Shutdown: returns after ``max_steps`` (this completes the run) or on ``stopping``, also
while it waits for a batch that never comes, writing a final evaluation, checkpoint and
summary either way; ``summary.json`` says which (``stopped_by``, ``max_steps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, cast

import numpy as np
from msgspec import Meta

from echo2 import ledger
from echo2.actor import Actor, ActorConfig, Port, until_stopping
from echo2.actors.admission import rollout_group_max_bytes
from echo2.config import Device
from echo2.envs.base import EnvironmentSpec, load_job_environment
from echo2.envs.codec import load_episode_codec
from echo2.job import JobConfig
from echo2.messages import (
    LEARNER_METRICS_TOPIC,
    Batch,
    BatchRequest,
    BufferStats,
    LearnerCheckpointed,
    LearnerMetrics,
    LearnerStats,
    ScoredGroup,
    Snapshot,
)
from echo2.models.adapters import LoraConfig
from echo2.rl import DEFAULT_MICROBATCH_TOKENS, LossName, OldPolicy
from echo2.rundir import RunDir
from echo2.tasks.base import correctness, load_job_task
from echo2.tasks.evaluation import PASS_AT_1, HeldoutScore, pass_at_k_name, score_heldout, score_sampled
from echo2.training.accounting import TrainingAccount
from echo2.training.checkpoint import (
    TRAINED_TASKS_FILE,
    CheckpointState,
    newest_good_checkpoint,
    newest_incarnation,
    write_checkpoint,
)
from echo2.transport.peers import connection_routing_id
from echo2.weights.chunks import flatten_tensors

if TYPE_CHECKING:
    from echo2.engines.hf_engine import HFTorchEngine
    from echo2.engines.torch_engine import TorchEngine
    from echo2.models.tiny import TinyTransformer
    from echo2.rl.step import StepSettings
    from echo2.training.trainer import Trainer


_FINAL_NOTICE_TIMEOUT_S = 1.0
"""Seconds a stopping learner offers the Buffer its final checkpoint's notice."""
_REQUEST_QUEUE_S = 0.05
"""How long a batch request may wait to be queued before the step goes on without it."""
_REQUEST_CHECK_S = 0.5
"""While waiting for a batch: how often the connection to the Buffer is checked."""

StoppedBy = Literal["max_steps", "max_wall_s", "stop_request"]
"""Why the learner's loop ended, as ``summary.json`` records it (``stopped_by``)."""
_STOPPED_BY_TEXT: dict[StoppedBy, str] = {
    "max_steps": "max_steps reached",
    "max_wall_s": "wall-clock budget reached",
    "stop_request": "stopped before max_steps",
}


class LearnerConfig(ActorConfig, frozen=True):
    max_steps: Annotated[int, Meta(ge=0)] = 300
    """Optimizer steps to train; reaching it completes the run."""
    max_wall_s: Annotated[float, Meta(ge=0)] = 0.0
    """Stop after this many seconds of training (0 = no limit)."""
    lr: Annotated[float, Meta(ge=0)] = 3e-4
    """AdamW learning rate after warm-up."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """After warm-up: keep ``lr`` ("constant") or decay it linearly to ``lr * final_lr_ratio``
    at ``max_steps`` ("linear")."""
    final_lr_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.1
    """With ``lr_schedule = "linear"``: the rate at ``max_steps`` as a fraction of ``lr``."""
    warmup_steps: Annotated[int, Meta(ge=0)] = 50
    """Linear learning-rate warm-up. Adam's first steps move every weight by about ``lr``
    whatever its gradient; on a small model that is a large policy change per step, which
    staleness then multiplies."""
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: Annotated[float, Meta(gt=0)] = 1.0
    """Largest global gradient norm; larger gradients are scaled down to it."""
    clip_eps: Annotated[float, Meta(ge=0)] = 0.2
    """PPO clip range: the ratio to pi_old is clipped to [1 - clip_eps, 1 + clip_eps]."""
    is_cap: Annotated[float, Meta(gt=0)] = 2.0
    """C: cap of the learner/sampler importance weight."""
    kl_beta: Annotated[float, Meta(ge=0)] = 0.0
    """Weight of the k3 KL penalty to the initial policy (0: no penalty, no reference copy)."""
    old_policy: OldPolicy = "sampler"
    """pi_old of the PPO ratio: "sampler" (the behaviour log-probs the rollout carries:
    the clip is a trust region around the policy that generated the data) or "learner"
    (the learner's own policy at the step start: ratio 1, the truncated IS weight alone
    corrects for staleness)."""
    max_tokens_per_microbatch: Annotated[int, Meta(ge=0)] = DEFAULT_MICROBATCH_TOKENS
    """Sequence packing: the batch's sequences (prompt + response) are packed several to a row,
    attention kept inside each, into micro-batches of at most this many tokens (rows x row
    width) whose gradients are accumulated; the loss is still the token mean over the whole
    batch. 0 = no packing: one padded forward of the whole batch. A sequence longer than the
    budget gets a micro-batch of its own."""
    loss: LossName = "ppo_is"
    """The objective (``echo2.rl.corrections``): "ppo_is" (decoupled PPO with the truncated IS
    weight above), "tis_token_mask" / "tis_sequence_mask" / "geo_sequence_mask" (masked IS:
    a token, or a whole sequence by its product or geometric-mean ratio pi_learner /
    pi_sampler, outside [mask_low, mask_high] carries no gradient), "gspo" (sequence ratio,
    clipped to [1 - gspo_clip_low, 1 + gspo_clip_high]) or "cispo" (REINFORCE with the IS
    weight pi_learner / pi_sampler clipped to [0, is_cap], detached)."""
    mask_low: Annotated[float, Meta(gt=0)] = 0.5
    """Lower end of the masked-IS band (a ratio below it is masked); less than ``mask_high``."""
    mask_high: Annotated[float, Meta(gt=0)] = 2.0
    """Upper end of the masked-IS band (a ratio above it is masked). A geometric mean sits far
    closer to 1 than a token's or a sequence's ratio: "geo_sequence_mask" wants a tighter band."""
    gspo_clip_low: Annotated[float, Meta(ge=0, le=1)] = 3e-4
    """GSPO: the sequence ratio's clip below 1 (the paper's 3e-4)."""
    gspo_clip_high: Annotated[float, Meta(ge=0)] = 4e-4
    """GSPO: the sequence ratio's clip above 1 (the paper's 4e-4)."""
    kappa: Annotated[int, Meta(ge=0)] = 0
    """Publish a snapshot every kappa steps; 0 = max(1, S - 1)."""
    eval_every: Annotated[int, Meta(ge=0)] = 50
    """Steps between greedy evaluations on held-out prompts (0: only the final one)."""
    eval_prompts: Annotated[int, Meta(ge=0)] = 500
    """Held-out prompts per evaluation."""
    eval_pass_at_k: Annotated[int, Meta(ge=0)] = 0
    """k of a sampled pass@k beside greedy pass@1 at each evaluation (0: off, the default:
    it generates ``eval_samples`` completions per held-out prompt)."""
    eval_samples: Annotated[int, Meta(ge=0)] = 0
    """n, completions sampled per held-out prompt for pass@k at the job's temperature and
    top-p (n >= k; 0: n = k). A larger n lowers the estimator's variance."""
    checkpoint_every: Annotated[int, Meta(ge=0)] = 100
    """Steps between checkpoints in the run directory (0: only the final one)."""
    batch_resend_s: Annotated[float, Meta(gt=0)] = 30.0
    """Seconds without an answer after which a batch request is sent again (it is sent again
    at once when the connection to the Buffer drops: a restarted Buffer lost it)."""
    log_every: Annotated[int, Meta(ge=1)] = 10
    """Steps between two progress lines in the log (every step is in the metrics)."""
    incarnation: Annotated[int, Meta(ge=0)] = 0
    """Incarnation of the versions this learner publishes; ``--resume`` uses the checkpoint's + 1."""
    model_dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "float32"
    """dtype of the trained weights: "float32" | "bfloat16" | "float16" (or "fp32", "bf16",
    "fp16"; Hugging Face models only; bf16 weights travel as raw uint16 bits)."""
    device: Device = "cpu"
    """torch device of the learner's model ("cpu", "cuda", "cuda:1")."""
    simulated_train_s: Annotated[float, Meta(ge=0)] = 0.0
    """Scale-experiment mode: when > 0 a step sleeps this many seconds instead of training
    (the batch is still consumed and accounted: staleness, rewards). For capacity and
    scheduling benchmarks, where a stable T_train matters and the model does not."""
    lora: LoraConfig | None = None
    """LoRA training (``echo2.models.adapters``): ``{rank, alpha, target_modules, dropout}``
    trains low-rank adapters on the frozen base model and publishes only them (a version is
    the adapter's bytes); unset: every weight is trained and published."""

    def __post_init__(self) -> None:
        if self.lora is not None and self.simulated_train_s > 0:
            raise ValueError("lora trains adapters; simulated_train_s trains nothing: set one of them")
        if self.eval_samples and self.eval_samples < self.eval_pass_at_k:
            raise ValueError(
                f"eval_samples ({self.eval_samples}) must be >= eval_pass_at_k ({self.eval_pass_at_k}): "
                "pass@k is estimated from n >= k samples per prompt"
            )


class Learner(Actor):
    kind: ClassVar[str] = "learner"
    Config = LearnerConfig
    completes_run: ClassVar[bool] = True
    # In-run, a restarted learner would begin at step 0 against a Buffer and samplers that
    # are past it; it continues from its checkpoint only through --resume of the whole run.
    restartable: ClassVar[bool] = False
    ports: ClassVar[dict[str, Port]] = {
        "batch": Port("dealer", bind=False),
        "snapshots": Port("push", bind=False, hwm=4),
    }
    config: LearnerConfig

    @classmethod
    def torch_weight(cls, config: LearnerConfig) -> float:  # type: ignore[override]
        return 1.0

    @property
    def kappa(self) -> int:
        return self.config.kappa or max(1, self.job.staleness - 1)

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        await asyncio.to_thread(self._build)
        if ctx.resume:
            await asyncio.to_thread(self._restore)
        self._batches = ctx.open(
            "batch",
            identity=connection_routing_id(self.name),
            # A Batch is groups_per_step groups and the Buffer's counters.
            max_message_bytes=self.job.groups_per_step * rollout_group_max_bytes(self.job) + (1 << 20),
        )
        self._batches.monitor_disconnects()  # a dropped connection: the Buffer may have restarted
        self._snapshots = ctx.open("snapshots")

    def _build(self) -> None:
        self.trainer = self.build_trainer()
        self.policy = self.trainer.policy
        self._eval_engine: TorchEngine | HFTorchEngine
        if self.policy.kind == "tiny":
            from echo2.engines.torch_engine import TorchEngine

            self._eval_engine = TorchEngine(model=cast("TinyTransformer", self.policy.model))
        else:
            from echo2.engines.hf_engine import HFTorchEngine

            self._eval_engine = HFTorchEngine(policy=self.policy)
        self.policy.model.train()
        self.task = load_job_task(self.job, self.ctx.job_objects)
        self.heldout = self.task.heldout(self.config.eval_prompts)
        self._environment: EnvironmentSpec | None = None
        if self.job.multi_turn:  # held-out episodes, judged by the environment (echo2.envs.evaluation)
            self._environment = load_job_environment(self.job, self.ctx.job_objects)
            self._episode_codec = load_episode_codec(self.job.model, self.job.prompt_format)
        self.version = 0
        self.incarnation = self.config.incarnation
        self.account = TrainingAccount()
        self.wait_s = 0.0
        self.train_s = 0.0
        self.evals: list[HeldoutScore] = []
        self.buffer_stats: BufferStats | None = None  # the Buffer's counters with the last batch
        self._request_id = 0
        self._request_version = -1
        self._request_ids: set[int] = set()
        """The ids of the requests for ``_request_version``: a batch answering any is its batch."""
        self._request_unsent = False
        self._request_sent_at = 0.0
        self._request_disconnects = 0
        self.batch_requests_resent = 0
        self._recent_train_s: deque[float] = deque(maxlen=20)
        self._recent_step_s: deque[float] = deque(maxlen=20)
        self.published_version = -1
        self.published_at_s = 0.0
        self.mismatch_by_sampler: dict[str, float] = {}  # the last step's (heartbeats carry it)
        self._checkpoint_versions: deque[int] = deque(maxlen=2)
        """The versions of the last two checkpoints: a resume that finds the newest damaged
        falls back to the one before, so the Buffer keeps what was trained since then."""

    def build_trainer(self) -> Trainer:
        """The trainer of this Learner (the seam a data-parallel Learner wraps)."""
        return build_trainer(self.job, self.config)

    @property
    def staleness(self) -> Counter[int]:
        """learner version - rollout version -> groups trained at that staleness."""
        return self.account.staleness

    @property
    def rollouts_trained(self) -> int:
        return self.account.rollouts_trained

    def statistics(self) -> LearnerStats:
        busy = self.wait_s + self.train_s
        return LearnerStats(
            version=self.version,
            rollouts_trained=self.rollouts_trained,
            bubble_ratio=self.wait_s / busy if busy else 0.0,
            staleness_max=max(self.staleness, default=0),
            # capacity model inputs (the PromptSource's scheduler reads them from heartbeats)
            train_s_mean=_mean(self._recent_train_s),
            step_s_mean=_mean(self._recent_step_s),
            kappa=self.kappa,
            published_version=self.published_version,
            published_at_s=self.published_at_s,
            mismatch_by_sampler=dict(self.mismatch_by_sampler),
        )

    # -- main loop -------------------------------------------------------------------

    async def run(self) -> None:
        self._record_lora()
        self.evals.append(await asyncio.to_thread(self.evaluate))
        self.ctx.log.info("step %d: held-out %s (start)", self.version, _describe(self.evals[-1]))
        await self._publish_metrics(None, self.evals[-1])
        started = time.monotonic()  # wall_s covers training, not the initial evaluation
        await self._publish()
        await self._request()
        last_log = (time.monotonic(), 0)
        stopped_by: StoppedBy = "max_steps"
        while self.version < self.config.max_steps:
            if self.ctx.stopping.is_set():
                stopped_by = "stop_request"
                break
            if self.config.max_wall_s and time.monotonic() - started >= self.config.max_wall_s:
                self.ctx.log.info("wall-clock budget of %.0f s reached", self.config.max_wall_s)
                stopped_by = "max_wall_s"
                break
            waited = time.perf_counter()
            # A learner no batch reaches (samplers that cannot produce, a peer on a dead
            # link) still stops on request and writes its summary: what it did not train
            # is as much the run's result as what it did.
            budget_s = self.config.max_wall_s - (time.monotonic() - started) if self.config.max_wall_s else None
            try:
                # Its own budget bounds a starved wait too, or it would outlive max_wall_s.
                async with asyncio.timeout(budget_s):
                    received, batch = await until_stopping(self.ctx.stopping, self._receive_batch())
            except TimeoutError:
                self.ctx.log.info("wall-clock budget of %.0f s reached waiting for a batch", self.config.max_wall_s)
                stopped_by = "max_wall_s"
                break
            if not received:
                stopped_by = "stop_request"
                break
            assert batch is not None
            wait_s = time.perf_counter() - waited
            if self.version + 1 < self.config.max_steps:
                await self._request(self.version + 1)
            record = await asyncio.to_thread(self._train_step, batch.groups)
            self.wait_s += wait_s
            self.train_s += record["train_s"]
            self._recent_train_s.append(record["train_s"])
            self._recent_step_s.append(wait_s + record["train_s"])
            self.buffer_stats = batch.buffer
            self.version += 1
            if self.version % self.kappa == 0:
                await self._publish()
            evaluation = None
            if self.config.eval_every and self.version % self.config.eval_every == 0:
                evaluation = await asyncio.to_thread(self.evaluate)
                self.evals.append(evaluation)
                record.update(_eval_record(evaluation))
            await self._publish_metrics(record, evaluation)
            if self.config.checkpoint_every and self.version % self.config.checkpoint_every == 0:
                await self._checkpoint()
            self.ctx.record("step", step=self.version, wait_s=round(wait_s, 5), unix_s=round(time.time(), 3), **record)
            if self.version % self.config.log_every == 0 or "eval_mean_reward" in record:
                last_log = self._log_progress(record, last_log)
        await self._finish(time.monotonic() - started, stopped_by)

    async def _publish_metrics(self, record: dict[str, Any] | None, evaluation: HeldoutScore | None) -> None:
        """This step's ``LearnerMetrics`` on telemetry, for watching actors (best effort)."""
        sampled = evaluation.sampled if evaluation is not None else None
        await self.ctx.publish_telemetry(
            LEARNER_METRICS_TOPIC,
            LearnerMetrics(
                learner=self.name,
                incarnation=self.incarnation,
                step=self.version,
                time_s=time.time(),
                reward_mean=None if record is None else float(record["reward_mean"]),
                loss=None if record is None else float(record["loss"]),
                rollouts=0 if record is None else int(record["rollouts"]),
                evaluated=evaluation is not None,
                eval_pass_at_1=None if evaluation is None else evaluation.pass_at_1,
                eval_mean_reward=None if evaluation is None else evaluation.mean_reward,
                eval_pass_at_k=None if sampled is None else sampled.pass_at_k,
                eval_k=0 if sampled is None else sampled.k,
            ),
        )

    async def _request(self, version: int | None = None) -> None:
        """Ask the Buffer for the batch of ``version`` (default: the current one). A request
        the Buffer cannot take now (its process is restarting) is sent by ``_receive_batch``."""
        version = self.version if version is None else version
        if version != self._request_version:
            self._request_version, self._request_ids = version, set()
        self._request_unsent = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_REQUEST_QUEUE_S):  # not held up by a Buffer that is down
                await self._send_request()

    async def _send_request(self) -> None:
        self._request_id += 1
        self._request_ids.add(self._request_id)
        self._request_sent_at = time.monotonic()
        self._request_disconnects = self._batches.statistics().disconnects
        await self._batches.send(
            BatchRequest(
                request_id=self._request_id,
                incarnation=self.incarnation,
                version=self._request_version,
                num_groups=self.job.groups_per_step,
            )
        )
        self._request_unsent = False

    async def _receive_batch(self) -> Batch:
        """The batch of the version last requested. A restarted Buffer has lost the request:
        it is sent again once the connection to the Buffer dropped (and, as a safety net,
        every ``batch_resend_s`` without an answer). Every answer for that version holds the
        same groups (the Buffer hands a version's batch once); the first is trained, the
        others are dropped. The receive is never cancelled to look at the connection (a
        message it had taken could be lost with it): it runs on while the connection is
        checked beside it."""
        async with asyncio.TaskGroup() as group:
            arrival = group.create_task(self._next_batch())
            while not arrival.done():
                if self._request_unsent:
                    await self._send_request()
                await asyncio.wait({arrival}, timeout=_REQUEST_CHECK_S)
                if arrival.done():
                    break
                dropped = self._batches.statistics().disconnects > self._request_disconnects
                waited = time.monotonic() - self._request_sent_at
                if dropped or waited >= self.config.batch_resend_s:
                    why = "the connection to the Buffer dropped" if dropped else f"no answer in {waited:.0f} s"
                    self.ctx.log.info("%s: asking again for the batch of version %d", why, self._request_version)
                    self.batch_requests_resent += 1
                    self._request_unsent = True
        return arrival.result()

    async def _next_batch(self) -> Batch:
        while True:
            message = await self._batches.recv()
            if isinstance(message, Batch) and message.request_id in self._request_ids:
                return message

    def _record_lora(self) -> None:
        """A LoRA run's ``lora`` record: the adapter its versions carry against the full
        state a run without LoRA would publish (``python -m echo2.plan`` compares them)."""
        from echo2.models.hf import unique_state
        from echo2.training.lora import LoraTrainer

        if not isinstance(self.trainer, LoraTrainer):
            return
        state = unique_state(self.policy.core)
        adapter = sum(t.numel() * t.element_size() for name, t in state.items() if ".lora_" in name)
        model = sum(t.numel() * t.element_size() for name, t in state.items() if ".lora_" not in name)
        lora = self.trainer.adapter
        self.ctx.record("lora", rank=lora.rank, alpha=lora.alpha, adapter_bytes=adapter, model_bytes=model)

    async def _publish(self) -> None:
        from echo2.training.lora import LoraTrainer

        tensors = self.trainer.state_for_publication()  # unaliased, bf16 as raw uint16; a LoRA run's adapters
        specs, flat = flatten_tensors(tensors)  # a fresh buffer: never mutated after this
        self.published_version, self.published_at_s = self.version, time.time()
        await self._snapshots.send(
            Snapshot(
                incarnation=self.incarnation,
                version=self.version,
                tensors=specs,
                data=flat,
                created_at_s=time.time(),
                adapter=self.trainer.adapter if isinstance(self.trainer, LoraTrainer) else None,
                train_s=_mean(self._recent_train_s),
            )
        )

    # -- the step (runs in a worker thread so the event loop stays responsive) --------

    def _train_step(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        """Pack, train, then account: the groups count as trained only once the step returned."""
        from echo2.rl.step import pack_groups

        started = time.perf_counter()
        rows = pack_groups(groups)
        stats = self.trainer.step(rows, self.version)
        self.mismatch_by_sampler = dict(stats.mismatch_by_sampler)
        train_s = time.perf_counter() - started
        lags = self.account.commit(
            groups, learner_version=self.version, incarnation=self.incarnation, ledger=self.ctx.ledger
        )
        return {
            "train_s": round(train_s, 5),
            "reward_mean": rows.reward_mean,
            "rollouts": len(rows),
            "tokens": rows.tokens,
            "staleness_max": max(lags, default=0),
            "staleness_mean": float(np.mean(lags)) if lags else 0.0,
            **stats.record(),
        }

    def evaluate(self) -> HeldoutScore:
        """Greedy completions of the fixed held-out prompts, scored by the task's correctness
        predicate (pass@1) and by the training reward; with ``eval_pass_at_k``, also
        sampled ones for pass@k (``echo2.tasks.evaluation``)."""
        import dataclasses

        from echo2.engines.base import SamplingParams

        engine = self._eval_engine
        if self._environment is not None:
            return self._evaluate_episodes(self._environment)
        ids = [engine.encode_prompt(p.text) for p in self.heldout]
        completions = engine.greedy(ids, max_new_tokens=self.job.max_new_tokens)
        score = score_heldout(self.task, self.version, self.heldout, [c.text for c in completions])
        k = self.config.eval_pass_at_k
        if k:
            job = self.job
            # Seeded by step: the same evaluation in a rerun, a fresh draw at each step.
            params = SamplingParams(job.temperature, job.top_p, job.max_new_tokens, seed=job.seed + self.version)
            samples = engine.generate(ids, self.config.eval_samples or k, params)
            sampled = score_sampled(
                self.task,
                self.heldout,
                [[c.text for c in row] for row in samples],
                k=k,
                temperature=job.temperature,
                top_p=job.top_p,
            )
            score = dataclasses.replace(score, sampled=sampled)
        self.policy.model.train()
        return score

    def _evaluate_episodes(self, environment: EnvironmentSpec) -> HeldoutScore:
        """Greedy held-out episodes (multi-turn jobs; sampled pass@k is not measured)."""
        from echo2.envs.episode import EpisodeLimits
        from echo2.envs.evaluation import evaluate_episodes

        episode = self.job.episode
        evaluation = evaluate_episodes(
            self._eval_engine,
            self.heldout,
            step=self.version,
            spec=environment,
            codec=self._episode_codec,
            limits=EpisodeLimits.of_job(self.job),
            job_seed=self.job.seed,
            timeout_s=episode.turn_timeout_s,
        )
        if evaluation.failed:
            self.ctx.log.warning("held-out evaluation: %d episodes failed in the environment", evaluation.failed)
        self.policy.model.train()
        return evaluation.score

    # -- outputs ---------------------------------------------------------------------

    def _log_progress(self, record: dict[str, Any], last: tuple[float, int]) -> tuple[float, int]:
        now = time.monotonic()
        steps = self.version - last[1]
        rate = steps * self.job.groups_per_step * self.job.group_size / max(now - last[0], 1e-9)
        busy = self.wait_s + self.train_s
        accuracy = f" | held-out {_describe(self.evals[-1])}" if "eval_mean_reward" in record else ""
        self.ctx.log.info(
            "step %d | reward %.3f%s | stale max %d | %.0f rollouts/s | learner idle %.0f%%",
            self.version,
            record["reward_mean"],
            accuracy,
            max(self.staleness, default=0),
            rate,
            100 * self.wait_s / busy if busy else 0.0,
        )
        return now, self.version

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step_NNNNNN`` atomically, with digests (``echo2.training.checkpoint``)."""
        if self.ctx.run_dir is None:
            return None
        state = CheckpointState(step=self.version, version=self.version, incarnation=self.incarnation)

        def fill(staging: Path) -> None:
            self.trainer.save(staging)
            (staging / TRAINED_TASKS_FILE).write_text(json.dumps(sorted(self.account.trained_tasks)))

        directory = write_checkpoint(RunDir(self.ctx.run_dir).checkpoint_dir(self.version), state, fill)
        if not self._checkpoint_versions or self._checkpoint_versions[-1] != self.version:
            self._checkpoint_versions.append(self.version)
        return directory

    def _restore(self) -> None:
        """Continue from the newest checkpoint that verifies, under a new incarnation."""
        run = RunDir(self.ctx.run_dir) if self.ctx.run_dir is not None else None
        directories = run.checkpoint_dirs() if run is not None else []
        where = run.checkpoints_dir if run is not None else None
        if not directories:
            self.ctx.log.warning("--resume: no checkpoint in %s; starting from the initial model", where)
            return
        found = newest_good_checkpoint(directories, self.ctx.log.warning)
        # Versions published by any crashed incarnation (including one whose checkpoints were
        # passed over) must never be mistaken for ours: a new incarnation orders after every
        # old one, even when none of their checkpoints is usable.
        previous = newest_incarnation(directories)
        if found is None:
            self.ctx.log.warning("--resume: no checkpoint in %s verifies; starting from the initial model", where)
            origin = "the initial model"
        else:
            directory, state = found
            self.trainer.load(directory)
            trained = directory / TRAINED_TASKS_FILE
            if trained.exists():
                self.account.trained_tasks = set(json.loads(trained.read_text()))
            self.version = state.version
            previous = max(previous, state.incarnation)
            origin = directory.name
        self._checkpoint_versions.append(self.version)
        self.incarnation = previous + 1
        self.ctx.ledger(
            ledger.Resumed(incarnation=self.incarnation, previous_incarnation=previous, from_version=self.version)
        )
        self.ctx.log.info("resumed from %s: version %d, incarnation %d", origin, self.version, self.incarnation)

    async def _checkpoint(self) -> None:
        if await asyncio.to_thread(self.save_checkpoint) is None:
            return
        # The Buffer may drop what was trained before the checkpoint a resume would fall back
        # to if the newest were damaged: the one before it (none yet: version 0).
        fallback = self._checkpoint_versions[0] if len(self._checkpoint_versions) == 2 else 0
        notice = LearnerCheckpointed(incarnation=self.incarnation, version=fallback)
        if not self.ctx.stopping.is_set():
            await self._batches.send(notice)
            return
        # The final checkpoint of a stopped run: the Buffer is stopping too (the launcher stops
        # every process at once) and may be gone, and a send with no peer waits forever, which
        # cost the drain its summary. A stopping Buffer has no use for the notice.
        try:
            await asyncio.wait_for(self._batches.send(notice), _FINAL_NOTICE_TIMEOUT_S)
        except TimeoutError:
            self.ctx.log.info("the Buffer did not take the final checkpoint's notice (it stopped first)")

    async def _finish(self, wall_s: float, stopped_by: StoppedBy = "max_steps") -> None:
        if not self.evals or self.evals[-1].step != self.version:
            self.evals.append(await asyncio.to_thread(self.evaluate))
            await self._publish_metrics(None, self.evals[-1])
        await self._checkpoint()
        self.trainer.close()  # after the last evaluation and checkpoint: a sharded trainer's ranks join those
        busy = self.wait_s + self.train_s
        summary = {
            "steps": self.version,
            "max_steps": self.config.max_steps,
            "stopped_by": stopped_by,
            "wall_s": round(wall_s, 2),
            "staleness_budget": self.job.staleness,
            "kappa": self.kappa,
            **self._eval_summary(),
            **self.account.summary(),
            "drops_by_reason": dict(self.buffer_stats.dropped) if self.buffer_stats is not None else {},
            "reward_failures_by_reason": (
                dict(self.buffer_stats.reward_failures) if self.buffer_stats is not None else {}
            ),
            # Leases whose episode failed in a sampler's environment (re-issued, never scored).
            "episode_failures_by_reason": {
                reason: n
                for reason, n in (self.buffer_stats.rejected if self.buffer_stats is not None else {}).items()
                if reason.startswith("environment_")
            },
            "learner_idle_fraction": round(self.wait_s / busy, 4) if busy else 0.0,
            "steps_per_s": round(self.version / wall_s, 3) if wall_s > 0 else 0.0,
            "rollouts_per_s": round(self.rollouts_trained / wall_s, 1) if wall_s > 0 else 0.0,
            "train_s_mean": round(self.train_s / self.version, 5) if self.version else 0.0,
        }
        self.summary = summary
        self.ctx.log.info(
            "done (%s): %d of %d steps in %.0f s, held-out %s -> %s, staleness max %d (S=%d)",
            _STOPPED_BY_TEXT[stopped_by],
            summary["steps"],
            self.config.max_steps,
            wall_s,
            _describe(self.evals[0]),
            _describe(self.evals[-1]),
            summary["staleness_max"],
            self.job.staleness,
        )
        if self.ctx.run_dir is not None:
            path = RunDir(self.ctx.run_dir).summary_path
            path.write_text(json.dumps(summary, indent=2) + "\n")

    def _eval_summary(self) -> dict[str, Any]:
        """The held-out evaluation in ``summary.json``: what was measured, then the numbers.

        ``initial_accuracy`` / ``final_accuracy`` / ``accuracy_by_step`` are the older names
        of pass@1, kept for the readers of earlier summaries."""
        first, last = self.evals[0], self.evals[-1]
        judged = last.pass_at_1 is not None if self._environment is not None else correctness(self.task) is not None
        predicate = (
            f"correct() of task {self.task.name!r}"
            if self._environment is None
            else f"succeeded() of environment {self._environment.name!r} (greedy episodes)"
        )
        return {
            "eval_metric": PASS_AT_1 if judged else None,
            "eval_predicate": predicate if judged else None,
            "eval_decoding": "greedy",
            "eval_prompts": last.prompts,
            "initial_pass_at_1": first.pass_at_1,
            "final_pass_at_1": last.pass_at_1,
            "pass_at_1_by_step": [[e.step, e.pass_at_1] for e in self.evals],
            "initial_eval_mean_reward": first.mean_reward,
            "final_eval_mean_reward": last.mean_reward,
            "eval_mean_reward_by_step": [[e.step, e.mean_reward] for e in self.evals],
            "initial_accuracy": first.pass_at_1,
            "final_accuracy": last.pass_at_1,
            "accuracy_by_step": [[e.step, e.pass_at_1] for e in self.evals],
            **_pass_at_k_summary(self.evals),
        }


def _describe(score: HeldoutScore) -> str:
    """``pass@1 0.440 (greedy), pass@4 0.700 (8 samples/prompt, T=1), mean reward 0.440``
    ("n/a" when the task declares no predicate; pass@k only when sampled)."""
    passed = "n/a" if score.pass_at_1 is None else f"{score.pass_at_1:.3f}"
    text = f"{PASS_AT_1} {passed} (greedy)"
    if (sampled := score.sampled) is not None:
        value = "n/a" if sampled.pass_at_k is None else f"{sampled.pass_at_k:.3f}"
        text += f", {pass_at_k_name(sampled.k)} {value} ({sampled.samples_per_prompt} samples/prompt, T={sampled.temperature:g})"
    return f"{text}, mean reward {score.mean_reward:.3f}"


def _pass_at_k_summary(evals: list[HeldoutScore]) -> dict[str, Any]:
    """``summary.json``'s pass@k fields, present only when the evaluation sampled."""
    first, last = evals[0].sampled, evals[-1].sampled
    if first is None or last is None:
        return {}
    return {
        "eval_pass_at_k_metric": pass_at_k_name(last.k),
        "eval_pass_at_k_decoding": (
            f"{last.samples_per_prompt} samples per prompt at temperature {last.temperature:g}, "
            f"top_p {last.top_p:g}; unbiased estimator (Chen et al. 2021)"
        ),
        "eval_pass_at_k_k": last.k,
        "eval_pass_at_k_samples": last.samples_per_prompt,
        "initial_pass_at_k": first.pass_at_k,
        "final_pass_at_k": last.pass_at_k,
        "pass_at_k_by_step": [[e.step, e.sampled.pass_at_k] for e in evals if e.sampled is not None],
    }


def _eval_record(score: HeldoutScore) -> dict[str, Any]:
    """The evaluation's fields in a step record (``accuracy``: pass@1, the name the report reads)."""
    record: dict[str, Any] = {"eval_mean_reward": score.mean_reward}
    if score.pass_at_1 is not None:
        record["accuracy"] = score.pass_at_1
    if score.sampled is not None and score.sampled.pass_at_k is not None:
        record["pass_at_k"] = score.sampled.pass_at_k
    return record


def step_settings(config: LearnerConfig) -> StepSettings:
    """The step's hyper-parameters from the Learner's configuration."""
    from echo2.rl.step import StepSettings

    return StepSettings(
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        grad_clip=config.grad_clip,
        clip_eps=config.clip_eps,
        is_cap=config.is_cap,
        kl_beta=config.kl_beta,
        old_policy=config.old_policy,  # StepSettings rejects anything but "sampler" and "learner"
        decay_steps=config.max_steps if config.lr_schedule == "linear" else 0,
        final_lr_ratio=config.final_lr_ratio,
        max_tokens_per_microbatch=config.max_tokens_per_microbatch,
        loss=config.loss,
        mask_low=config.mask_low,
        mask_high=config.mask_high,
        gspo_clip_low=config.gspo_clip_low,
        gspo_clip_high=config.gspo_clip_high,
    )


def build_trainer(job: JobConfig, config: LearnerConfig) -> Trainer:
    """The trainer a Learner with ``config`` uses (every data-parallel rank builds the same)."""
    from echo2.models.policy import load_policy
    from echo2.training.choose import make_trainer

    # "" = the built-in tiny model; an HF directory or "smollm2" = a Hugging Face model.
    policy = load_policy(job.model, dtype=config.model_dtype, device=config.device, prompt_format=job.prompt_format)
    return make_trainer(policy, step_settings(config), simulated_train_s=config.simulated_train_s, lora=config.lora)


def _mean(values: deque[float]) -> float:
    return sum(values) / len(values) if values else 0.0
