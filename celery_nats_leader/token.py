"""Moved to :mod:`celery_nats_leader.term.token`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.term.token import (
    ALLCALL_EPOCH_FLOOR,
    FencingToken,
    epoch_strategy,
)

__all__ = [
    "ALLCALL_EPOCH_FLOOR",
    "FencingToken",
    "epoch_strategy",
]
