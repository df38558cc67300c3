"""Learning-plane math: the off-policy GRPO objective and the capacity/activation model."""
