"""Moved to :mod:`celery_nats_leader.election.leader_services`; this path keeps working."""

from __future__ import annotations

from celery_nats_leader.election.leader_services import (
    LeaderContext,
    LeaderServiceRunner,
    LeadingScope,
    ServiceFunction,
)

__all__ = [
    "LeaderContext",
    "LeaderServiceRunner",
    "LeadingScope",
    "ServiceFunction",
]
