"""The only code that imports nats-py.

* :mod:`.connection`: :class:`~.connection.ConnectOptions` and
  :func:`open_backend`, the one door: connect, and get a
  :class:`~celery_nats_leader.backend.Backend` that owns the connection.
* :mod:`.jetstream`: :class:`~.jetstream.JetStreamBackend`, the
  :class:`~celery_nats_leader.backend.Backend` over JetStream KV, where NATS
  errors are translated into :mod:`celery_nats_leader.errors`.
* :mod:`.memory`: an in-process double of the same backend, for fast unit
  tests of the election logic.
"""

from __future__ import annotations

from celery_nats_leader.nats.connection import (
    ConnectionListener,
    ConnectOptions,
    connect,
    open_backend,
)
from celery_nats_leader.nats.jetstream import JetStreamBackend

__all__ = ["ConnectOptions", "ConnectionListener", "JetStreamBackend", "connect", "open_backend"]
