"""Moved to :mod:`celery_nats_leader.observe.probes`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.observe.probes import (
    DEFAULT_LOOP_TIMEOUT_SECONDS,
    ProbeResult,
    ProbeServer,
    liveness,
    readiness,
)

__all__ = ["DEFAULT_LOOP_TIMEOUT_SECONDS", "ProbeResult", "ProbeServer", "liveness", "readiness"]
