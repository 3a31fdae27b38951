"""Moved to :mod:`celery_nats_leader.worker.election`; this path keeps working."""

from __future__ import annotations

from celery_nats_leader.worker.election import (
    ERROR_REPEAT_SECONDS,
    LeaderQueueController,
    WorkerElection,
)

__all__ = [
    "ERROR_REPEAT_SECONDS",
    "LeaderQueueController",
    "WorkerElection",
]
