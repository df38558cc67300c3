"""The distributed Learner with 2 CPU ranks over gloo (torchrun): identical weights on every
rank after data-parallel GRPO steps, and rank 0's counters cover every group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = r"""
import sys
import numpy as np
import torch
import torch.distributed as dist
from echo2.job import JobConfig
from echo2.actors.learner import LearnerConfig
from echo2.learner_dist import DistributedLearner, follower_loop, init_distributed, stop_followers
from echo2.messages import RolloutGroup, ScoredGroup

torch.set_num_threads(1)
init_distributed()
rank = dist.get_rank()
out = sys.argv[1]

def group(i, version):
    rng = np.random.default_rng(i)
    tokens = rng.integers(3, 15, size=8).astype(np.int32)
    return ScoredGroup(
        group=RolloutGroup(lease_id=i, task_id=f"t{i}", attempt=0, sampler_id="s", incarnation=0,
                           version=version, prompt="1+2=", answer="3",
                           prompt_token_ids=np.array([1, 4, 13, 5, 14], dtype=np.int32),
                           token_ids=np.append(tokens, 2).astype(np.int32), logprobs=np.full(9, -2.0, np.float32),
                           offsets=np.array([0, 4, 9], dtype=np.int32), texts=["", ""], finish_reasons=["length", "eos"]),
        rewards=np.array([1.0, 0.0], dtype=np.float32), keep=np.array([True, True]))

if rank == 0:
    learner = DistributedLearner("learner", LearnerConfig(warmup_steps=1, eval_prompts=4, lr=1e-3), JobConfig())
    from echo2.learner_dist import _FollowerContext
    learner.ctx = _FollowerContext()  # the actor context the runtime would give rank 0
    learner._build()
    for step in range(3):
        learner._train_step([group(4 * step + k, step) for k in range(4)])
        learner.version += 1
    stop_followers()
    assert learner.rollouts_trained == 3 * 4 * 2, learner.rollouts_trained
    assert len(learner.trained_tasks) == 12
    model = learner.policy.model
else:
    model = follower_loop().policy.model
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}/rank{rank}.pt")
dist.destroy_process_group()
"""


def test_two_gloo_ranks_stay_identical(tmp_path: Path) -> None:
    script = tmp_path / "dist_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, ECHO2_DIST_BACKEND="gloo", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import torch

    from echo2.models import default_checkpoint_dir
    from echo2.models.tiny import TinyTransformer

    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    initial = TinyTransformer.load(default_checkpoint_dir()).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    assert any(not torch.equal(a[k], initial[k]) for k in a)  # the steps changed the weights
