"""Watching the elections from outside a process: probes and metrics.

* :mod:`.probes`: the HTTP liveness/readiness endpoint
  (:class:`~.probes.ProbeServer`) of workers and beat.
* :mod:`.prometheus`: :class:`~.prometheus.PrometheusObserver`, the
  election metrics for ``prometheus_client``.
"""
