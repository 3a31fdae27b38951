"""Moved to :mod:`celery_nats_leader.beat.dispatch_fence`; this path keeps working."""

from __future__ import annotations

from celery_nats_leader.beat.dispatch_fence import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    EPOCH_HEADER,
    ONCE_HEADER,
    ROLE_HEADER,
    RUN_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
    DispatchCheck,
    DispatchFence,
    FencedBeatTask,
    check_dispatch_token,
    enforce_dispatch_token,
)

__all__ = [
    "DISPATCHER_HEADER",
    "ENTRY_HEADER",
    "EPOCH_HEADER",
    "ONCE_HEADER",
    "ROLE_HEADER",
    "RUN_HEADER",
    "TICK_HEADER",
    "TOKEN_HEADER",
    "DispatchCheck",
    "DispatchFence",
    "FencedBeatTask",
    "check_dispatch_token",
    "enforce_dispatch_token",
]
