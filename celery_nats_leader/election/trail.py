"""The event trail of one election: its transitions, published in order.

Each election publishes one :class:`~celery_nats_leader.election.events.TransitionEvent`
per transition of its own on ``_NATS_LEADER_EVENTS.<bucket>.<role>``
(:func:`~celery_nats_leader.election.vocabulary.event_subject`). Events are
queued and published by a task of their own, never on the renewal path; a
few dozen are kept while the connection is down and sent when it is back.
The election owns one :class:`EventTrail` and tells it when a term begins and
ends; the trail knows nothing else of the state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import Backend
from celery_nats_leader.core.clock import Clock
from celery_nats_leader.election.events import EventKind, TransitionEvent, kind_of
from celery_nats_leader.election.vocabulary import DemoteReason, event_subject


class EventTrail:
    """One election's transition events: queued in order, published off the renewal path.

    Args:
        config: The election's configuration (bucket, role, id, metadata).
        clock: The election's monotonic clock (``uptime`` and ``term_age``).
        backend: Returns the election's backend (``None`` before it connects).
        logger: The election's logger.
        task_name: Name of the publishing task.

    """

    def __init__(
        self,
        config: ElectionConfig,
        clock: Clock,
        backend: Callable[[], Backend | None],
        logger: logging.Logger,
        task_name: str,
    ) -> None:
        self._config = config
        self._clock = clock
        self._backend = backend
        self._logger = logger
        self._task_name = task_name
        self._queue: deque[bytes] = deque(maxlen=c.EVENT_BUFFER)
        self._seq = 0
        self._epoch: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._born = clock.monotonic()

    @property
    def pending(self) -> bool:
        """Whether events wait to be published."""
        return bool(self._queue)

    def promoted(self, epoch: int) -> None:
        """A term began at ``epoch``: queue ``promoted``."""
        self._epoch = epoch
        self._emit(EventKind.PROMOTED, None, 0.0)

    def ended(self, reason: DemoteReason, term_age: float) -> None:
        """The term ended for ``reason`` after ``term_age`` s: queue its kind of event."""
        self._emit(kind_of(reason), reason.value, term_age)

    def _emit(self, kind: EventKind, reason: str | None, term_age: float) -> None:
        """Queue one transition event; published in order, never on the renewal path."""
        cfg = self._config
        self._seq += 1
        event = TransitionEvent(
            event=kind,
            bucket=cfg.bucket,
            role=cfg.role,
            id=cfg.instance_id,
            epoch=self._epoch,
            reason=reason,
            seq=self._seq,
            uptime=round(self._clock.monotonic() - self._born, 3),
            term_age=term_age,
            meta=dict(cfg.meta),
        )
        self._queue.append(event.encode())
        self.schedule_flush()

    def schedule_flush(self) -> None:
        """Start publishing the queued events, unless that runs already or no loop runs here."""
        if self._task is not None and not self._task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the loop (a wake from another thread): the next event flushes
        self._task = loop.create_task(self.flush(), name=self._task_name)

    async def handed_out(self) -> None:
        """Hand the queued events to the connection before the key is released.

        The successor's ``promoted`` is published after it saw the release;
        on one connection, publishes reach the server in order, so the trail
        shows a term's end before the next term's start even on a busy host.
        Costs one buffered publish on the hand-over path.
        """
        self.schedule_flush()
        task = self._task
        if task is not None:
            with contextlib.suppress(Exception):
                await task

    async def close(self) -> None:
        """Publish what is left (the release of a stop) before the connection closes."""
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        await self.flush()

    async def flush(self) -> None:
        """Publish the queued events in order; keep them while disconnected."""
        backend = self._backend()
        subject = event_subject(self._config.bucket, self._config.role)
        while self._queue and backend is not None and backend.is_connected:
            try:
                await backend.publish(subject, self._queue[0])
            except Exception as exc:  # an event must never break the election
                self._logger.debug("%s: could not publish an event: %s", self._config.role, exc)
                return
            if self._queue:
                self._queue.popleft()


__all__ = ["EventTrail"]
