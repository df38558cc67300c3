"""Learning-plane math, pure functions: the learner step (``step``: pack groups into rows, one
optimiser step), the off-policy GRPO objective (``grpo``) and per-token log-probs (``logprobs``)."""

from typing import Literal, get_args

OldPolicy = Literal["sampler", "learner"]
"""pi_old of the PPO ratio (``LearnerConfig.old_policy``; see ``echo2.rl.step``). Defined
here, without torch, so that configs can name it."""
OLD_POLICIES: tuple[OldPolicy, ...] = get_args(OldPolicy)
