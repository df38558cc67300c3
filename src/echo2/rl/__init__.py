"""Learning-plane math, pure functions: the learner step (``step``: pack groups into rows, one
optimiser step), the off-policy GRPO objective (``grpo``) and per-token log-probs (``logprobs``)."""
