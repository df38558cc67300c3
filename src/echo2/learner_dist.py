"""Former home of the data-parallel Learner, kept so existing topologies and commands work:
the actor is ``echo2.actors.distributed_learner`` (kind ``"distributed_learner"``) and the
torchrun entry point ``python -m echo2.launch.torchrun``."""

from echo2.actors.distributed_learner import DistributedLearner
from echo2.launch.torchrun import main

__all__ = ["DistributedLearner", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
