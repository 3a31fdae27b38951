"""The exceptions of the package, under one root: :class:`ElectionError`.

Errors coming from nats-py are translated into these in exactly one module,
:mod:`celery_nats_leader.nats.jetstream`, always with ``raise ... from``
so the original stays visible.
"""

from __future__ import annotations


class ElectionError(Exception):
    """Raised for every failure of this package; the root of the hierarchy."""


class ConfigError(ElectionError, ValueError):
    """Raised when a configuration value is invalid; the message names the field."""


class BucketConfigError(ConfigError):
    """Raised when the KV bucket exists but its settings break the election."""


class BucketNotFoundError(ElectionError):
    """Raised when the KV bucket does not exist and may not be created."""


class JetStreamUnavailableError(ElectionError):
    """Raised when the NATS server does not have JetStream enabled."""


class PermissionDeniedError(ElectionError):
    """Raised when the NATS account may not use the bucket or its subjects."""


class NatsUnavailableError(ElectionError):
    """Raised when no NATS server could be reached in time."""


class NotLeaderError(ElectionError):
    """Raised when leader-only work is attempted by a process that does not lead."""


class LeadershipLostError(NotLeaderError):
    """Raised when leadership ended while leader-only work was in progress."""


class ElectionStoppedError(ElectionError):
    """Raised when an operation needs a running election that was stopped."""


class BackendError(ElectionError):
    """Raised when a store operation failed in a way that may succeed if retried."""


class BackendTimeoutError(BackendError):
    """Raised when a store operation timed out: it may or may not have been applied."""


class EpochFloorRaceError(BackendError):
    """Raised when raising a new bucket's epoch floor purged entries written meanwhile."""

    def __init__(self, bucket: str, purged: int) -> None:
        super().__init__(
            f"KV bucket {bucket!r}: {purged} entries written during the migration were "
            "purged with the epoch floor; a candidate was already using the bucket and its "
            "term may run beside a successor's. Stop the replicas on it, delete the bucket "
            "and migrate again before any replica uses it"
        )
        self.bucket = bucket
        self.purged = purged


class NotConnectedError(BackendError):
    """Raised when a write was refused because the connection is down.

    The write was never handed to the client library, so it cannot land later.
    """


class KeyExistsError(ElectionError):
    """Raised when a create finds the key already held: someone else leads."""


class RevisionMismatchError(ElectionError):
    """Raised when a conditional write finds a newer revision than expected."""


class RecordFormatError(ElectionError):
    """Raised when a key holds a value that is not a leader record of this package."""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may go away by itself: NATS unreachable, a timeout, a 503.

    JetStream answers "temporarily unavailable" while a cluster elects a
    stream leader or recovers from a full store; such errors are retried.
    A missing bucket, a wrong bucket setting or a denied permission are not:
    only an operator fixes those.
    """
    return isinstance(exc, (NatsUnavailableError, BackendError))
