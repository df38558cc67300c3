"""What the Learner has trained: the one place that counts a group as trained and logs it.

Every learner mode (one process, simulated, data-parallel) accounts through
``TrainingAccount.commit``, and only once a step has committed: a step that raises leaves
no ``trained`` event for its groups, so the audit sees them as lost or in flight, never as
trained.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from echo2 import ledger as events
from echo2.messages import ScoredGroup

Ledger = Callable[[events.LedgerEvent], None]
"""Where ``trained`` events go: ``ActorContext.ledger``."""


class TrainingAccount:
    """Counters over every group trained so far (checkpointed: ``trained_tasks``)."""

    def __init__(self) -> None:
        self.staleness: Counter[int] = Counter()
        """learner version - rollout version -> groups trained at that staleness."""
        self.trained_tasks: set[str] = set()
        self.trained_twice = 0
        """Groups whose task had already been trained (must stay 0)."""
        self.rollouts_trained = 0
        """Completions trained (the kept ones of each group)."""

    def commit(
        self, groups: Sequence[ScoredGroup], *, learner_version: int, incarnation: int, ledger: Ledger
    ) -> list[int]:
        """Count ``groups`` as trained by the step at ``learner_version``, which has committed.

        Returns each group's staleness (``learner_version - version``), in order.
        """
        lags = []
        for scored in groups:
            g = scored.group
            if g.task_id in self.trained_tasks:
                self.trained_twice += 1
            self.trained_tasks.add(g.task_id)
            lag = learner_version - g.version
            self.staleness[lag] += 1
            lags.append(lag)
            self.rollouts_trained += int(np.count_nonzero(scored.keep))
            ledger(
                events.Trained(
                    task=g.task_id,
                    version=g.version,
                    learner_version=learner_version,
                    incarnation=incarnation,
                    sampler=g.sampler_id,
                )
            )
        return lags

    def summary(self) -> dict[str, Any]:
        """The accounting part of the run's ``summary.json``."""
        return {
            "staleness_max": max(self.staleness, default=0),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "rollouts_trained": self.rollouts_trained,
            "rollouts_trained_twice": self.trained_twice,
            "groups_trained": len(self.trained_tasks),
        }
