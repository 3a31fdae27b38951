"""Moved to :mod:`celery_nats_leader.worker.shared_leadership`; this path keeps working."""

from __future__ import annotations

from celery_nats_leader.worker.shared_leadership import (
    LeadershipCheck,
    LeaseSnapshot,
    LocalLeadership,
    SharedLeadership,
    WorkerLeadership,
    check_leadership,
    current,
    install,
)

__all__ = [
    "LeadershipCheck",
    "LeaseSnapshot",
    "LocalLeadership",
    "SharedLeadership",
    "WorkerLeadership",
    "check_leadership",
    "current",
    "install",
]
