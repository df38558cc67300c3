"""When the WeightPublisher broadcasts a new version: the overlap condition at the publisher.

The learner hands over a snapshot every kappa updates. Broadcasting one to the pool takes
T_bcast (publication until ceil(active / gamma) members installed it). While
T_bcast <= kappa * T_train each version lands before the next is ready, and publishing
every snapshot at once costs nothing. When T_bcast > kappa * T_train (the overlap
condition of ``echo2.capacity.model`` failing on its broadcast term alone), a version
published at once cancels the one still streaming: relay chains restart with every
snapshot, and the far or slow members install nothing at all.

``PublicationPolicy`` then publishes less often: a newer snapshot waits while the version
in flight has not reached its T_bcast, as long as that version is still within the
staleness budget S (until the learner passes ``version + S``, work made from it can be
trained); past that it is superseded at once, since nobody could be trained from it. Only the newest waiting snapshot is kept (older ones are skipped: no
member could install them in time). Nothing changes while broadcast keeps up.

The learner's progress (versions per second) is measured from the snapshots' arrivals,
not assumed from T_train: a learner that waits for data advances more slowly, and the
version in flight stays useful for longer.

T_bcast of a version that never reaches its threshold (superseded, or still streaming) is
unknown, but at least as long as it streamed: ``t_bcast_s`` takes such lower bounds into
account, so a pool that never completes a version does not look infinitely fast.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass

from echo2.capacity.model import BroadcastRemedy, broadcast_remedy

WINDOW = 8
"""Recent versions (and snapshot arrivals) the estimates are taken over."""


@dataclass
class _Version:
    version: int
    published_s: float
    members: int
    t_bcast_s: float | None = None
    superseded_s: float | None = None

    def streamed_s(self, now_s: float) -> float:
        """How long it was broadcast without reaching its threshold (a lower bound of its T_bcast)."""
        return (self.superseded_s if self.superseded_s is not None else now_s) - self.published_s


@dataclass(frozen=True)
class Bottleneck:
    """Broadcast is slower than training: what was measured and what would restore overlap."""

    t_bcast_s: float
    """Estimated T_bcast (a lower bound when no recent version reached its threshold)."""
    lower_bound: bool
    kappa: int
    t_train_s: float
    remedy: BroadcastRemedy

    def describe(self, staleness: int, bytes_per_version: int) -> str:
        bound = ">" if self.lower_bound else ""
        r = self.remedy
        return (
            f"T_bcast {bound}{self.t_bcast_s:.2f} s exceeds kappa x T_train = {self.kappa} x {self.t_train_s:.3f} s "
            f"= {self.kappa * self.t_train_s:.2f} s: broadcast is the bottleneck, so versions are published less "
            f"often (a newer one waits until the one in flight lands or would be older than S = {staleness} allows). "
            f"Overlap needs kappa >= {r.kappa} (S >= {r.staleness} with the default kappa = S - 1), or at most "
            f"{_mb(r.bytes_per_version)} per version (now {_mb(bytes_per_version)}: delta_anchor_every, a smaller "
            "model or LoRA adapters), or faster links"
        )


class PublicationPolicy:
    """Decides, per newest snapshot, whether to publish now or let the version in flight land."""

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=WINDOW)
        self._kappa: int | None = None
        self.held = 0
        """Snapshots held back (each counted once) while the version in flight finished."""
        self._last_held = -1

    # -- measurements ----------------------------------------------------------------

    def snapshot_arrived(self, version: int, now_s: float) -> None:
        if self._arrivals and version > self._arrivals[-1][1]:
            step = version - self._arrivals[-1][1]
            self._kappa = step if self._kappa is None else min(self._kappa, step)
        self._arrivals.append((now_s, version))

    def published(self, version: int, members: int, now_s: float) -> None:
        """``version`` was published to ``members`` members (0: nobody to wait for)."""
        for previous in self._versions.values():
            if previous.t_bcast_s is None and previous.superseded_s is None:
                previous.superseded_s = now_s
        self._versions[version] = _Version(version, now_s, members)
        while len(self._versions) > WINDOW:
            self._versions.popitem(last=False)

    def reached(self, version: int, t_bcast_s: float) -> None:
        """``version`` reached its threshold ``t_bcast_s`` after publication."""
        tracked = self._versions.get(version)
        if tracked is not None:
            tracked.t_bcast_s = t_bcast_s

    @property
    def kappa(self) -> int:
        """Learner updates per snapshot, as the snapshots' versions show (1 until two arrived)."""
        return self._kappa or 1

    def learner_rate(self) -> float | None:
        """Learner versions per second over the recent snapshots (None: not measured yet)."""
        if len(self._arrivals) < 2:
            return None
        (t0, v0), (t1, v1) = self._arrivals[0], self._arrivals[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 and v1 > v0 else None

    def t_bcast_s(self, now_s: float) -> tuple[float, bool] | None:
        """(Estimated T_bcast, whether it is only a lower bound): the median of the recent
        versions that reached their threshold, raised to the longest that any recent one
        streamed without reaching it. None before any version was published."""
        versions = [v for v in self._versions.values() if v.members]
        if not versions:
            return None
        reached = [v.t_bcast_s for v in versions if v.t_bcast_s is not None]
        short = [v.streamed_s(now_s) for v in versions if v.t_bcast_s is None]
        measured = statistics.median(reached) if reached else 0.0
        bound = max(short, default=0.0)
        if reached and measured >= bound:
            return measured, False
        return max(measured, bound), True

    # -- decisions -----------------------------------------------------------------------

    def in_flight(self) -> _Version | None:
        """The last published version if it has not reached its threshold yet."""
        if not self._versions:
            return None
        last = next(reversed(self._versions.values()))
        return last if last.t_bcast_s is None and last.members else None

    def hold_s(self, newest: int, now_s: float) -> float:
        """0: publish ``newest`` now. > 0: hold it (a newer snapshot replaces it) and decide
        again after that many seconds, or when the version in flight lands."""
        current = self.in_flight()
        rate = self.learner_rate()
        if current is None or rate is None or newest <= current.version:
            return 0.0
        since_s, learner_then = self._arrivals[-1]
        learner_now = learner_then + (now_s - since_s) * rate
        # Work made from ``current`` is admissible until the learner passes current + S.
        left_s = (current.version + self.staleness - learner_now) / rate
        if left_s <= 0:
            return 0.0
        if newest != self._last_held:
            self._last_held = newest
            self.held += 1
        return left_s

    def bottleneck(self, t_train_s: float, bytes_per_version: int, now_s: float) -> Bottleneck | None:
        """What the overlap condition says about the measured broadcast (None when it holds
        or cannot be judged yet: no T_train, no version published)."""
        estimate = self.t_bcast_s(now_s)
        if estimate is None or t_train_s <= 0:
            return None
        t_bcast_s, lower_bound = estimate
        remedy = broadcast_remedy(self.kappa, t_train_s, t_bcast_s, bytes_per_version)
        if remedy is None:
            return None
        return Bottleneck(t_bcast_s, lower_bound, self.kappa, t_train_s, remedy)


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g} MB"
