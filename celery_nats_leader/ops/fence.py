"""Moved to :mod:`celery_nats_leader.ops.fence_leader`; this path keeps working."""

from __future__ import annotations

from celery_nats_leader.ops.fence_leader import (
    DEFAULT_HANDOVER_WAIT,
    FenceOutcome,
    await_successor,
    fence_leader,
    fence_lines,
    request_fence,
    wait_for_successor,
)

__all__ = [
    "DEFAULT_HANDOVER_WAIT",
    "FenceOutcome",
    "await_successor",
    "fence_leader",
    "fence_lines",
    "request_fence",
    "wait_for_successor",
]
