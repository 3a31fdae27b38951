"""The beat schedule's shared state: one KV key per periodic entry.

The state lives in its own KV bucket (default ``<election bucket>_beat``,
``history=1``, no ``max_age``: it must outlive every scheduler). Each entry
has one key, ``<role>.<readable name>.<hash of the name>``, whose value is::

    {"v": 1, "entry": "send-report", "slot": "2024-05-01T12:00:00.000000+00:00",
     "runs": 42, "skipped": 0, "epoch": 412, "by": "web-3:4121:9f2c",
     "commit": "5f0c9e2a41d7", "task": "proj.tasks.send_report"}

``slot`` is the last tick dispatched (before the first run: the anchor the
schedule counts from); ``"pending": true`` marks it committed but not yet
known to be sent (the outbox: a successor that finds it sends it again under
the same task id), ``runs`` the number of ticks dispatched, ``epoch`` and
``by`` the term and the instance that wrote it, ``commit`` a random id of the
write (to recognize our own write after a timeout). Only the leader writes,
always with a compare-and-set on the key's revision.

This module imports neither Celery nor Django.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from celery_nats_leader.beat.ticks import parse_slot, slot_text, to_utc
from celery_nats_leader.core.backend import Bucket, KVEntry
from celery_nats_leader.core.errors import BackendTimeoutError, NotConnectedError, RecordFormatError

if TYPE_CHECKING:
    from celery_nats_leader.election.elector import Elector

__all__ = [
    "STATE_VERSION",
    "EntryState",
    "ScheduleStateStore",
    "decode_state",
    "encode_state",
    "read_schedule_states",
    "state_key",
]

T = TypeVar("T")

#: Version of the JSON layout, written into every state value.
STATE_VERSION = 1

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_READABLE_CHARS = 48


def state_key(role: str, name: str) -> str:
    """The KV key of entry ``name`` of the scheduler leading ``role``.

    Entry names may hold any character; the key keeps a readable part and a
    hash of the full name, so distinct names never share a key.

    Args:
        role: The beat role (the key prefix, so several beat roles can share a bucket).
        name: The entry's name.

    Returns:
        For example ``"beat.send-report.1f2e3d4c5b6a"``.

    """
    readable = _UNSAFE.sub("_", name).strip("_")[:_READABLE_CHARS] or "entry"
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{role}.{readable}.{digest}"


@dataclass(frozen=True)
class EntryState:
    """The shared state of one periodic entry.

    Attributes:
        entry: The entry's name.
        slot: The last tick dispatched (UTC); before the first run, the anchor.
        runs: Ticks dispatched so far.
        skipped: Ticks skipped by coalescing after long gaps, so far.
        epoch: Term epoch of the writer.
        by: Instance id of the writer.
        commit: Random id of this write.
        task: The entry's task name (informational).
        pending: ``slot`` is committed but its send was not recorded yet.
        revision: KV revision this state was read or written at (not stored).

    """

    entry: str
    slot: datetime
    runs: int = 0
    skipped: int = 0
    epoch: int = 0
    by: str = ""
    commit: str = ""
    task: str = ""
    pending: bool = False
    revision: int = 0

    def advanced(self, slot: datetime, *, epoch: int, by: str, skipped: int = 0) -> EntryState:
        """The state after dispatching the tick ``slot``.

        Args:
            slot: The tick dispatched.
            epoch: The dispatching term's epoch.
            by: The dispatcher's instance id.
            skipped: Ticks jumped over to reach ``slot``.

        Returns:
            A new state (revision 0 until written).

        """
        return replace(
            self,
            slot=to_utc(slot),
            runs=self.runs + 1,
            skipped=self.skipped + skipped,
            epoch=epoch,
            by=by,
            commit=uuid.uuid4().hex[:12],
            revision=0,
        )

    def sent(self) -> EntryState:
        """The state after the send of its tick was recorded (not pending).

        Returns:
            A new state (revision 0 until written).

        """
        return replace(self, pending=False, commit=uuid.uuid4().hex[:12], revision=0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (what status commands print)."""
        return {
            "entry": self.entry,
            "slot": slot_text(self.slot),
            "runs": self.runs,
            "skipped": self.skipped,
            "epoch": self.epoch,
            "by": self.by,
            "task": self.task,
            "pending": self.pending,
            "revision": self.revision,
        }


def encode_state(state: EntryState) -> bytes:
    """Serialize ``state`` for writing.

    Returns:
        Compact JSON bytes.

    """
    body = {
        "v": STATE_VERSION,
        "entry": state.entry,
        "slot": slot_text(state.slot),
        "runs": state.runs,
        "skipped": state.skipped,
        "epoch": state.epoch,
        "by": state.by,
        "commit": state.commit,
        "task": state.task,
    }
    if state.pending:
        # Written only when set: states of earlier versions read as sent.
        body["pending"] = True
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def decode_state(value: bytes, revision: int) -> EntryState:
    """Parse a state value read from KV.

    Args:
        value: The entry's bytes.
        revision: The entry's revision.

    Returns:
        The state.

    Raises:
        RecordFormatError: If ``value`` is not a state of this package.

    """
    try:
        body = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordFormatError(f"beat state at revision {revision} is not JSON") from exc
    if not isinstance(body, dict) or not isinstance(body.get("entry"), str):
        raise RecordFormatError(f"beat state at revision {revision} has no 'entry'")
    try:
        slot = parse_slot(str(body["slot"]))
        return EntryState(
            entry=body["entry"],
            slot=slot,
            runs=int(body.get("runs", 0)),
            skipped=int(body.get("skipped", 0)),
            epoch=int(body.get("epoch", 0)),
            by=str(body.get("by", "")),
            commit=str(body.get("commit", "")),
            task=str(body.get("task", "")),
            pending=body.get("pending") is True,
            revision=revision,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"beat state at revision {revision} is malformed: {exc}") from exc


async def read_schedule_states(bucket: Bucket, role: str, *, timeout: float) -> list[EntryState]:
    """Every entry's state of the scheduler of ``role`` (for loading and status output).

    Values that are not states are skipped.

    Args:
        bucket: The state bucket.
        role: The beat role.
        timeout: Seconds for the read.

    Returns:
        The states, sorted by entry name.

    """
    prefix = f"{role}."
    found = []
    for entry in await bucket.entries(timeout=timeout):
        if not entry.key.startswith(prefix):
            continue
        try:
            found.append(decode_state(entry.value, entry.revision))
        except RecordFormatError:
            continue
    return sorted(found, key=lambda state: state.entry)


class ScheduleStateStore:
    """Synchronous access to the state bucket, on an :class:`Elector`'s loop.

    Every method raises :class:`~celery_nats_leader.core.errors.BackendTimeoutError`
    when the outcome is unknown and
    :class:`~celery_nats_leader.core.errors.NotConnectedError` when nothing was sent.

    Args:
        elector: The elector whose connection and loop to use.
        bucket: The state bucket's name.
        role: The beat role (key prefix).
        create: Create the bucket when missing.
        replicas: Replicas when creating it.
        timeout: Seconds per KV operation.

    """

    def __init__(
        self,
        elector: Elector,
        bucket: str,
        role: str,
        *,
        create: bool,
        replicas: int,
        timeout: float,
    ) -> None:
        self.elector = elector
        self.bucket_name = bucket
        self.role = role
        self.create_bucket = create
        self.replicas = replicas
        self.timeout = timeout
        self._bucket: Bucket | None = None

    @property
    def is_open(self) -> bool:
        """Whether the bucket was opened."""
        return self._bucket is not None

    def open(self) -> None:
        """Open (or create) the bucket; idempotent.

        Raises:
            BucketNotFoundError: Missing and creation is off.
            BucketConfigError: It has a ``max_age``.
            NatsUnavailableError: Not connected yet.

        """
        if self._bucket is None:
            self._bucket = self.elector.open_bucket(
                self.bucket_name,
                create=self.create_bucket,
                persistent=True,
                replicas=self.replicas,
                timeout=max(self.timeout, 2.0),
            )

    def key(self, name: str) -> str:
        """The key of entry ``name``."""
        return state_key(self.role, name)

    def load(self) -> dict[str, EntryState]:
        """Every entry's state, by entry name (one read of the bucket)."""
        bucket = self._require()
        states = self._run(read_schedule_states(bucket, self.role, timeout=self.timeout))
        return {state.entry: state for state in states}

    def get(self, name: str) -> EntryState | None:
        """Entry ``name``'s state, or ``None`` when it has none.

        Raises:
            RecordFormatError: If the key holds something else.

        """
        bucket = self._require()
        entry: KVEntry | None = self._run(bucket.get(self.key(name), timeout=self.timeout))
        if entry is None:
            return None
        return decode_state(entry.value, entry.revision)

    def create(self, state: EntryState) -> EntryState:
        """Write ``state`` only if the entry has no state yet.

        Returns:
            ``state`` with its revision.

        Raises:
            KeyExistsError: The entry has a state already.

        """
        bucket = self._require()
        revision = self._run(
            bucket.create(self.key(state.entry), encode_state(state), timeout=self.timeout)
        )
        return replace(state, revision=revision)

    def update(self, state: EntryState, *, last: int) -> EntryState:
        """Write ``state`` only if the entry's key is still at revision ``last``.

        Returns:
            ``state`` with its new revision.

        Raises:
            RevisionMismatchError: Someone wrote the key since ``last``.

        """
        bucket = self._require()
        revision = self._run(
            bucket.update(
                self.key(state.entry), encode_state(state), last=last, timeout=self.timeout
            )
        )
        return replace(state, revision=revision)

    def _require(self) -> Bucket:
        if self._bucket is None:
            self.open()
        assert self._bucket is not None
        return self._bucket

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            # A little more than the operation's own timeout: the operation
            # reports its own timeout as BackendTimeoutError first.
            return self.elector.loop.run(coro, self.timeout + 1.0)
        except TimeoutError as exc:
            raise BackendTimeoutError(
                f"no answer from the state bucket within {self.timeout:g}s"
            ) from exc
        except RuntimeError as exc:
            raise NotConnectedError(f"the leader election is not running: {exc}") from exc
