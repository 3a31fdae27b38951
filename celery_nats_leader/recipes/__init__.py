"""Recipes: small tools built on the KV primitives, one file each.

* :mod:`.once_guard`: run a body once per idempotency key
  (:class:`~.once_guard.OnceGuard`), the worker side's once-guard; the
  Celery wiring is :mod:`celery_nats_leader.worker.once_tasks`.
"""
