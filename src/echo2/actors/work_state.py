"""Work credit as state, not deltas: what a sampler holds, stated; the PromptSource reconciles.

Credit granted as deltas ("4 more", one per finished group) dies with a torn connection: a
``WorkRequest`` or a ``TaskLease`` lost in a link outage is never sent again, and a sampler
that reconnects holds nothing, is owed leases that will never come, and idles for the rest
of the run. Here each ``WorkRequest`` states the whole of it instead (``max_leases``, the
leases it ``held``, the ones it ``submitted`` lately), so any one of them repairs every
loss before it, and the PromptSource answers with a ``WorkGrant`` that fences the leases
sent before it.

The sampler (``SamplerWork``) states its work after each batch, after each install, when
the PromptSource welcomes it (again), and every ``restate_s`` while it holds fewer leases
than it can (``due``). The PromptSource (``reconcile``) sorts the leases it has open
for that connection:

* in ``held``: the sampler holds it;
* in ``submitted``: answered, on its way to the Buffer (it closes, or expires, as before);
* sent before the ``WorkGrant`` the state acknowledges (``fence``): it arrived before that
  grant did, so a lease neither held nor submitted was lost: re-issued at once;
* sent after it: on its way (``pending``).

Credit is ``max_leases - len(held) - pending``, set, never added. A grant tells the sampler
how many leases the PromptSource counted as on their way; one that received fewer between
its state and the grant lost some, and states its work again at once, acknowledging that
grant: the next reconciliation finds them lost. A link outage therefore costs one state
after the link returns (``restate_s`` at most) and two round trips.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from echo2.messages import NO_VERSION, PolicyVersion, WorkGrant, WorkRequest

SUBMITTED_KEPT = 256
"""Answered lease ids a sampler keeps stating (newest first): a group still on its way
when the state is judged is not taken for lost. Older answers have closed long ago."""
FENCES_KEPT = 8
"""Grants per connection whose fences the PromptSource keeps (states acknowledge the
latest, or one of the few before it when a grant crossed a newer state)."""


@dataclass(frozen=True)
class Reconciled:
    """The PromptSource's view of one connection's stated work."""

    credits: int
    """Leases it may send now: ``max_leases`` minus held minus pending (never negative)."""
    lost: list[int]
    """Lease ids sent before the acknowledged grant that the sampler neither holds nor answered."""
    pending: int
    """Leases sent after the acknowledged grant, not yet stated held: on their way."""
    clamped: bool
    """The state asked for more than ``max_hold`` (``max_leases``, or leases held beyond it)."""


def reconcile(state: WorkRequest, open_leases: Iterable[int], fence: int | None, max_hold: int) -> Reconciled:
    """Judge ``state`` against the ids of the leases open for its connection.

    ``fence``: the largest lease id sent on this connection before the grant the state
    acknowledges (None: unknown, e.g. a state from before this PromptSource restarted;
    then nothing is judged lost, and the grant answering it sets a fence)."""
    held = set(state.held)
    submitted = set(state.submitted)
    lost: list[int] = []
    pending = 0
    for lease_id in open_leases:
        if lease_id in held or lease_id in submitted:
            continue
        if fence is not None and lease_id <= fence:
            lost.append(lease_id)
        else:
            pending += 1
    clamped = state.max_leases > max_hold or len(held) > max_hold
    max_leases = min(state.max_leases, max_hold)
    return Reconciled(max(0, max_leases - len(held) - pending), lost, pending, clamped)


class GrantFences:
    """Per connection: the fence (largest lease id sent before it) of each recent grant."""

    def __init__(self, kept: int = FENCES_KEPT) -> None:
        self._kept = kept
        self._by_peer: dict[bytes, OrderedDict[int, int]] = {}
        self._sent: dict[bytes, int] = {}

    def lease_sent(self, peer: bytes, lease_id: int) -> None:
        """``lease_id`` was handed to the connection (its send completed)."""
        self._sent[peer] = max(self._sent.get(peer, 0), lease_id)

    def fence_of(self, peer: bytes, sync: int) -> int | None:
        fences = self._by_peer.get(peer)
        return fences.get(sync) if fences is not None else None

    def granted(self, peer: bytes, sync: int, restored: Iterable[int] = ()) -> None:
        """A grant answering state ``sync`` is being sent now: every lease sent to ``peer``
        so far (and ``restored`` ones, sent by this PromptSource's previous incarnation on
        the same connection) precedes it."""
        fence = max(self._sent.get(peer, 0), max(restored, default=0))
        fences = self._by_peer.setdefault(peer, OrderedDict())
        fences[sync] = fence
        while len(fences) > self._kept:
            fences.popitem(last=False)

    def forget(self, peer: bytes) -> None:
        self._by_peer.pop(peer, None)
        self._sent.pop(peer, None)


class SamplerWork:
    """The sampler's side: the leases it holds and answered, and its states and grants."""

    def __init__(self, name: str, max_leases: int, restate_s: float) -> None:
        self.name = name
        self.max_leases = max_leases
        self.restate_s = restate_s
        self.held: OrderedDict[int, None] = OrderedDict()
        self.submitted: deque[int] = deque(maxlen=SUBMITTED_KEPT)
        self.owed = 0
        """Leases the last grant promised that have not arrived yet."""
        self.sync = 0
        self.acked = 0
        self.states_sent = 0
        self.restates_for_loss = 0
        """States sent at once because a grant's pending leases did not all arrive."""
        self._received = 0
        self._received_at: dict[int, int] = {}  # sync -> leases received when it was stated
        self._stated_at = -math.inf

    def received(self, lease_id: int) -> None:
        self.held[lease_id] = None
        self.owed = max(0, self.owed - 1)
        self._received += 1

    def answered(self, lease_ids: Iterable[int]) -> None:
        for lease_id in lease_ids:
            self.held.pop(lease_id, None)
            self.submitted.appendleft(lease_id)

    def due(self, now: float | None = None) -> bool:
        """Holding fewer leases than ``max_leases``, and no state sent for ``restate_s``."""
        now = time.monotonic() if now is None else now
        return len(self.held) < self.max_leases and now - self._stated_at >= self.restate_s

    def state(self, installed: PolicyVersion | None) -> WorkRequest:
        """The next ``WorkRequest``: everything the PromptSource needs, nothing relative."""
        self.sync += 1
        self.states_sent += 1
        self._stated_at = time.monotonic()
        self._received_at[self.sync] = self._received
        version = installed or NO_VERSION
        return WorkRequest(
            sampler_id=self.name,
            incarnation=version.incarnation,
            installed_version=version.version,
            max_leases=self.max_leases,
            held=list(self.held),
            submitted=list(self.submitted),
            sync=self.sync,
            acked=self.acked,
        )

    def granted(self, grant: WorkGrant) -> bool:
        """Take a grant in; True when leases it counted as on their way never came (state
        again now: acknowledging this grant, they are found lost and re-issued)."""
        received_then = self._received_at.get(grant.sync)
        if received_then is None or grant.sync < self.acked:
            return False  # a grant of a state we no longer track, or older than one we have
        self.acked = grant.sync
        for sync in [s for s in self._received_at if s <= grant.sync]:
            del self._received_at[sync]
        self.owed = grant.credits
        if self._received - received_then < grant.pending:
            self.restates_for_loss += 1
            return True
        return False
