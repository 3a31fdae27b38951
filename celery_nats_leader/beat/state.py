"""Moved to :mod:`celery_nats_leader.beat.schedule_store`; this path keeps working."""

from __future__ import annotations

from celery_nats_leader.beat.schedule_store import (
    STATE_VERSION,
    EntryState,
    ScheduleStateStore,
    decode_state,
    encode_state,
    read_schedule_states,
    state_key,
)

__all__ = [
    "STATE_VERSION",
    "EntryState",
    "ScheduleStateStore",
    "decode_state",
    "encode_state",
    "read_schedule_states",
    "state_key",
]
