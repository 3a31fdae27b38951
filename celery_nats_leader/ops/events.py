"""Reading the event trail: live from NATS, and the past from the optional stream.

The operator commands (``celery -A proj nats-leader events``, ``manage.py
election_events``) and the Django admin use these. The stream is reached
through the backend's stream methods, so the JetStream API and its error codes
stay inside the NATS door (``celery_nats_leader.nats``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from celery_nats_leader.core.backend import Backend, Subscription
from celery_nats_leader.core.errors import JetStreamUnavailableError
from celery_nats_leader.election.events import TransitionEvent, event_subject, events_stream

logger = logging.getLogger(__name__)

#: Default age of the events kept by the stream: a week.
DEFAULT_EVENTS_MAX_AGE_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class StreamInfo:
    """The events stream of a bucket.

    Attributes:
        name: The stream.
        subjects: The subjects it keeps.
        max_age: Seconds an event is kept.
        messages: Events kept now.
        created: Whether this call created it.

    """

    name: str
    subjects: tuple[str, ...]
    max_age: float
    messages: int
    created: bool = False


async def stream_info(backend: Backend, bucket: str, *, timeout: float = 5.0) -> StreamInfo | None:
    """The events stream of ``bucket``, or ``None`` when nobody created one."""
    name = events_stream(bucket)
    state = await backend.stream_state(name, timeout=timeout)
    if state is None:
        return None
    return StreamInfo(
        name=name,
        subjects=state.subjects,
        max_age=state.max_age,
        messages=state.messages,
    )


async def ensure_events_stream(
    backend: Backend,
    bucket: str,
    *,
    max_age: float = DEFAULT_EVENTS_MAX_AGE_SECONDS,
    replicas: int = 1,
    timeout: float = 5.0,
) -> StreamInfo:
    """Create the stream keeping ``bucket``'s events for ``max_age`` seconds, unless it exists.

    Args:
        backend: A connected backend.
        bucket: The election bucket.
        max_age: Seconds each event is kept (bounded: the stream never grows without end).
        replicas: Stream replicas.
        timeout: Seconds for each JetStream API call.

    Returns:
        The stream, with ``created`` telling whether this call made it.

    Raises:
        JetStreamUnavailableError: The server has no JetStream.

    """
    if max_age <= 0:
        raise ValueError("the events stream needs a bounded age (max_age > 0)")
    existing = await stream_info(backend, bucket, timeout=timeout)
    if existing is not None:
        return existing
    name = events_stream(bucket)
    await backend.create_stream(
        name,
        subjects=(event_subject(bucket),),
        max_age=max_age,
        replicas=replicas,
        timeout=timeout,
    )
    logger.info("created events stream %r (max_age=%gs)", name, max_age)
    info = await stream_info(backend, bucket, timeout=timeout)
    assert info is not None
    return StreamInfo(
        name=info.name,
        subjects=info.subjects,
        max_age=info.max_age,
        messages=info.messages,
        created=True,
    )


async def read_events(
    backend: Backend,
    bucket: str,
    *,
    role: str | None = None,
    limit: int | None = None,
    timeout: float = 5.0,
) -> list[TransitionEvent] | None:
    """The events the stream kept, oldest first (``None`` when there is no stream).

    Args:
        backend: A connected backend.
        bucket: The election bucket.
        role: Only this role's events.
        limit: Only the newest ``limit`` events.
        timeout: Seconds per JetStream API call.

    """
    messages = await backend.stream_messages(
        events_stream(bucket), event_subject(bucket, role or ">"), timeout=timeout
    )
    if messages is None:
        return None
    found: list[TransitionEvent] = []
    for message in messages:
        event = TransitionEvent.decode(message.data, stored_at=message.time, stream_seq=message.seq)
        if event is not None:
            found.append(event)
    return found[-limit:] if limit else found


async def follow_events(
    backend: Backend,
    bucket: str,
    callback: Callable[[TransitionEvent], None],
    *,
    role: str | None = None,
) -> Subscription:
    """Call ``callback`` with every event published from now on (until unsubscribed)."""

    async def handle(data: bytes, reply: str | None) -> None:
        event = TransitionEvent.decode(data)
        if event is not None:
            callback(event)

    return await backend.subscribe(event_subject(bucket, role or ">"), handle)


async def show_events(
    backend: Backend,
    bucket: str,
    on_event: Callable[[TransitionEvent], None],
    *,
    role: str | None = None,
    follow: bool = False,
    limit: int | None = None,
    count: int | None = None,
    timeout: float = 5.0,
) -> bool:
    """What the events commands do: the kept history, then (``follow``) live events.

    Args:
        backend: A connected backend.
        bucket: The election bucket.
        on_event: Called with each event, in order.
        role: Only this role's events.
        follow: Keep printing live events (until cancelled, or ``count``).
        limit: Only the newest ``limit`` kept events.
        count: With ``follow``, return after this many live events.
        timeout: Seconds per JetStream API call.

    Returns:
        Whether a stream keeps the history (``False``: only live events exist).

    """
    live: asyncio.Queue[TransitionEvent] = asyncio.Queue()
    # Subscribe before reading the history, so nothing falls in between.
    sub = await follow_events(backend, bucket, live.put_nowait, role=role) if follow else None
    try:
        try:
            history = await read_events(backend, bucket, role=role, limit=limit, timeout=timeout)
        except JetStreamUnavailableError:
            history = None
        shown = set()
        for event in history or []:
            shown.add((event.id, event.role, event.seq))
            on_event(event)
        if sub is None:
            return history is not None
        received = 0
        while count is None or received < count:
            event = await live.get()
            if (event.id, event.role, event.seq) in shown:
                continue
            received += 1
            on_event(event)
        return history is not None
    finally:
        if sub is not None:
            await sub.unsubscribe()


__all__ = [
    "DEFAULT_EVENTS_MAX_AGE_SECONDS",
    "StreamInfo",
    "ensure_events_stream",
    "follow_events",
    "read_events",
    "show_events",
    "stream_info",
]
