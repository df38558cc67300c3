"""End-to-end pipeline: echo2's actors against a plain single-process GRPO loop.

    python benchmarks/pipeline.py [--steps N] [--seconds S] [--json] [--quick] [--check]
                                  [--cases baseline,colocated,multi-S0,multi-S3]
                                  [--timeout S] [--keep]
    python benchmarks/pipeline.py --packing [--packing-repeats N] [--json] [--check]

Every case trains the shipped warm-started tiny model on 3-digit reversed addition with the
same hyper-parameters (16 prompts x 8 samples per step, temperature 1, max_new_tokens 5,
AdamW lr 3e-4 with the learner's 50-step linear warm-up, gradient clip 1, the learner's
``grpo_loss`` with ``old_policy = "sampler"``) for the same number of learner steps
(default 300, ``--quick`` 40), cases one after another:

* ``baseline`` (a): :func:`run_baseline`, a minimal loop in this process — sample 16 x 8
  with a ``TorchEngine`` sharing the trained model, score, then the learner's own step
  (``echo2.rl.step``: pack with group z-score advantages, one optimizer step) — with
  ``torch.set_num_threads(2)``;
* ``colocated`` (b): ``examples/colocated.toml``, all six actors in one process (S = 3);
* ``multi-S0`` (c): ``examples/sync.toml``, four processes, fully synchronous;
* ``multi-S3`` (d): ``examples/topology.toml``, four processes, staleness budget S = 3.

The echo2 cases run ``python -m echo2.launch TOPOLOGY --set ... --run-dir TMP`` as a
subprocess (no in-loop evaluation or checkpoint; a timeout; the last log lines on failure;
the temporary run directory removed afterwards unless ``--keep``).

What is measured, for every case the same way: the *training phase*, from the start of the
first step (its sampling, or for echo2 the learner's wait for its first batch, which
includes filling the pipeline) to the end of the last optimizer step. Excluded: process
start-up, model loading, the warm-start evaluation before the first step and the final
evaluation after the last. For echo2 it is read from ``metrics/learner.jsonl`` (step 1's
record time minus its wait and train time, to the last step's record time), not from
``summary.json``'s ``wall_s``: the learner starts that clock *before* its warm-start
evaluation, so it includes one greedy pass over the held-out set (both numbers are in
the JSON output). Accuracy is greedy exact-match on ``AdditionTask().heldout(500)`` after
the budget (echo2's ``final_accuracy``; the baseline evaluates the same way at the end).

Floors (the issue's): multi-process S = 3 steps/s >= 0.8 x the baseline's, and S = 3 final
accuracy no more than 5 points below S = 0 at equal steps. One seed, one run per case, a
shared machine: read the accuracy gap against its noise (500 prompts: about +-2 points of
sampling error each, and runs of the multi-process cases are not reproducible — which
sampler serves which lease depends on timing — so two S = 0 runs have differed by 28
points). ``--check`` exits 1 when a floor fails or a case fails; otherwise the exit code
is 0.

``--packing`` instead compares the learner's step alone, padded
(``max_tokens_per_microbatch = 0``) against packed (the default budget), on two batches of
the job's size: ``mixed`` (addition with 1-9 digits, short problems more often: the
long-tailed lengths RL batches have) and ``add3`` (the default job's). Tokens/s are the
batch's prompt + response tokens over one ``optimiser_step``; the two kinds alternate step
by step on the same batches; the floor's figure is the median of the per-step ratios. Floor
(issue 17): packed >= 1.3x padded on ``mixed``.

Timing noise: on a shared machine the two-thread loops ((a) and (b)) suffer most from
other work (an OpenMP region waits for its slowest thread), the one-thread-per-process
topologies least. Each case records the 1-minute load average before and after it and the
CPU seconds it used; a warning is printed when the load exceeded the core count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:  # running from a checkout without an install
    try:
        import echo2  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))

# The job every case runs (the example topologies' [job] and the learner's defaults).
GROUPS_PER_STEP = 16
GROUP_SIZE = 8
TEMPERATURE = 1.0
MAX_NEW_TOKENS = 5
LR = 3e-4
WARMUP_STEPS = 50
GRAD_CLIP = 1.0
CLIP_EPS = 0.2
IS_CAP = 2.0
EVAL_PROMPTS = 500
BASELINE_THREADS = 2
DEFAULT_STEPS = 300
QUICK_STEPS = 40

ECHO2_CASES: dict[str, tuple[str, str]] = {
    "colocated": ("examples/colocated.toml", "(b) echo2 co-located, 1 process, S=3"),
    "multi-S0": ("examples/sync.toml", "(c) echo2 multi-process, S=0"),
    "multi-S3": ("examples/topology.toml", "(d) echo2 multi-process, S=3"),
}
BASELINE_DESCRIPTION = "(a) single-process GRPO loop"
CASES = ("baseline", *ECHO2_CASES)
FLOOR_STEPS_RATIO = 0.8
FLOOR_ACCURACY_POINTS = 5.0
LOG_TAIL_LINES = 30
KILL_GRACE_S = 30.0
"""Seconds after SIGTERM (the launcher drains its children) before the launcher is killed."""


@dataclasses.dataclass
class CaseResult:
    """One case's measurements; times in seconds, accuracies in [0, 1]."""

    case: str
    description: str
    ok: bool = True
    error: str = ""
    steps: int = 0
    rollouts: int = 0
    train_wall_s: float = math.nan
    """The training phase (see the module docstring)."""
    initial_accuracy: float = math.nan
    final_accuracy: float = math.nan
    staleness_max: int | None = None
    learner_idle_fraction: float = math.nan
    """echo2: the learner's wait for batches / (wait + train). Baseline: the share of the
    loop spent sampling and scoring, during which nothing trains."""
    train_s_per_step: float = math.nan
    """Mean time of the optimizer part of a step (re-score, loss, backward, AdamW)."""
    wait_s_per_step: float = math.nan
    """echo2: mean learner wait for a batch. Baseline: mean sampling + scoring time."""
    first_wait_s: float = math.nan
    """echo2: the learner's wait for its first batch (the pipeline filling up)."""
    process_wall_s: float = math.nan
    """Whole case, start-up and shutdown included (echo2: the launcher's lifetime)."""
    summary_wall_s: float = math.nan
    """echo2's own ``summary.json`` ``wall_s`` (includes the warm-start evaluation)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def steps_per_s(self) -> float:
        return _rate(self.steps, self.train_wall_s)

    @property
    def rollouts_per_s(self) -> float:
        return _rate(self.rollouts, self.train_wall_s)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"case": self.case, "description": self.description, "ok": self.ok}
        if self.error:
            out["error"] = self.error
        out.update(
            steps=self.steps,
            rollouts=self.rollouts,
            train_wall_s=_num(self.train_wall_s, 3),
            steps_per_s=_num(self.steps_per_s, 4),
            rollouts_per_s=_num(self.rollouts_per_s, 1),
            initial_accuracy=_num(self.initial_accuracy, 4),
            final_accuracy=_num(self.final_accuracy, 4),
            staleness_max=self.staleness_max,
            learner_idle_fraction=_num(self.learner_idle_fraction, 4),
            train_s_per_step=_num(self.train_s_per_step, 4),
            wait_s_per_step=_num(self.wait_s_per_step, 4),
            first_wait_s=_num(self.first_wait_s, 3),
            process_wall_s=_num(self.process_wall_s, 2),
            summary_wall_s=_num(self.summary_wall_s, 2),
            **self.extra,
        )
        return out


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 and math.isfinite(seconds) else math.nan


def _num(value: float | None, digits: int) -> float | None:
    """JSON-safe rounding: NaN and inf become null."""
    if value is None or not math.isfinite(value):
        return None
    return round(float(value), digits)


# -- (a) the baseline: a plain GRPO loop -------------------------------------------------


def run_baseline(
    steps: int = DEFAULT_STEPS,
    *,
    max_wall_s: float = 0.0,
    eval_prompts: int = EVAL_PROMPTS,
    threads: int = BASELINE_THREADS,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> CaseResult:
    """Train the warm start for ``steps`` GRPO steps in this process, plainly.

    Same job and the same step as the learner: ``GROUPS_PER_STEP`` training prompts (the
    PromptSource's stream ``task.prompts(seed)``), ``GROUP_SIZE`` samples each at temperature 1
    from the model being trained, reward, then the learner's own pure step functions:
    ``echo2.rl.step.pack_groups`` (group z-score advantages) and ``optimiser_step``
    (``grpo_loss`` with ``old_policy = "sampler"``, AdamW with warm-up and gradient clipping).
    Stops after ``steps`` steps or once the training phase has lasted ``max_wall_s``
    (0 = no limit). Greedy accuracy on ``heldout(eval_prompts)`` is measured before and
    after, outside the timed phase. ``torch``'s thread count is set to ``threads`` and
    restored afterwards.
    """
    import numpy as np
    import torch

    from echo2.engines.base import SamplingParams
    from echo2.engines.torch_engine import TorchEngine
    from echo2.models import default_checkpoint_dir
    from echo2.models.tiny import TinyTransformer
    from echo2.models.tokenizer import PAD_ID
    from echo2.rl.step import StepSettings, optimiser_step, pack_groups
    from echo2.tasks.addition import AdditionTask

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        task = AdditionTask(digits=3)
        heldout = task.heldout(eval_prompts)
        model = TinyTransformer.load(default_checkpoint_dir())
        engine = TorchEngine(model=model, seed=seed)  # shares (and samples from) the model
        model.train()
        settings = StepSettings(
            lr=LR,
            warmup_steps=WARMUP_STEPS,
            grad_clip=GRAD_CLIP,
            clip_eps=CLIP_EPS,
            is_cap=IS_CAP,
            old_policy="sampler",
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS)
        stream = task.prompts(seed)

        def evaluate() -> float:
            ids = [engine.encode_prompt(p.text) for p in heldout]
            completions = engine.greedy(ids, max_new_tokens=MAX_NEW_TOKENS)
            return float(np.mean([task.reward(p, c.text) for p, c in zip(heldout, completions, strict=True)]))

        initial_accuracy = evaluate()
        sample_s = train_s = 0.0
        rollouts = done = 0
        rewards_seen: list[float] = []
        phase_start = time.perf_counter()
        while done < steps:
            if max_wall_s and time.perf_counter() - phase_start >= max_wall_s:
                break
            t0 = time.perf_counter()
            batch = [next(stream) for _ in range(GROUPS_PER_STEP)]
            prompt_ids = [engine.encode_prompt(p.text) for p in batch]
            completions = engine.generate(prompt_ids, GROUP_SIZE, params)
            rows = pack_groups(
                [
                    _scored_group(f"{done}.{i}", ids, group, [task.reward(prompt, c.text) for c in group])
                    for i, (prompt, ids, group) in enumerate(zip(batch, prompt_ids, completions, strict=True))
                ]
            )
            rewards_seen.extend(rows.rewards.tolist())
            t1 = time.perf_counter()
            optimiser_step(model, optimizer, rows, settings, version=done, pad_id=PAD_ID)
            t2 = time.perf_counter()
            sample_s += t1 - t0
            train_s += t2 - t1
            rollouts += len(rows)
            done += 1
            if log is not None and (done % 50 == 0 or done == steps):
                log(f"   baseline step {done}: reward {np.mean(rewards_seen[-GROUPS_PER_STEP * GROUP_SIZE :]):.3f}")
        train_wall_s = time.perf_counter() - phase_start
        final_accuracy = evaluate()
    finally:
        torch.set_num_threads(previous_threads)
    busy = sample_s + train_s
    return CaseResult(
        case="baseline",
        description=BASELINE_DESCRIPTION,
        steps=done,
        rollouts=rollouts,
        train_wall_s=train_wall_s,
        initial_accuracy=initial_accuracy,
        final_accuracy=final_accuracy,
        staleness_max=0,
        learner_idle_fraction=sample_s / busy if busy else math.nan,
        train_s_per_step=train_s / done if done else math.nan,
        wait_s_per_step=sample_s / done if done else math.nan,
        process_wall_s=time.perf_counter() - started,
        extra={"reward_mean": _num(float(np.mean(rewards_seen)) if rewards_seen else math.nan, 4)},
    )


def _scored_group(task_id: str, prompt_ids: list[int], completions: list[Any], rewards: list[float]) -> Any:
    """The ``ScoredGroup`` a Sampler and a Rewarder would make of one prompt's completions."""
    import numpy as np

    from echo2.actors.sampler import rollout_group
    from echo2.messages import PolicyVersion, ScoredGroup, TaskLease

    lease = TaskLease(lease_id=0, task_id=task_id, attempt=0, prompt="", group_size=len(completions), ttl_s=0.0)
    group = rollout_group(lease, "baseline", PolicyVersion(incarnation=0, version=0), prompt_ids, completions)
    return ScoredGroup(
        group=group, rewards=np.asarray(rewards, dtype=np.float32), keep=np.ones(len(completions), dtype=bool)
    )


# -- (b)-(d): echo2 through the launcher ---------------------------------------------------


def echo2_command(case: str, steps: int, run_dir: Path, *, max_wall_s: float, deadline_s: float) -> list[str]:
    topology, _ = ECHO2_CASES[case]
    learner = "actors.learner.config"
    overrides = [
        f"{learner}.max_steps={steps}",
        f"{learner}.eval_every=0",  # no evaluation inside the timed phase
        f"{learner}.checkpoint_every=0",  # nor checkpoints (the final one is after the clock)
        f"{learner}.eval_prompts={EVAL_PROMPTS}",
        f"{learner}.max_wall_s={float(max_wall_s)!r}",
        f"{learner}.lr_schedule=constant",  # the baseline's schedule, whatever the topology says
        f"run.deadline_s={float(deadline_s)!r}",
    ]
    command = [sys.executable, "-m", "echo2.launch", str(REPO / topology)]
    for override in overrides:
        command += ["--set", override]
    return [*command, "--run-dir", str(run_dir)]


def run_echo2(
    case: str,
    steps: int,
    *,
    max_wall_s: float = 0.0,
    timeout_s: float,
    keep: bool = False,
    log: Callable[[str], None] | None = None,
) -> CaseResult:
    """Run one echo2 topology as a subprocess and read its summary and learner metrics."""
    _, description = ECHO2_CASES[case]
    result = CaseResult(case=case, description=description)
    parent = Path(tempfile.mkdtemp(prefix=f"echo2-bench-{case}-"))
    launcher_log = parent / "launcher.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    # The launcher's own deadline stops the run cleanly (a partial summary) before ours.
    command = echo2_command(case, steps, parent, max_wall_s=max_wall_s, deadline_s=max(timeout_s - 20.0, 10.0))
    started = time.perf_counter()
    try:
        with open(launcher_log, "wb") as out:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )
            try:
                rc = _wait(proc, timeout_s)
            except BaseException:  # Ctrl-C: never leave the launcher (and its children) behind
                _stop(proc)
                raise
        result.process_wall_s = time.perf_counter() - started
        if rc is None:
            result.ok, result.error = False, f"timed out after {timeout_s:.0f} s (launcher stopped)"
        elif rc != 0:
            result.ok, result.error = False, f"launcher exited with code {rc}"
        from echo2.rundir import RunDir

        runs = sorted(p for p in parent.iterdir() if p.is_dir())
        run = RunDir(runs[-1]) if runs else None
        run_dir = run.root if run is not None else None
        summary_path = run.summary_path if run is not None else None
        if summary_path is None or not summary_path.exists():
            if result.ok:
                result.ok, result.error = False, "no summary.json was written"
        else:
            _read_run(result, run_dir, json.loads(summary_path.read_text()))
            if result.ok and result.steps < steps and not max_wall_s:
                result.ok, result.error = False, f"incomplete: {result.steps} of {steps} steps"
        if not result.ok and run is not None and run.status_path.exists():
            try:
                reason = json.loads(run.status_path.read_text()).get("reason")
            except (OSError, ValueError):
                reason = None
            if reason:
                result.error += f" (launcher: {reason})"
        if not result.ok and log is not None:
            log(f"!! {case}: {result.error}; command: {' '.join(command)}")
            for line in _failure_context(launcher_log, run_dir):
                log(f"   | {line}")
    finally:
        if keep:
            if log is not None:
                log(f"   {case}: run directory kept in {parent}")
        else:
            shutil.rmtree(parent, ignore_errors=True)
    return result


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The exit code, or None after stopping a launcher that ran past ``timeout_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher (it drains and stops its children), SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # its children get SIGTERM from PR_SET_PDEATHSIG
        proc.wait()


def _read_run(result: CaseResult, run_dir: Path, summary: dict[str, Any]) -> None:
    result.steps = int(summary.get("steps", 0))
    result.rollouts = int(summary.get("rollouts_trained", 0))
    result.initial_accuracy = float(summary.get("initial_accuracy", math.nan))
    result.final_accuracy = float(summary.get("final_accuracy", math.nan))
    result.staleness_max = summary.get("staleness_max")
    result.learner_idle_fraction = float(summary.get("learner_idle_fraction", math.nan))
    result.summary_wall_s = float(summary.get("wall_s", math.nan))
    result.extra = {
        "summary_steps_per_s": summary.get("steps_per_s"),
        "summary_rollouts_per_s": summary.get("rollouts_per_s"),
        "staleness_histogram": summary.get("staleness_histogram", {}),
        "drops_by_reason": summary.get("drops_by_reason", {}),
        "rollouts_trained_twice": summary.get("rollouts_trained_twice"),
    }
    steps = _learner_steps(run_dir)
    if steps:
        first, last = steps[0], steps[-1]
        phase_start = first["time_s"] - first.get("wait_s", 0.0) - first.get("train_s", 0.0)
        result.train_wall_s = last["time_s"] - phase_start
        waits = [s.get("wait_s", 0.0) for s in steps]
        trains = [s.get("train_s", 0.0) for s in steps]
        result.first_wait_s = waits[0]
        result.wait_s_per_step = sum(waits) / len(waits)
        result.train_s_per_step = sum(trains) / len(trains)
        result.extra["wait_s_after_first_per_step"] = _num(
            sum(waits[1:]) / (len(waits) - 1) if len(waits) > 1 else math.nan, 4
        )
        result.extra["steps_waiting_over_10ms"] = sum(w > 0.01 for w in waits)
        result.extra["reward_mean"] = _num(sum(s.get("reward_mean", 0.0) for s in steps) / len(steps), 4)
        result.extra["phase_from"] = "metrics/learner.jsonl"
    else:  # no per-step metrics: fall back on the summary's clock
        result.train_wall_s = result.summary_wall_s
        result.extra["phase_from"] = "summary.json wall_s (includes the warm-start evaluation)"


def _learner_steps(run_dir: Path) -> list[dict[str, Any]]:
    from echo2.rundir import RunDir

    records = [r for r in RunDir(run_dir).metrics("learner", "step") if "time_s" in r]
    return sorted(records, key=lambda r: r["step"])


def _failure_context(launcher_log: Path, run_dir: Path | None) -> list[str]:
    """The last lines of the launcher's output and of every process log."""
    lines: list[str] = []
    from echo2.rundir import RunDir

    sources = [("launcher", launcher_log)]
    if run_dir is not None:
        sources += [(p.stem, p) for p in RunDir(run_dir).log_paths()]
    for name, path in sources:
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        if not text:
            continue
        lines.append(f"--- {name} (last {min(len(text), LOG_TAIL_LINES)} lines)")
        lines += text[-LOG_TAIL_LINES:]
    return lines


# -- learner packing: padded vs packed steps on mixed lengths -----------------------------

PACKING_BUDGET = 4096
"""max_tokens_per_microbatch of the packed learner (the learner's default)."""
PACKING_REPEATS = 9
PACKING_FLOOR = 1.3
PACKING_BATCHES = ("mixed", "add3")


def packing_rows(batch: str, *, seed: int = 0) -> Any:
    """One learner batch (``GROUPS_PER_STEP`` x ``GROUP_SIZE`` rows) of addition problems.

    ``mixed``: each group's problem has 1-9 digits, short ones more often (P(d) ~ 1/d), as
    response lengths in RL are long-tailed: sequences of 6 to 31 tokens. ``add3``: the
    default job's 3-digit problems, 12-13 tokens each (nothing to pack). Responses are the
    reversed answers + EOS, as the warm start samples them; behaviour log-probs and
    advantages are random (they change what is learnt, not the cost).
    """
    import random

    import numpy as np

    from echo2.models.tokenizer import EOS_ID, CharTokenizer
    from echo2.rl.step import TrainingRows
    from echo2.tasks.addition import AdditionTask

    rng, gen = random.Random(f"packing-{batch}-{seed}"), np.random.default_rng(seed)
    tok = CharTokenizer()
    prompts, responses = [], []
    for g in range(GROUPS_PER_STEP):
        digits = rng.choices(range(1, 10), weights=[1 / d for d in range(1, 10)])[0] if batch == "mixed" else 3
        prompt = next(AdditionTask(digits=digits).prompts(seed * 1000 + g))
        ids = np.array(tok.encode_prompt(prompt.text), dtype=np.int32)
        answer = np.array([*tok.encode(prompt.answer), EOS_ID], dtype=np.int32)
        for _ in range(GROUP_SIZE):
            prompts.append(ids)
            stop = len(answer) if rng.random() < 0.75 else rng.randint(1, len(answer))  # a quarter stop early
            responses.append(answer[:stop])
    n = len(prompts)
    return TrainingRows(
        prompts=tuple(prompts),
        responses=tuple(responses),
        behaviour_logprobs=tuple(gen.uniform(-2.0, -0.1, size=len(r)).astype(np.float32) for r in responses),
        advantages=gen.normal(size=n).astype(np.float32),
        rewards=np.zeros(n, np.float32),
        sampler_ids=("bench",) * n,
    )


def run_packing(
    batch: str = "mixed",
    *,
    repeats: int = PACKING_REPEATS,
    budget: int = PACKING_BUDGET,
    threads: int = BASELINE_THREADS,
) -> dict[str, Any]:
    """Learner tokens/s of the padded step and the packed step on the same batches, same run.

    Each repeat times one ``optimiser_step`` of each kind (the order alternating, after one
    untimed warm-up of each) on the warm start, on a fresh batch; tokens are the batch's
    prompt + response tokens (the same for both kinds). Reported: the medians, and packed /
    padded as the median of the per-repeat ratios (the floor's) and as a ratio of medians.
    """
    import statistics

    import torch

    from echo2.models import default_checkpoint_dir
    from echo2.models.tiny import TinyTransformer
    from echo2.models.tokenizer import PAD_ID
    from echo2.rl.step import StepSettings, optimiser_step

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kinds = {"padded": 0, "packed": budget}
        models = {kind: TinyTransformer.load(default_checkpoint_dir()).train() for kind in kinds}
        optimizers = {kind: torch.optim.AdamW(m.parameters(), lr=LR) for kind, m in models.items()}
        rates: dict[str, list[float]] = {kind: [] for kind in kinds}
        fill: list[float] = []
        for repeat in range(repeats + 1):
            rows = packing_rows(batch, seed=repeat)
            lengths = rows.sequence_lengths
            fill.append(sum(lengths) / (len(lengths) * max(lengths)))
            order = list(kinds) if repeat % 2 else list(reversed(kinds))
            for kind in order:
                settings = StepSettings(lr=LR, warmup_steps=WARMUP_STEPS, max_tokens_per_microbatch=kinds[kind])
                t0 = time.perf_counter()
                optimiser_step(models[kind], optimizers[kind], rows, settings, version=repeat, pad_id=PAD_ID)
                if repeat:  # repeat 0 warms up
                    rates[kind].append(sum(lengths) / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(previous_threads)
    medians = {kind: statistics.median(r) for kind, r in rates.items()}
    # Paired: the two steps of a repeat run back to back, so load drifting on a shared
    # machine cancels in their ratio better than in a ratio of medians (reported as well).
    paired = statistics.median(a / b for a, b in zip(rates["packed"], rates["padded"], strict=True))
    return {
        "batch": batch,
        "rows": GROUPS_PER_STEP * GROUP_SIZE,
        "max_tokens_per_microbatch": budget,
        "padded_fill": _num(statistics.median(fill), 3),
        "repeats": repeats,
        "tokens_per_s_median": {kind: _num(m, 1) for kind, m in medians.items()},
        "tokens_per_s": {kind: [_num(x, 1) for x in r] for kind, r in rates.items()},
        "packed_over_padded": _num(paired, 3),
        "ratio_of_medians": _num(medians["packed"] / medians["padded"], 3),
    }


def packing_floor(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's floor: packed learner tokens/s >= 1.3x padded on the mixed-length batch."""
    mixed = next((r for r in results if r["batch"] == "mixed"), None)
    value = None if mixed is None else mixed["packed_over_padded"]
    result = "SKIP" if value is None else ("PASS" if value >= PACKING_FLOOR else "FAIL")
    return {
        "floor": f"packed learner tokens/s >= {PACKING_FLOOR}x padded (mixed)",
        "value": value,
        "min": PACKING_FLOOR,
        "result": result,
    }


def packing_main(args: argparse.Namespace) -> int:
    results = []
    for batch in PACKING_BATCHES:
        print(f".. packing: {batch} batch, {args.packing_repeats} repeats", file=sys.stderr, flush=True)
        results.append(run_packing(batch, repeats=args.packing_repeats, threads=args.packing_threads))
    floor = packing_floor(results)
    if args.json:
        for r in results:
            print(json.dumps(r))
        print(json.dumps({"floors": [floor]}))
    else:
        print(f"{'batch':<6} {'fill':>5} {'padded tok/s':>12} {'packed tok/s':>12} {'packed/padded':>13}")
        for r in results:
            m = r["tokens_per_s_median"]
            print(
                f"{r['batch']:<6} {r['padded_fill']:>5.2f} {m['padded']:>12.0f} {m['packed']:>12.0f} "
                f"{r['packed_over_padded']:>13.2f}"
            )
        print(
            f"\nmedians of {args.packing_repeats} steps each; packed/padded: median of the per-step ratios; "
            "fill: real tokens / padded tensor slots"
        )
        print(f"  {floor['result']:4}  {floor['floor']}: {floor['value']} (min {floor['min']:g})")
    return 1 if (args.check and floor["result"] == "FAIL") else 0


# -- comparison ----------------------------------------------------------------------------


def ratios(results: list[CaseResult]) -> dict[str, dict[str, float | None]]:
    """Per case: steps/s and rollouts/s over the baseline's, final accuracy minus its (points)."""
    base = next((r for r in results if r.case == "baseline" and r.ok), None)
    out: dict[str, dict[str, float | None]] = {}
    for r in results:
        if base is None or not r.ok:
            out[r.case] = {"steps_per_s": None, "rollouts_per_s": None, "final_accuracy_points": None}
            continue
        out[r.case] = {
            "steps_per_s": _num(r.steps_per_s / base.steps_per_s, 3),
            "rollouts_per_s": _num(r.rollouts_per_s / base.rollouts_per_s, 3),
            "final_accuracy_points": _num(100 * (r.final_accuracy - base.final_accuracy), 1),
        }
    return out


def floors(results: list[CaseResult]) -> list[dict[str, Any]]:
    """The issue's floors; FAIL when a needed case failed, SKIP when it was not run."""
    by_case = {r.case: r for r in results}
    checks: list[dict[str, Any]] = []

    name = f"multi-process S=3 steps/s >= {FLOOR_STEPS_RATIO}x single-process loop"
    base, s3 = by_case.get("baseline"), by_case.get("multi-S3")
    if base is None or s3 is None:
        checks.append({"floor": name, "value": None, "min": FLOOR_STEPS_RATIO, "result": "SKIP"})
    elif not (base.ok and s3.ok):
        checks.append({"floor": name, "value": None, "min": FLOOR_STEPS_RATIO, "result": "FAIL"})
    else:
        value = s3.steps_per_s / base.steps_per_s
        checks.append(
            {
                "floor": name,
                "value": _num(value, 3),
                "min": FLOOR_STEPS_RATIO,
                "result": "PASS" if value >= FLOOR_STEPS_RATIO else "FAIL",
            }
        )

    name = f"S=3 final accuracy >= S=0's - {FLOOR_ACCURACY_POINTS:g} points at equal steps"
    s0 = by_case.get("multi-S0")
    check: dict[str, Any] = {"floor": name, "value": None, "min": -FLOOR_ACCURACY_POINTS}
    if s0 is None or s3 is None:
        check["result"] = "SKIP"
    elif not (s0.ok and s3.ok):
        check["result"] = "FAIL"
    else:
        value = 100 * (s3.final_accuracy - s0.final_accuracy)
        check["value"] = _num(value, 1)
        check["s0_steps"], check["s3_steps"] = s0.steps, s3.steps
        if s0.steps != s3.steps:
            check["result"] = "SKIP"
            check["note"] = "unequal steps (a --seconds budget)"
        else:
            check["result"] = "PASS" if value >= -FLOOR_ACCURACY_POINTS else "FAIL"
    checks.append(check)
    return checks


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def print_table(results: list[CaseResult], rel: dict[str, dict[str, float | None]]) -> None:
    header = (
        f"{'case':<38} {'steps':>5} {'train s':>8} {'steps/s':>8} {'x(a)':>5} {'rollouts/s':>10} "
        f"{'x(a)':>5} {'acc start->end':>14} {'vs(a)':>6} {'stale':>5} {'idle':>5} "
        f"{'train/step':>10} {'wait/step':>9} {'total s':>8} {'cpu s':>6} {'load':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if not r.ok and not r.steps:
            print(f"{r.description:<38} FAILED: {r.error}")
            continue
        ratio = rel.get(r.case, {})
        loads = r.extra.get("loadavg_1min_before_after") or []
        load = "->".join(f"{x:.1f}" for x in loads)
        accuracy = f"{_fmt(r.initial_accuracy, '.3f')}->{_fmt(r.final_accuracy, '.3f')}"
        points = ratio.get("final_accuracy_points")
        print(
            f"{r.description:<38} {r.steps:>5} {_fmt(r.train_wall_s, '8.1f'):>8} "
            f"{_fmt(r.steps_per_s, '8.3f'):>8} {_fmt(ratio.get('steps_per_s'), '5.2f'):>5} "
            f"{_fmt(r.rollouts_per_s, '10.1f'):>10} {_fmt(ratio.get('rollouts_per_s'), '5.2f'):>5} "
            f"{accuracy:>14} {_fmt(points, '+6.1f'):>6} {_fmt(r.staleness_max, 'd'):>5} "
            f"{_fmt(100 * r.learner_idle_fraction, '4.0f') + '%':>5} "
            f"{_fmt(r.train_s_per_step, '10.3f'):>10} {_fmt(r.wait_s_per_step, '9.3f'):>9} "
            f"{_fmt(r.process_wall_s, '8.1f'):>8} {_fmt(r.extra.get('cpu_s'), '6.0f'):>6} {load:>9}"
        )
        if not r.ok:
            print(f"{'':<38} ^ FAILED: {r.error}")
    print(
        "\ntrain s: the training phase (first step to last, no start-up or evaluations); "
        "vs(a): final accuracy minus (a)'s, in points;\nidle / wait/step: for echo2 the "
        "learner waiting for a batch, for (a) the sampling+scoring part of each step; "
        "total s: the whole case incl. start-up/shutdown;\ncpu s: CPU seconds of the "
        "whole case (all its processes); load: 1-minute load average before->after (other "
        "work on the machine skews the times)."
    )


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (a launcher counts its own)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


# -- command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help=f"learner steps per case (default {DEFAULT_STEPS})")
    parser.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="also stop each case after this many seconds of training (unlimited steps unless --steps)",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per case")
    parser.add_argument("--json", action="store_true", help="one JSON object per case, then one with ratios and floors")
    parser.add_argument("--check", action="store_true", help="exit 1 when a floor or a case fails")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per echo2 run before it is stopped")
    parser.add_argument("--keep", action="store_true", help="keep the echo2 run directories (paths on stderr)")
    parser.add_argument(
        "--packing",
        action="store_true",
        help="instead: learner tokens/s of padded vs packed steps on mixed-length and 3-digit batches",
    )
    parser.add_argument("--packing-repeats", type=int, default=PACKING_REPEATS, help="timed steps of each kind")
    parser.add_argument("--packing-threads", type=int, default=BASELINE_THREADS, help="torch threads of the steps")
    args = parser.parse_args(argv)
    if args.packing:
        return packing_main(args)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        parser.error(f"--cases: choose from {', '.join(CASES)}")
    cases = [c for c in CASES if c in cases]  # the baseline first: ratios need it
    if args.seconds < 0:
        parser.error("--seconds must be >= 0")
    if args.steps is not None:
        steps = args.steps
    elif args.seconds:
        steps = 10**9  # the time budget decides
    else:
        steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    if steps < 1:
        parser.error("--steps must be at least 1")
    if args.timeout is not None:
        timeout_s = args.timeout
    else:  # generous: shared 2-core machines run a step in 0.3-1 s
        budget = 4.0 * steps if not args.seconds else 2.0 * args.seconds
        if args.seconds and args.steps is not None:
            budget = min(budget, 4.0 * steps)
        timeout_s = 180.0 + budget

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    budget_text = f"{steps} steps" if steps < 10**9 else "no step limit"
    if args.seconds:
        budget_text += f", at most {args.seconds:g} s of training"
    log(f".. pipeline benchmark: {budget_text} per case; cases {', '.join(cases)}")
    started = time.perf_counter()
    results: list[CaseResult] = []
    for case in cases:
        t0 = time.perf_counter()
        load_before, cpu_before = os.getloadavg()[0], _cpu_seconds()
        log(f".. {case} ... (load average {load_before:.2f} on {os.cpu_count()} cores)")
        if case == "baseline":
            try:
                result = run_baseline(steps, max_wall_s=args.seconds, log=log)
            except Exception as exc:
                result = CaseResult(case="baseline", description=BASELINE_DESCRIPTION, ok=False, error=repr(exc))
                log(f"!! baseline failed: {exc!r}")
        else:
            result = run_echo2(case, steps, max_wall_s=args.seconds, timeout_s=timeout_s, keep=args.keep, log=log)
        result.extra["loadavg_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        result.extra["cpu_s"] = _num(_cpu_seconds() - cpu_before, 1)
        results.append(result)
        log(
            f".. {case}: {'ok' if result.ok else 'FAILED'}, {result.steps} steps, "
            f"{_fmt(result.steps_per_s, '.3f')} steps/s, final accuracy {_fmt(result.final_accuracy, '.3f')} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    rel = ratios(results)
    checks = floors(results)
    log(f".. {time.perf_counter() - started:.0f} s in all")
    max_load = max((x for r in results for x in r.extra.get("loadavg_1min_before_after", [])), default=0.0)
    busy = max_load > (os.cpu_count() or 1)
    busy_note = (
        f"WARNING: the machine was busy (1-minute load average up to {max_load:.1f} on "
        f"{os.cpu_count()} cores): times are skewed by other work, the two-thread loops most."
    )

    if args.json:
        for r in results:
            print(json.dumps({**r.to_json(), "ratio_to_baseline": rel.get(r.case)}))
        print(
            json.dumps(
                {"ratios_to_baseline": rel, "floors": checks, "max_loadavg_1min": max_load, "machine_busy": busy}
            )
        )
    else:
        print_table(results, rel)
        if busy:
            print(busy_note)
        print("\nfloors:")
        for check in checks:
            value = "n/a" if check["value"] is None else f"{check['value']:g}"
            if check["result"] == "FAIL" and check["value"] is None:
                value = "a case failed"
            note = f" [{check['note']}]" if "note" in check else ""
            print(f"  {check['result']:4}  {check['floor']}: {value} (min {check['min']:g}){note}")
    if busy and args.json:
        log(busy_note)
    failed = any(c["result"] == "FAIL" for c in checks) or any(not r.ok for r in results)
    return 1 if (args.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
