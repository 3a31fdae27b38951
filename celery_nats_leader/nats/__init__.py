"""The only code that imports nats-py.

* :mod:`.connection`: :func:`open_backend`, the one door: connect (with
  :class:`~celery_nats_leader.config.connection.ConnectOptions`), and get a
  :class:`~celery_nats_leader.core.backend.Backend` that owns the connection.
* :mod:`.process_client`: :class:`~.process_client.ProcessClient`, the one
  loop thread and connection per process that synchronous readers share.
* :mod:`.jetstream`: :class:`~.jetstream.JetStreamBackend`, the
  :class:`~celery_nats_leader.core.backend.Backend` over JetStream KV, where NATS
  errors are translated into :mod:`celery_nats_leader.core.errors`.
* :mod:`.memory`: an in-process double of the same backend, for fast unit
  tests of the election logic.
"""

from __future__ import annotations

from celery_nats_leader.nats.connection import (
    ConnectionListener,
    connect,
    open_backend,
)
from celery_nats_leader.nats.jetstream import JetStreamBackend

__all__ = ["ConnectionListener", "JetStreamBackend", "connect", "open_backend"]
