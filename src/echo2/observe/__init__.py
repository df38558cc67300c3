"""Watching a run live: every process's ``/metrics`` (Prometheus) and ``/health``, and its launcher's.

* ``http``: a small HTTP/1.0 server on the asyncio loop (``asyncio.start_server``) and the
  probe the launcher uses; answering at all proves the loop is responsive.
* ``metrics``: the one mapping from what the actors already record (``ctx.record`` lines,
  ``statistics()`` records, the runtime's heartbeats and endpoint counters) to Prometheus
  families; names and units in ``docs/metrics.md``.
* ``health``: what live and ready mean, for a process and for a host's launcher, which
  serves the readiness of processes that cannot answer themselves (a stopped process).

Ports come from the topology (``[hosts.NAME] metrics_port``; off by default).
"""
