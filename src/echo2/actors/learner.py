"""Learner: trains the policy with off-policy GRPO on admissible batches from the Buffer.

Role: the one expensive actor. Each step it asks the Buffer for ``groups_per_step``
admissible groups (``BatchRequest(version)``), computes group z-score advantages over the
completions the Rewarder kept, and takes one AdamW step on the loss of
``echo2.rl.grpo.grpo_loss``. Every ``kappa`` steps (default ``max(1, S - 1)``) it hands an
immutable snapshot to the WeightPublisher. The time spent waiting for a batch is the
bubble; the next request is sent before the current step trains, so the transfer overlaps
compute.

The variant, exactly (see ``echo2.rl.grpo`` for the loss itself):

* one optimizer step per batch, so ``pi_old`` is the learner's own policy at the start of
  the step (``logp_prox = logp.detach()``): the PPO ratio is 1 and the clip inactive, and
  the off-policy correction is the truncated importance weight
  ``min(pi_learner / pi_sampler, C)`` per token (ECHO-2 appendix, decoupled PPO);
* advantages: ``(r - mean_G) / (std_G + 1e-6)`` over the kept completions of each group;
  a group whose rewards are all equal contributes no gradient;
* token-mean over every response token in the batch; optional ``kl_beta * k3`` to the
  initial policy; AdamW with gradient-norm clipping.

Deviations from the paper: none in the objective; the paper's batch is 128 prompts x 16
samples, the default here is 16 x 8 for the tiny model.

Input: ``batch`` (DEALER) — ``Batch`` replies from the Buffer.
Output: ``Snapshot`` on ``snapshots`` (PUSH, to the WeightPublisher); metrics in
``run_dir/metrics/<name>.jsonl``; ``summary.json``; checkpoints.

Shutdown: returns after ``max_steps`` (this completes the run) or on ``stopping``, writing
a final evaluation, checkpoint and summary either way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from msgspec import Meta

from echo2 import ledger
from echo2.actor import Actor, ActorConfig, Port
from echo2.messages import Batch, BatchRequest, BufferStats, LearnerCheckpointed, LearnerStats, ScoredGroup, Snapshot
from echo2.rundir import RunDir
from echo2.tasks.base import load_job_task
from echo2.weights.chunks import flatten_tensors


class LearnerConfig(ActorConfig, frozen=True):
    max_steps: Annotated[int, Meta(ge=0)] = 300
    """Optimizer steps to train; reaching it completes the run."""
    max_wall_s: Annotated[float, Meta(ge=0)] = 0.0
    """Stop after this many seconds of training (0 = no limit)."""
    lr: Annotated[float, Meta(ge=0)] = 3e-4
    """AdamW learning rate after warm-up."""
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
    old_policy: Literal["sampler", "learner"] = "sampler"
    """pi_old of the PPO ratio: "sampler" (the behaviour log-probs the rollout carries:
    the clip is a trust region around the policy that generated the data) or "learner"
    (the learner's own policy at the step start: ratio 1, the truncated IS weight alone
    corrects for staleness)."""
    kappa: Annotated[int, Meta(ge=0)] = 0
    """Publish a snapshot every kappa steps; 0 = max(1, S - 1)."""
    eval_every: Annotated[int, Meta(ge=0)] = 50
    """Steps between greedy evaluations on held-out prompts (0: only the final one)."""
    eval_prompts: Annotated[int, Meta(ge=0)] = 500
    """Held-out prompts per evaluation."""
    checkpoint_every: Annotated[int, Meta(ge=0)] = 100
    """Steps between checkpoints in the run directory (0: only the final one)."""
    log_every: Annotated[int, Meta(ge=1)] = 10
    """Steps between two progress lines in the log (every step is in the metrics)."""
    incarnation: Annotated[int, Meta(ge=0)] = 0
    """Incarnation of the versions this learner publishes; ``--resume`` uses the checkpoint's + 1."""
    model_dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "float32"
    """dtype of the trained weights: "float32" | "bfloat16" | "float16" (or "fp32", "bf16",
    "fp16"; Hugging Face models only; bf16 weights travel as raw uint16 bits)."""
    device: str = "cpu"
    """torch device of the learner's model ("cpu", "cuda", "cuda:1")."""
    simulated_train_s: Annotated[float, Meta(ge=0)] = 0.0
    """Scale-experiment mode: when > 0 a step sleeps this many seconds instead of training
    (the batch is still consumed and accounted: staleness, rewards). For capacity and
    scheduling benchmarks, where a stable T_train matters and the model does not."""


class Learner(Actor):
    kind: ClassVar[str] = "learner"
    Config = LearnerConfig
    completes_run: ClassVar[bool] = True
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
        self._batches = ctx.open("batch", identity=self.name.encode())
        self._snapshots = ctx.open("snapshots")

    def _build(self) -> None:
        import torch

        from echo2.models.policy import load_policy

        self._torch = torch
        # "" = the built-in tiny model; an HF directory or "smollm2" = a Hugging Face model.
        self.policy = load_policy(self.job.model, dtype=self.config.model_dtype, device=self.config.device)
        self.model = self.policy.model
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay
        )
        self.reference = None
        if self.config.kl_beta > 0:
            self.reference = self.policy.clone().model
        if self.policy.kind == "tiny":
            from echo2.engines.torch_engine import TorchEngine

            self._eval_engine = TorchEngine(model=self.model)
        else:
            from echo2.engines.hf_engine import HFTorchEngine

            self._eval_engine = HFTorchEngine(policy=self.policy)
        self.model.train()
        self.task = load_job_task(self.job)
        self.heldout = self.task.heldout(self.config.eval_prompts)
        self.version = 0
        self.incarnation = self.config.incarnation
        self.staleness: Counter[int] = Counter()
        self.trained_tasks: set[str] = set()
        self.trained_twice = 0
        self.rollouts_trained = 0
        self.wait_s = 0.0
        self.train_s = 0.0
        self.evals: list[tuple[int, float]] = []
        self.buffer_stats: BufferStats | None = None  # the Buffer's counters with the last batch
        self._request_id = 0
        self._recent_train_s: deque[float] = deque(maxlen=20)
        self._recent_step_s: deque[float] = deque(maxlen=20)
        self.published_version = -1
        self.published_at_s = 0.0

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
        )

    # -- main loop -------------------------------------------------------------------

    async def run(self) -> None:
        self.evals.append((self.version, await asyncio.to_thread(self.evaluate)))
        self.ctx.log.info("step %d: greedy accuracy %.3f (start)", self.version, self.evals[-1][1])
        started = time.monotonic()  # wall_s covers training, not the initial evaluation
        await self._publish()
        await self._request()
        last_log = (time.monotonic(), 0)
        while self.version < self.config.max_steps and not self.ctx.stopping.is_set():
            if self.config.max_wall_s and time.monotonic() - started >= self.config.max_wall_s:
                self.ctx.log.info("wall-clock budget of %.0f s reached", self.config.max_wall_s)
                break
            waited = time.perf_counter()
            batch = await self._receive_batch()
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
            if self.config.eval_every and self.version % self.config.eval_every == 0:
                self.evals.append((self.version, await asyncio.to_thread(self.evaluate)))
                record["accuracy"] = self.evals[-1][1]
            if self.config.checkpoint_every and self.version % self.config.checkpoint_every == 0:
                await self._checkpoint()
            self.ctx.record("step", step=self.version, wait_s=round(wait_s, 5), unix_s=round(time.time(), 3), **record)
            if self.version % self.config.log_every == 0 or "accuracy" in record:
                last_log = self._log_progress(record, last_log)
        await self._finish(time.monotonic() - started)

    async def _request(self, version: int | None = None) -> None:
        self._request_id += 1
        await self._batches.send(
            BatchRequest(
                request_id=self._request_id,
                incarnation=self.incarnation,
                version=self.version if version is None else version,
                num_groups=self.job.groups_per_step,
            )
        )

    async def _receive_batch(self) -> Batch:
        while True:
            message = await self._batches.recv()
            if isinstance(message, Batch):
                return message

    async def _publish(self) -> None:
        tensors = self.policy.wire_tensors()  # unaliased, bf16 as raw uint16
        specs, flat = flatten_tensors(tensors)  # a fresh buffer: never mutated after this
        self.published_version, self.published_at_s = self.version, time.time()
        await self._snapshots.send(
            Snapshot(
                incarnation=self.incarnation,
                version=self.version,
                tensors=specs,
                data=flat,
                created_at_s=time.time(),
            )
        )

    # -- the step (runs in a worker thread so the event loop stays responsive) --------

    def _train_step(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        from echo2.rl.grpo import grpo_loss
        from echo2.rl.logprobs import sequence_logprobs

        if self.config.simulated_train_s > 0:
            return self._simulated_step(groups)
        torch = self._torch
        started = time.perf_counter()
        prompts, responses, sampler_lp, advantages, rewards = [], [], [], [], []
        row_sampler: list[str] = []
        staleness = []
        for scored in groups:
            g = scored.group
            task_id = g.task_id
            if task_id in self.trained_tasks:
                self.trained_twice += 1
            self.trained_tasks.add(task_id)
            self.ctx.ledger(
                ledger.Trained(
                    task=task_id,
                    version=g.version,
                    learner_version=self.version,
                    incarnation=self.incarnation,
                )
            )
            lag = self.version - g.version
            staleness.append(lag)
            self.staleness[lag] += 1
            kept = np.flatnonzero(scored.keep)
            r = scored.rewards[kept].astype(np.float64)
            adv = (r - r.mean()) / (r.std() + 1e-6) if r.std() > 0 else np.zeros_like(r)
            rewards.extend(r.tolist())
            for i, a in zip(kept.tolist(), adv.tolist(), strict=True):
                lo, hi = int(g.offsets[i]), int(g.offsets[i + 1])
                prompts.append(g.prompt_token_ids)
                responses.append(g.token_ids[lo:hi])
                sampler_lp.append(g.logprobs[lo:hi])
                row_sampler.append(g.sampler_id)
                advantages.append(a)
        self.rollouts_trained += len(responses)
        pad_id = self.policy.tokenizer.pad_id
        logp, mask = sequence_logprobs(self.model, prompts, responses, pad_id=pad_id)  # (B, T)
        behaviour = torch.zeros_like(logp)  # (B, T)
        for b, lp in enumerate(sampler_lp):
            behaviour[b, : len(lp)] = torch.from_numpy(np.array(lp, dtype=np.float32))
        logp_ref = None
        if self.reference is not None:
            with torch.no_grad():
                logp_ref, _ = sequence_logprobs(self.reference, prompts, responses, pad_id=pad_id)
        loss, stats = grpo_loss(
            logp,
            behaviour if self.config.old_policy == "sampler" else None,
            behaviour,
            torch.tensor(advantages, dtype=torch.float32, device=logp.device),  # (B,)
            mask,
            clip_eps=self.config.clip_eps,
            is_cap=self.config.is_cap,
            kl_beta=self.config.kl_beta,
            logp_ref=logp_ref,
        )
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.config.lr * min(1.0, (self.version + 1) / max(1, self.config.warmup_steps))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        return {
            "train_s": round(time.perf_counter() - started, 5),
            "loss": float(loss.detach()),
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "rollouts": len(responses),
            "tokens": int(mask.sum()),
            "staleness_max": max(staleness),
            "staleness_mean": float(np.mean(staleness)),
            "grad_norm": float(grad_norm),
            "clip_fraction": stats.clip_fraction,
            "is_weight_mean": stats.is_weight_mean,
            "is_truncated_fraction": stats.is_truncated_fraction,
            "approx_kl_sampler": stats.approx_kl_sampler,
            # Per sampler: mean (sampler log-prob - learner log-prob) per token. Rollouts from
            # remote workers are claims; a worker whose numbers disagree with the learner's
            # recomputation (a different model, tampered log-probs) stands out here.
            "mismatch_by_sampler": _mismatch_by_sampler(behaviour, logp.detach(), mask, row_sampler),
        }

    def _simulated_step(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        """Account for the batch like a real step, then sleep ``simulated_train_s``."""
        started = time.perf_counter()
        staleness, rewards, rollouts = [], [], 0
        for scored in groups:
            g = scored.group
            if g.task_id in self.trained_tasks:
                self.trained_twice += 1
            self.trained_tasks.add(g.task_id)
            lag = self.version - g.version
            staleness.append(lag)
            self.staleness[lag] += 1
            kept = np.flatnonzero(scored.keep)
            rewards.extend(scored.rewards[kept].astype(np.float64).tolist())
            rollouts += len(kept)
        self.rollouts_trained += rollouts
        time.sleep(max(0.0, self.config.simulated_train_s - (time.perf_counter() - started)))
        return {
            "train_s": round(time.perf_counter() - started, 5),
            "loss": 0.0,
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "rollouts": rollouts,
            "staleness_max": max(staleness, default=0),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        }

    def evaluate(self) -> float:
        """Greedy accuracy on the fixed held-out prompts."""
        engine = self._eval_engine
        ids = [engine.encode_prompt(p.text) for p in self.heldout]
        completions = engine.greedy(ids, max_new_tokens=self.job.max_new_tokens)
        self.model.train()
        scores = [self.task.reward(p, c.text) for p, c in zip(self.heldout, completions, strict=True)]
        return float(np.mean(scores))

    # -- outputs ---------------------------------------------------------------------

    def _log_progress(self, record: dict[str, Any], last: tuple[float, int]) -> tuple[float, int]:
        now = time.monotonic()
        steps = self.version - last[1]
        rate = steps * self.job.groups_per_step * self.job.group_size / max(now - last[0], 1e-9)
        busy = self.wait_s + self.train_s
        accuracy = f" | acc {record['accuracy']:.3f}" if "accuracy" in record else ""
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
        if self.ctx.run_dir is None:
            return None
        from safetensors.torch import save_file

        torch = self._torch
        directory = RunDir(self.ctx.run_dir).checkpoint_dir(self.version)
        directory.mkdir(parents=True, exist_ok=True)
        if self.policy.kind == "tiny":
            save_file(
                {k: v.detach().contiguous() for k, v in self.model.state_dict().items()},
                directory / "model.safetensors",
            )
            (directory / "config.json").write_text(self.model.config.to_json())
        else:
            self.policy.save(directory)  # save_pretrained: loadable as a model directory
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "trained_tasks.json").write_text(json.dumps(sorted(self.trained_tasks)))
        # state.json last: its presence marks the checkpoint complete (see _restore).
        (directory / "state.json").write_text(
            json.dumps({"step": self.version, "version": self.version, "incarnation": self.incarnation})
        )
        return directory

    def _restore(self) -> None:
        """Continue from the newest complete checkpoint under a new incarnation."""
        from safetensors.torch import load_file

        torch = self._torch
        run = RunDir(self.ctx.run_dir) if self.ctx.run_dir is not None else None
        complete = [d for d in run.checkpoint_dirs() if (d / "state.json").is_file()] if run is not None else []
        if not complete:
            where = run.checkpoints_dir if run is not None else None
            self.ctx.log.warning("--resume: no complete checkpoint in %s; starting from the initial model", where)
            return
        directory = complete[-1]
        state = json.loads((directory / "state.json").read_text())
        weights = load_file(directory / "model.safetensors")
        # HF: names without LogitsLM's "hf." prefix; a tied lm_head is not in the file
        self.policy.core.load_state_dict(weights, strict=self.policy.kind == "tiny")
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        trained = directory / "trained_tasks.json"
        if trained.exists():
            self.trained_tasks = set(json.loads(trained.read_text()))
        previous = int(state["incarnation"])
        self.version = int(state["version"])
        # Versions published after this checkpoint by the crashed incarnation must never be
        # mistaken for ours: a new incarnation orders after every old one.
        self.incarnation = previous + 1
        self.ctx.ledger(
            ledger.Resumed(incarnation=self.incarnation, previous_incarnation=previous, from_version=self.version)
        )
        self.ctx.log.info("resumed from %s: version %d, incarnation %d", directory.name, self.version, self.incarnation)

    async def _checkpoint(self) -> None:
        if await asyncio.to_thread(self.save_checkpoint) is not None:
            await self._batches.send(LearnerCheckpointed(incarnation=self.incarnation, version=self.version))

    async def _finish(self, wall_s: float) -> None:
        if not self.evals or self.evals[-1][0] != self.version:
            self.evals.append((self.version, await asyncio.to_thread(self.evaluate)))
        await self._checkpoint()
        busy = self.wait_s + self.train_s
        summary = {
            "steps": self.version,
            "wall_s": round(wall_s, 2),
            "staleness_budget": self.job.staleness,
            "kappa": self.kappa,
            "initial_accuracy": self.evals[0][1],
            "final_accuracy": self.evals[-1][1],
            "accuracy_by_step": [[s, a] for s, a in self.evals],
            "staleness_max": max(self.staleness, default=0),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "rollouts_trained": self.rollouts_trained,
            "rollouts_trained_twice": self.trained_twice,
            "groups_trained": len(self.trained_tasks),
            "drops_by_reason": dict(self.buffer_stats.dropped) if self.buffer_stats is not None else {},
            "learner_idle_fraction": round(self.wait_s / busy, 4) if busy else 0.0,
            "steps_per_s": round(self.version / wall_s, 3) if wall_s > 0 else 0.0,
            "rollouts_per_s": round(self.rollouts_trained / wall_s, 1) if wall_s > 0 else 0.0,
            "train_s_mean": round(self.train_s / self.version, 5) if self.version else 0.0,
        }
        self.summary = summary
        self.ctx.log.info(
            "done: %d steps in %.0f s, greedy accuracy %.3f -> %.3f, staleness max %d (S=%d)",
            summary["steps"],
            wall_s,
            summary["initial_accuracy"],
            summary["final_accuracy"],
            summary["staleness_max"],
            self.job.staleness,
        )
        if self.ctx.run_dir is not None:
            path = RunDir(self.ctx.run_dir).summary_path
            path.write_text(json.dumps(summary, indent=2) + "\n")


def _mean(values: deque[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _mismatch_by_sampler(behaviour: Any, logp: Any, mask: Any, samplers: list[str]) -> dict[str, float]:
    gap = ((behaviour - logp) * mask).sum(dim=1)  # (B,)
    tokens = mask.sum(dim=1)  # (B,)
    out: dict[str, list[float]] = {}
    for sampler, g, n in zip(samplers, gap.tolist(), tokens.tolist(), strict=True):
        entry = out.setdefault(sampler, [0.0, 0.0])
        entry[0] += g
        entry[1] += n
    return {s: round(total / max(n, 1.0), 6) for s, (total, n) in out.items()}
