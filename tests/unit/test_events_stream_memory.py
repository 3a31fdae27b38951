"""The events stream through the in-memory backend's stream methods.

The operator functions of :mod:`celery_nats_leader.ops.events` only use the
backend's stream methods; the in-memory double keeps what is published on a
stream's subjects for its ``max_age``, as the real stream does (the real one
is tested in tests/integration/test_events.py).
"""

from __future__ import annotations

from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.election.events import EventKind, TransitionEvent, event_subject
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.ops.events import ensure_events_stream, read_events, stream_info

BUCKET = "elections"


def event(role: str, seq: int, kind: EventKind = EventKind.PROMOTED) -> TransitionEvent:
    return TransitionEvent(
        event=kind, bucket=BUCKET, role=role, id=f"host-{seq}", epoch=seq, seq=seq
    )


async def publish(backend: MemoryBackend, *events: TransitionEvent) -> None:
    for item in events:
        await backend.publish(event_subject(BUCKET, item.role), item.encode())


async def test_without_a_stream_nothing_is_kept() -> None:
    backend = MemoryBackend(MemoryServer())
    await publish(backend, event("beat", 1))
    assert await stream_info(backend, BUCKET) is None
    assert await read_events(backend, BUCKET) is None


async def test_the_stream_keeps_each_role_s_events_in_order_for_its_max_age() -> None:
    clock = ManualClock()
    backend = MemoryBackend(MemoryServer(clock))
    made = await ensure_events_stream(backend, BUCKET, max_age=60)
    assert (made.created, made.max_age, made.messages) == (True, 60, 0)
    assert made.subjects == (event_subject(BUCKET),)
    again = await ensure_events_stream(backend, BUCKET, max_age=60)
    assert not again.created

    await publish(backend, event("beat", 1), event("reports.daily", 2), event("beat", 3))
    await backend.publish("other.subject", b"{}")
    clock.advance(30)
    await publish(backend, event("beat", 4, EventKind.RESIGNED))

    kept = await read_events(backend, BUCKET)
    assert kept is not None
    assert [(e.role, e.seq, e.stream_seq) for e in kept] == [
        ("beat", 1, 1),
        ("reports.daily", 2, 2),
        ("beat", 3, 3),
        ("beat", 4, 4),
    ]
    beat = await read_events(backend, BUCKET, role="beat", limit=2)
    assert beat is not None
    assert [(e.seq, e.event) for e in beat] == [(3, EventKind.PROMOTED), (4, EventKind.RESIGNED)]

    # 61 s after the first three: only the one published 30 s later is kept.
    clock.advance(31)
    info = await stream_info(backend, BUCKET)
    assert info is not None and info.messages == 1
    left = await read_events(backend, BUCKET)
    assert left is not None and [e.seq for e in left] == [4]
