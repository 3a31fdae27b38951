"""The event trail: every leadership transition, as a NATS message.

Each election publishes one message per transition of its own, on
``_NATS_LEADER_EVENTS.<bucket>.<role>`` (:func:`event_subject`)::

    {"v": 1, "event": "demoted", "reason": "lease_expired", "bucket": "leaders",
     "role": "reports", "id": "web-3:4121:9f2c", "epoch": 412, "seq": 7,
     "uptime": 3605.118, "term_age": 3600.204, "meta": {"hostname": "web-3", "pid": 4121}}

* ``event``: ``promoted``; ``demoted`` (the term was lost: ``reason`` says
  why); ``released`` (it stepped down and deleted its key: stop, takeover,
  failing health check); ``resigned`` (on request); ``fenced`` (an operator
  ended the term).
* ``uptime`` and ``term_age`` are the publisher's own monotonic offsets
  (seconds since its election started, seconds into the term); ``seq``
  counts its events. Nothing derived from them compares two hosts' clocks:
  order events of one publisher by ``seq``, and of a role by ``epoch``.

Messages are plain core NATS publishes: nobody has to listen. An operator may
keep them in a JetStream stream with a bounded age (``manage.py election_bucket
--events-max-age``); the stream is never required. Events a publisher could
not send while disconnected are kept (a few dozen) and sent on reconnection.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_nats_leader.election.vocabulary import (
    RELEASING_REASONS,
    DemoteReason,
    event_subject,
    events_stream,
)


class EventKind(str, enum.Enum):
    """What happened to a term."""

    PROMOTED = "promoted"
    """This process began a term."""
    DEMOTED = "demoted"
    """The term was lost (lease, connection, another writer, an error)."""
    RELEASED = "released"
    """It stepped down and released the key (stop, takeover, health check)."""
    RESIGNED = "resigned"
    """It stepped down on request (``resign`` command, ``resign()``)."""
    FENCED = "fenced"
    """An operator ended the term (``fence`` command)."""


def kind_of(reason: DemoteReason | str) -> EventKind:
    """The event kind of a demotion with ``reason`` (a :class:`DemoteReason` or its value)."""
    value = reason.value if isinstance(reason, DemoteReason) else reason
    if value == DemoteReason.FENCED.value:
        return EventKind.FENCED
    if value == DemoteReason.RESIGNED.value:
        return EventKind.RESIGNED
    if value in RELEASING_REASONS:
        return EventKind.RELEASED
    return EventKind.DEMOTED


@dataclass(frozen=True)
class TransitionEvent:
    """One transition, as published.

    Attributes:
        event: What happened.
        bucket: The KV bucket.
        role: The role.
        id: Instance id of the publisher (the leader whose term it is).
        epoch: The term's epoch.
        reason: Why a term ended (a ``DemoteReason`` value), ``None`` for promotions.
        seq: The publisher's event counter (1, 2, ...).
        uptime: Seconds since the publisher's election started (its monotonic clock).
        term_age: Seconds into the term when it happened (0 for a promotion).
        meta: The publisher's metadata (hostname, pid, ...).
        stored_at: For events read from the stream: the server's receive time
            (ISO 8601, the server's clock); ``None`` when live.
        stream_seq: For events read from the stream: its sequence number.

    """

    event: EventKind
    bucket: str
    role: str
    id: str
    epoch: int | None
    reason: str | None = None
    seq: int = 0
    uptime: float = 0.0
    term_age: float | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    stored_at: str | None = None
    stream_seq: int | None = None

    def encode(self) -> bytes:
        """The message body (compact JSON)."""
        body = {
            "v": 1,
            "event": self.event.value,
            "bucket": self.bucket,
            "role": self.role,
            "id": self.id,
            "epoch": self.epoch,
            "reason": self.reason,
            "seq": self.seq,
            "uptime": self.uptime,
            "term_age": self.term_age,
            "meta": dict(self.meta),
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (the ``--json`` lines of the events commands)."""
        body = json.loads(self.encode())
        body["stored_at"] = self.stored_at
        body["stream_seq"] = self.stream_seq
        return dict(body)

    @classmethod
    def decode(
        cls, data: bytes, *, stored_at: str | None = None, stream_seq: int | None = None
    ) -> TransitionEvent | None:
        """Parse a message body; ``None`` if it is not an event of this package."""
        try:
            body = json.loads(data)
            event = EventKind(body["event"])
            epoch = body.get("epoch")
            return cls(
                event=event,
                bucket=str(body["bucket"]),
                role=str(body["role"]),
                id=str(body["id"]),
                epoch=epoch if isinstance(epoch, int) else None,
                reason=body.get("reason"),
                seq=int(body.get("seq", 0)),
                uptime=float(body.get("uptime", 0.0)),
                term_age=None if body.get("term_age") is None else float(body["term_age"]),
                meta=dict(body.get("meta") or {}),
                stored_at=stored_at,
                stream_seq=stream_seq,
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        """One line for people: ``reports  epoch 412  demoted (lease_expired)  web-3:...``."""
        what = self.event.value if self.reason is None else f"{self.event.value} ({self.reason})"
        term = (
            ""
            if self.term_age is None or self.event is EventKind.PROMOTED
            else f"  after {self.term_age:.1f}s"
        )
        when = f"{self.stored_at}  " if self.stored_at else ""
        return f"{when}{self.role}  epoch {self.epoch}  {what}  {self.id}{term}"


__all__ = ["EventKind", "TransitionEvent", "event_subject", "events_stream", "kind_of"]
