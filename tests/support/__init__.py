"""What the Celery and beat integration tests share (``tests/celery``, ``tests/beat``).

* :mod:`.ledger`: :class:`~.ledger.SqliteLedger`, the SQLite file every
  process of a test (pytest, workers, their pool children, beat) writes to:
  one connection per process and thread, WAL, ``create()`` with the suite's
  own schema, ``execute``/``rows``/``count`` and an ``immediate()``
  transaction. Each suite subclasses it with its schema and writers
  (``tests/celery/cnl_celery_ledger.py``).
* :mod:`.brokers`: :class:`~.brokers.Broker` and :func:`~.brokers.make_broker`:
  kombu's filesystem transport, or Redis / RabbitMQ on the shared local
  services with per-test key prefixes and queue names, removed by
  ``Broker.cleanup()``.
* :mod:`.procs`: :class:`~.procs.Proc`, a subprocess (worker, beat) in its own
  process group, logging to a file, with graceful stop and group kill.
* :mod:`.key_history`: the republish setting that copies every write of a
  test bucket to a core subject, for the recorders that must see every
  revision (``KeyHistory``, the beat tests' ``KVRecorder``).

Moving a suite onto it (done for ``tests/celery``; ``tests/beat`` the same way):

1. the ledger class subclasses ``SqliteLedger`` and passes its ``SCHEMA``;
   its writers use ``self.execute(...)``;
2. the ``broker`` fixture returns ``make_broker(kind, tmp_path, key_prefix=...)``
   (keyword options for the suite's transport settings) and calls
   ``cleanup()`` after the test;
3. processes are ``Proc(name, argv, env=..., log_path=..., cwd=...)``;
4. subprocesses that import the suite's helpers need the repository root on
   ``PYTHONPATH`` (:data:`REPO`), next to the suite's own directory.

The suites' directories have no ``__init__.py`` (``tests/celery`` must never
shadow the ``celery`` package): they import this package as ``tests.support``.
"""

from __future__ import annotations

from pathlib import Path

#: The repository root: on ``PYTHONPATH`` of subprocesses that import ``tests.support``.
REPO = Path(__file__).resolve().parents[2]
