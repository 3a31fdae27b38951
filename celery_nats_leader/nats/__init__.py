"""The only code that imports nats-py.

* :mod:`.connection`: :class:`~.connection.ConnectOptions` and the one way to
  open a NATS connection.
* :mod:`.jetstream`: :class:`~.jetstream.JetStreamBackend`, the
  :class:`~celery_nats_leader.backend.Backend` over JetStream KV, where NATS
  errors are translated into :mod:`celery_nats_leader.errors`.
* :mod:`.memory`: an in-process double of the same backend, for fast unit
  tests of the election logic.
"""
