"""The control channel's resign request and its answer, as they travel.

A leader listens on ``_NATS_LEADER.<bucket>.<role>.resign``
(:func:`~celery_nats_leader.election.vocabulary.control_subject`). Operators
(``resign``, ``release``, ``fence``) and preferred candidates (a polite
takeover) send a :class:`ResignRequest`; the leader answers with a
:class:`ResignAnswer`. Both sides build and read the JSON here, so the
fields are spelled once. Reading is lenient: a malformed body is an empty
request, a malformed answer a refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def _object(data: bytes) -> dict[str, Any]:
    """``data`` as a JSON object, or ``{}`` when it is empty or not one."""
    try:
        body = json.loads(data) if data else {}
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


@dataclass(frozen=True)
class ResignRequest:
    """Please step down.

    Attributes:
        requester: Who asks (the leader logs it).
        leader_id: Only this instance may accept (``id``): a request meant
            for a leader that has since lost the role is refused by its
            successor.
        priority: A takeover: the asking candidate's priority; a leader of
            the same or a higher priority refuses.
        reason: Why, for the leader's log (``takeover``, ``fence``).
        verify: Confirm the term against the store before accepting (a
            fence asks this, so that a leader that was paused steps down as
            fenced rather than resign a term it already lost).

    """

    requester: str = "an operator"
    leader_id: str | None = None
    priority: int | None = None
    reason: str | None = None
    verify: bool = False

    def encode(self) -> bytes:
        """The request's JSON body."""
        body: dict[str, Any] = {"requester": self.requester}
        if self.leader_id is not None:
            body["id"] = self.leader_id
        if self.priority is not None:
            body["priority"] = self.priority
        if self.reason is not None:
            body["reason"] = self.reason
        if self.verify:
            body["verify"] = True
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, data: bytes) -> ResignRequest:
        """Read a request; fields of the wrong type are left out."""
        body = _object(data)
        requester = body.get("requester")
        target = body.get("id")
        priority = body.get("priority")
        reason = body.get("reason")
        return cls(
            requester=requester if isinstance(requester, str) else "an operator",
            leader_id=target if isinstance(target, str) else None,
            priority=priority if isinstance(priority, int) else None,
            reason=reason if isinstance(reason, str) else None,
            verify=body.get("verify") is True,
        )


@dataclass(frozen=True)
class ResignAnswer:
    """A leader's answer to a :class:`ResignRequest`.

    Attributes:
        id: The instance that answered.
        accepted: Whether it steps down.

    """

    id: str | None
    accepted: bool

    def to_dict(self) -> dict[str, Any]:
        """The answer as a JSON object."""
        return {"id": self.id, "accepted": self.accepted}

    def encode(self) -> bytes:
        """The answer's JSON body."""
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def decode(cls, data: bytes) -> ResignAnswer:
        """Read an answer; anything but ``"accepted": true`` is a refusal."""
        body = _object(data)
        answered_by = body.get("id")
        return cls(
            id=answered_by if isinstance(answered_by, str) else None,
            accepted=body.get("accepted") is True,
        )


__all__ = ["ResignAnswer", "ResignRequest"]
