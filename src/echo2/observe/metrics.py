"""The one mapping from what a process records to Prometheus families (``docs/metrics.md``).

Nothing here measures anything new: a process's ``/metrics`` shows

* its actors' ``ctx.record(kind, ...)`` lines (``metrics/<actor>.jsonl``): per kind, the
  count of records since the process started (``echo2_records_total``) and the last value
  of each numeric field (``echo2_record_<kind>_<field>``; booleans as 0 and 1);
* its actors' ``statistics()`` records, the ones its heartbeats carry
  (``echo2_stats_<field>``, labelled with the record's type);
* its runtime's heartbeats (count, event-loop lag) and each endpoint's discards;
* its readiness (``echo2_ready``, ``echo2_actor_running``).

The launcher's ``/metrics`` shows its view of the host's processes (``launcher_families``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from echo2.messages import ActorStats, CustomStats, EndpointHealth
from echo2.observe.health import HostHealth, ProcessHealth

PREFIX = "echo2_"
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(*parts: str) -> str:
    """``echo2_<part>_<part>``, with every character Prometheus does not allow made ``_``."""
    return PREFIX + "_".join(_INVALID.sub("_", part) for part in parts)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


@dataclass
class RecordTracker:
    """The last numeric values and the count of each ``(actor, kind)`` of ``ctx.record`` lines."""

    last: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def observe(self, actor: str, kind: str, values: Mapping[str, Any]) -> None:
        key = (actor, kind)
        numbers = {name: n for name, value in values.items() if (n := _number(value)) is not None}
        self.last.setdefault(key, {}).update(numbers)
        self.counts[key] = self.counts.get(key, 0) + 1


@dataclass
class ProcessSnapshot:
    """What the runtime knows when it is scraped."""

    health: ProcessHealth
    records: RecordTracker
    stats: Mapping[str, ActorStats]
    endpoints: Mapping[str, EndpointHealth]
    heartbeats: int = 0
    loop_lag_s: float = 0.0


def process_families(snapshot: ProcessSnapshot) -> list[Metric]:
    process = snapshot.health.process
    families: list[Metric] = []
    ready = GaugeMetricFamily(metric_name("ready"), "1 when the process is ready (see /health)", labels=["process"])
    ready.add_metric([process], float(snapshot.health.ready))
    running = GaugeMetricFamily(
        metric_name("actor_running"), "1 while the actor's run() runs", labels=["process", "actor"]
    )
    for actor, state in snapshot.health.actors.items():
        running.add_metric([process, actor], float(state == "running"))
    beats = CounterMetricFamily(metric_name("heartbeats"), "heartbeat ticks of the runtime", labels=["process"])
    beats.add_metric([process], float(snapshot.heartbeats))
    lag = GaugeMetricFamily(
        metric_name("loop_lag_seconds"), "event-loop lag measured at the last heartbeat", labels=["process"]
    )
    lag.add_metric([process], snapshot.loop_lag_s)
    families += [ready, running, beats, lag]

    for counter_field in ("decode_errors", "dropped", "disconnects"):
        family = CounterMetricFamily(
            metric_name("endpoint", counter_field),
            f"EndpointHealth.{counter_field} of the endpoint",
            labels=["process", "endpoint"],
        )
        for endpoint, health in snapshot.endpoints.items():
            family.add_metric([process, endpoint], float(getattr(health, counter_field)))
        families.append(family)
    inconsistent = CounterMetricFamily(
        metric_name("endpoint_inconsistent"),
        "well-formed messages whose fields contradict each other, by check",
        labels=["process", "endpoint", "check"],
    )
    for endpoint, health in snapshot.endpoints.items():
        for check, count in sorted(health.inconsistent.items()):
            inconsistent.add_metric([process, endpoint, check], float(count))
    families.append(inconsistent)

    records = CounterMetricFamily(
        metric_name("records"), "ctx.record lines since the process started", labels=["process", "actor", "kind"]
    )
    for (actor, kind), count in sorted(snapshot.records.counts.items()):
        records.add_metric([process, actor, kind], float(count))
    families.append(records)
    by_name: dict[str, GaugeMetricFamily] = {}
    for (actor, kind), values in sorted(snapshot.records.last.items()):
        for name, value in values.items():
            full = metric_name("record", kind, name)
            gauge = by_name.get(full)
            if gauge is None:
                gauge = by_name[full] = GaugeMetricFamily(
                    full, f"last {name} of the {kind!r} records in metrics/<actor>.jsonl", labels=["process", "actor"]
                )
            gauge.add_metric([process, actor], value)
    families += by_name.values()
    families += _stats_families(process, snapshot.stats)
    return families


def _stats_families(process: str, stats: Mapping[str, ActorStats]) -> Iterator[Metric]:
    by_name: dict[str, GaugeMetricFamily] = {}
    for actor, record in sorted(stats.items()):
        values = record.values if isinstance(record, CustomStats) else msgspec.structs.asdict(record)
        for name, value in values.items():
            number = _number(value)
            if number is None:  # tables (per-reason counts) stay in the heartbeats
                continue
            full = metric_name("stats", name)
            family = by_name.get(full)
            if family is None:
                family = by_name[full] = GaugeMetricFamily(
                    full, f"{name} of the actor's statistics() record", labels=["process", "actor", "record"]
                )
            family.add_metric([process, actor, type(record).__name__], number)
    yield from by_name.values()


def launcher_families(health: HostHealth) -> list[Metric]:
    ready = GaugeMetricFamily(
        metric_name("process_ready"),
        "1 when the process answered ready within the heartbeat timeout",
        labels=["process"],
    )
    alive = GaugeMetricFamily(metric_name("process_alive"), "1 while the process runs", labels=["process"])
    restarts = CounterMetricFamily(metric_name("process_restarts"), "restarts by the launcher", labels=["process"])
    age = GaugeMetricFamily(
        metric_name("process_last_ready_age_seconds"),
        "seconds since the process last answered ready",
        labels=["process"],
    )
    for name, view in health.processes.items():
        ready.add_metric([name], float(view.ready))
        alive.add_metric([name], float(view.pid is not None))
        restarts.add_metric([name], float(view.restarts))
        if view.last_ready_age_s is not None:
            age.add_metric([name], view.last_ready_age_s)
    return [ready, alive, restarts, age]


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def exposition(families: Iterable[Metric]) -> tuple[int, str, bytes]:
    """An HTTP answer carrying ``families`` in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return 200, CONTENT_TYPE_LATEST, generate_latest(registry)
