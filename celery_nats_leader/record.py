"""Moved to :mod:`celery_nats_leader.term.record`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.term.record import (
    LeaderRecord,
    decode_record,
    encode_fence,
    encode_record,
)

__all__ = [
    "LeaderRecord",
    "decode_record",
    "encode_fence",
    "encode_record",
]
