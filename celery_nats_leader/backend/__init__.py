"""Storage and messaging backends of the election.

:mod:`.base` defines what the election needs; :mod:`.jetstream` is the only
code in the package that talks to NATS JetStream; :mod:`.memory` is an
in-process stand-in for fast unit tests of the election logic.
"""

from __future__ import annotations

from celery_nats_leader.backend.base import Backend, Bucket, KVEntry, Operation, Subscription

__all__ = ["Backend", "Bucket", "KVEntry", "Operation", "Subscription"]
