"""Multi-turn environments: the seam (``base``), the episode rules shared by the sampler
and the trusted replay (``episode``), playing (``play``), replaying (``replay``), the
built-in ``chain_addition`` and adapters (``openenv``, ``tools``)."""

from echo2.envs.base import Action, Environment, EnvironmentSpec, StepResult, load_environment

__all__ = ["Action", "Environment", "EnvironmentSpec", "StepResult", "load_environment"]
