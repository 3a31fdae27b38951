"""The server's refusals of publishes and subscriptions, remembered per connection.

NATS reports a permission violation asynchronously (an ``-ERR`` that nats-py
hands to the error callback); the operation that caused it only sees a
timeout. The connection's error callback notes each refusal here, and the
backend turns a timeout that follows one into a
:class:`~celery_nats_leader.core.errors.PermissionDeniedError` naming the subject.
"""

from __future__ import annotations

import time
import weakref
from collections import deque

from nats.aio.client import Client

#: How nats-py words the server's refusal of a publish or a subscription.
_PERMISSION_VIOLATION = "permissions violation"

#: Recent refusals per connection: (monotonic time, the server's message).
_refusals: weakref.WeakKeyDictionary[Client, deque[tuple[float, str]]] = weakref.WeakKeyDictionary()


def note_refusal(nc: Client, error: Exception) -> None:
    """Remember ``error`` if it is the server refusing a publish or a subscription."""
    if _PERMISSION_VIOLATION in str(error).lower():
        _refusals.setdefault(nc, deque(maxlen=16)).append((time.monotonic(), str(error)))


def permission_violation(nc: Client, since: float) -> str | None:
    """The server's latest permission refusal on ``nc`` at or after ``since``, if any.

    Args:
        nc: A client made by :func:`~celery_nats_leader.nats.connection.connect`.
        since: A :func:`time.monotonic` reading (when the operation began).

    Returns:
        The server's message (it names the subject), or ``None``.

    """
    for at, message in reversed(_refusals.get(nc, ())):
        if at >= since:
            return message
    return None


__all__ = ["note_refusal", "permission_violation"]
