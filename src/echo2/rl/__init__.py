"""Learning-plane math, pure functions: the learner step (``step``: pack groups into rows, one
optimiser step), the off-policy GRPO objective (``grpo``), the other off-policy corrections
(``corrections``) and per-token log-probs (``logprobs``)."""

from typing import Literal, get_args

OldPolicy = Literal["sampler", "learner"]
"""pi_old of the PPO ratio (``LearnerConfig.old_policy``; see ``echo2.rl.step``). Defined
here, without torch, so that configs can name it."""
OLD_POLICIES: tuple[OldPolicy, ...] = get_args(OldPolicy)

DEFAULT_MICROBATCH_TOKENS = 4096
"""Default ``max_tokens_per_microbatch``: the tiny model's default batch (16 x 8 rows of at most
32 tokens) in one packed micro-batch; for larger models, a bound on each forward's activations."""
LossName = Literal["ppo_is", "tis_token_mask", "tis_sequence_mask", "geo_sequence_mask", "gspo", "cispo"]
"""The learner's objective (``LearnerConfig.loss``; each is described in ``echo2.rl.corrections``):
decoupled PPO with truncated IS (``grpo_loss``, the default), token / sequence / geometric-mean
masked IS, GSPO, CISPO. Defined here, without torch, so that configs can name it."""
LOSSES: tuple[LossName, ...] = get_args(LossName)
