"""The leader record: the JSON value stored under a role's key.

Example::

    {"v": 1, "id": "web-3:4121:9f2c", "token": "<uuid4>", "epoch": 412,
     "priority": 10, "meta": {"hostname": "web-3", "pid": 4121}}

The first write of a term (the ``create``) cannot know its own revision, so it
carries ``"epoch": null``; for such a record the epoch *is* the entry's
revision. Every renewal writes the epoch explicitly.

A *fence marker* is written by an operator over a stuck leader's record
(``nats-leader fence``): it names no leader, only the term it ended::

    {"v": 1, "id": "fenced", "token": "<uuid4>", "epoch": null, "priority": 0,
     "meta": {}, "fenced": {"id": "web-3:4121:9f2c", "epoch": 412, "by": "ops@host"}}

Its epoch (its own revision) is newer than the fenced term's, so every fenced
check of that term fails; candidates treat the key as vacant and take it with
a conditional update at the marker's revision.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_nats_leader.core.constants import FENCE_ID, RECORD_VERSION
from celery_nats_leader.core.errors import RecordFormatError
from celery_nats_leader.term.token import FencingToken


@dataclass(frozen=True)
class LeaderRecord:
    """A decoded leader record.

    Attributes:
        id: Instance id of the leader.
        token: The term's random token value.
        epoch: Revision at which the term's record was created.
        revision: Revision of the entry this record was read from (0 if unknown).
        priority: The leader's priority.
        meta: Free-form metadata the leader published (hostname, pid, ...).
        fenced: For a fence marker, the term it ended (``id``, ``epoch``,
            ``by``); ``None`` for a leader's record.
        successor: With fast failover, the candidate the leader designated
            to take over at once when it stops answering (docs/design.md);
            ``None`` otherwise.
        successor_nonce: A random value new with each designation: the
            successor counts its wait from its first sighting of it.

    """

    id: str
    token: str
    epoch: int
    revision: int = 0
    priority: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    fenced: Mapping[str, Any] | None = None
    successor: str | None = None
    successor_nonce: str | None = None

    @property
    def is_fence(self) -> bool:
        """Whether this is an operator's fence marker (nobody leads) rather than a leader."""
        return self.fenced is not None

    @property
    def fencing_token(self) -> FencingToken:
        """The term's :class:`FencingToken`."""
        return FencingToken(epoch=self.epoch, value=self.token)

    def holds(self, token: FencingToken, instance_id: str | None = None) -> bool:
        """Whether this record is the term of ``token``.

        The one "does the store still hold this term" check: the election's
        token validation, prefork children and the worker-side checks use it.

        Args:
            token: The fencing token to look for.
            instance_id: Also require this holder (a candidate checking its own term).

        Returns:
            ``True`` when epoch and token value match (and the holder, if given).

        """
        return (
            self.token == token.value
            and self.epoch == token.epoch
            and (instance_id is None or self.id == instance_id)
        )


def encode_record(
    *,
    instance_id: str,
    token: str,
    epoch: int | None,
    priority: int,
    meta: Mapping[str, Any],
    successor: str | None = None,
    successor_nonce: str | None = None,
) -> bytes:
    """Serialize a record for writing.

    Args:
        instance_id: The writer's instance id.
        token: The term's token value.
        epoch: The term's epoch, or ``None`` for the term's first write.
        priority: The writer's priority.
        meta: Metadata to publish; must be JSON-serializable.
        successor: The designated successor (fast failover), if any.
        successor_nonce: That designation's random value.

    Returns:
        Compact JSON bytes.

    """
    body: dict[str, Any] = {
        "v": RECORD_VERSION,
        "id": instance_id,
        "token": token,
        "epoch": epoch,
        "priority": priority,
        "meta": dict(meta),
    }
    if successor is not None:
        # Only when there is one: records without it stay byte for byte as
        # they were, and readers that predate it ignore the field.
        body["successor"] = {"id": successor, "nonce": successor_nonce or ""}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def encode_fence(*, token: str, fenced_id: str, fenced_epoch: int, by: str) -> bytes:
    """Serialize a fence marker that ends the term ``fenced_epoch`` of ``fenced_id``.

    Args:
        token: A fresh random value (nobody's term carries it).
        fenced_id: Instance id of the leader whose term ends.
        fenced_epoch: Epoch of that term.
        by: Who fenced (operator tool and host), for the record.

    Returns:
        Compact JSON bytes.

    """
    body = {
        "v": RECORD_VERSION,
        "id": FENCE_ID,
        "token": token,
        "epoch": None,
        "priority": 0,
        "meta": {},
        "fenced": {"id": fenced_id, "epoch": fenced_epoch, "by": by},
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def decode_record(value: bytes, revision: int) -> LeaderRecord:
    """Parse a record read from the store.

    Args:
        value: The entry's bytes.
        revision: The entry's revision.

    Returns:
        The record; ``epoch`` is ``revision`` when the record has none.

    Raises:
        RecordFormatError: If ``value`` is not a record of this package.

    """
    try:
        body = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordFormatError(f"value at revision {revision} is not JSON") from exc
    if not isinstance(body, dict):
        raise RecordFormatError(f"value at revision {revision} is not a JSON object")
    instance_id = body.get("id")
    token = body.get("token")
    epoch = body.get("epoch")
    priority = body.get("priority", 0)
    meta = body.get("meta", {})
    if not isinstance(instance_id, str) or not instance_id:
        raise RecordFormatError(f"record at revision {revision} has no 'id'")
    if not isinstance(token, str) or not token:
        raise RecordFormatError(f"record at revision {revision} has no 'token'")
    if epoch is None:
        epoch = revision
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch <= 0:
        raise RecordFormatError(f"record at revision {revision} has a bad 'epoch'")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RecordFormatError(f"record at revision {revision} has a bad 'priority'")
    if not isinstance(meta, dict):
        meta = {}
    fenced = body.get("fenced")
    if fenced is not None and not isinstance(fenced, dict):
        raise RecordFormatError(f"record at revision {revision} has a bad 'fenced'")
    successor = body.get("successor")
    successor_id: str | None = None
    successor_nonce: str | None = None
    if isinstance(successor, dict):
        # Anything malformed names no successor: nobody takes over fast, the
        # lease still ends the term.
        named, nonce = successor.get("id"), successor.get("nonce")
        if isinstance(named, str) and named and isinstance(nonce, str) and nonce:
            successor_id, successor_nonce = named, nonce
    return LeaderRecord(
        id=instance_id,
        token=token,
        epoch=epoch,
        revision=revision,
        priority=priority,
        meta=meta,
        fenced=fenced,
        successor=successor_id,
        successor_nonce=successor_nonce,
    )
