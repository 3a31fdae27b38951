"""Leadership state shared by a worker's main process and its pool children.

The :class:`~celery_nats_leader.election.elector.Elector` lives in the worker's main
process. With the prefork pool, tasks run in forked children, which must
answer "does my worker lead role R, and with which token?" without asking the
parent. The parent therefore publishes, per role, the term's epoch, token and
lease deadline into an anonymous shared memory block created *before* the pool
forks (:class:`SharedLeadership`); children read it.

The lease deadline is a :func:`time.monotonic` reading, i.e. ``CLOCK_MONOTONIC``
on Linux, which is one clock for the whole host, so a child may compare it with
its own clock. The parent publishes a deadline never later than its own (see
:meth:`WorkerElection.publish <celery_nats_leader.worker.election.WorkerElection.publish>`),
so a child never believes in a term longer than the parent does: if the parent
freezes or dies, its children stop starting leader-only work when the lease
runs out, before any successor can be elected.

The block has a single writer (the elector's event-loop thread) and is read
with a sequence lock plus a checksum, so a reader never blocks the writer and
never trusts a torn read: it retries, and after a bounded number of attempts
it fails closed ("not leader").

``validate=True`` needs a KV read. In a child it goes through a
:class:`~celery_nats_leader.term.TermReader`, on the child's one
:class:`~celery_nats_leader.nats.process_client.ProcessClient` (the event-loop
thread and NATS connection that the once-guard and the beat fence use too).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.term import TermReader
from celery_nats_leader.term.token import FencingToken

logger = logging.getLogger(__name__)

# One 128-byte slot per role:
#   0  seq       u64  sequence lock: odd while the writer is writing
#   8  epoch     i64  0 when not leading
#   16 deadline  f64  lease deadline, CLOCK_MONOTONIC seconds
#   24 token     64s  token value (UTF-8, NUL padded)
#   88 crc       u32  CRC32 of bytes 8..88
#   96 failures  u64  validations that failed in children (metrics only)
#   104 request  u8   a child asks the parent to validate the token now
#   112 checks   u64  validations done in children (metrics only)
_SLOT_SIZE = 128
_SEQ = struct.Struct("<Q")
_BODY = struct.Struct("<qd64s")
_CRC = struct.Struct("<I")
_BODY_OFFSET = 8
_CRC_OFFSET = _BODY_OFFSET + _BODY.size
_FAILURES_OFFSET = 96
_REQUEST_OFFSET = 104
_VALIDATIONS_OFFSET = 112
_TOKEN_BYTES = 64

#: Reads attempted before a reader gives up and answers "not leader".
_READ_ATTEMPTS = 200


@dataclass(frozen=True)
class LeaseSnapshot:
    """A consistent read of one role's slot.

    Attributes:
        epoch: The term's epoch (0 when not leading).
        deadline: Lease deadline on ``CLOCK_MONOTONIC``.
        token: The term's token value ("" when not leading).

    """

    epoch: int
    deadline: float
    token: str

    def token_at(self, now: float) -> FencingToken | None:
        """The fencing token if the lease is valid at ``now``, else ``None``."""
        if self.epoch > 0 and self.token and now < self.deadline:
            return FencingToken(self.epoch, self.token)
        return None


class SharedLeadership:
    """Per-role leadership slots in anonymous shared memory, inherited over fork.

    Args:
        roles: The roles, in slot order.

    """

    def __init__(self, roles: tuple[str, ...]) -> None:
        self.roles = roles
        self._index = {role: i for i, role in enumerate(roles)}
        # An anonymous MAP_SHARED mapping: children forked after this point
        # see the parent's writes (and the parent sees their counters).
        self._mm = mmap.mmap(-1, max(1, len(roles)) * _SLOT_SIZE)
        # The children's counters have many writers. A POSIX record lock on
        # an (unlinked) file inherited over fork serializes them, and the
        # kernel releases it when its holder dies: a child killed mid-count
        # cannot wedge its siblings. It does not exclude threads of one
        # process, hence the thread lock too.
        self._counter_fd, path = tempfile.mkstemp(prefix="nats-leader-counters-")
        os.unlink(path)
        weakref.finalize(self, os.close, self._counter_fd)
        self._counter_thread_lock = threading.Lock()
        _INSTANCES.add(self)
        self.clear_all()  # valid, checksummed "not leading" slots

    def _renew_thread_lock_after_fork(self) -> None:
        # Another thread of the parent (the elector's loop, counting every
        # half heartbeat) may have held the lock at the fork: the child's copy
        # stays locked forever, with no thread to release it, and the child's
        # first count would hang. A child has just one thread: a fresh lock.
        self._counter_thread_lock = threading.Lock()

    def index(self, role: str) -> int | None:
        """The slot of ``role``, or ``None`` if the role is not hosted here."""
        return self._index.get(role)

    # ---------------------------------------------------------- writer side

    def publish(self, role: str, epoch: int, deadline: float, token: str) -> None:
        """Record a live term (single writer: the elector's loop thread)."""
        i = self._index.get(role)
        if i is None:
            return
        raw = token.encode()
        if len(raw) > _TOKEN_BYTES:
            raise ValueError("token value longer than 64 bytes")
        self._write(i * _SLOT_SIZE, _BODY.pack(epoch, deadline, raw))

    def clear(self, role: str) -> None:
        """Record that this worker does not lead ``role``."""
        i = self._index.get(role)
        if i is None:
            return
        self._write(i * _SLOT_SIZE, _BODY.pack(0, 0.0, b""))

    def clear_all(self) -> None:
        """Clear every slot."""
        for role in self.roles:
            self.clear(role)

    def _write(self, base: int, body: bytes) -> None:
        mm = self._mm
        (seq,) = _SEQ.unpack_from(mm, base)
        seq |= 1  # odd: readers retry until the write is complete
        _SEQ.pack_into(mm, base, seq)
        mm[base + _BODY_OFFSET : base + _CRC_OFFSET] = body
        _CRC.pack_into(mm, base + _CRC_OFFSET, zlib.crc32(body))
        _SEQ.pack_into(mm, base, seq + 1)

    # ---------------------------------------------------------- reader side

    def read(self, role: str) -> LeaseSnapshot | None:
        """A consistent snapshot of ``role``'s slot.

        Returns:
            The snapshot, or ``None`` if the role is not hosted or no
            consistent read succeeded (the caller must treat that as "not
            leader").

        """
        i = self._index.get(role)
        if i is None:
            return None
        mm = self._mm
        base = i * _SLOT_SIZE
        for attempt in range(_READ_ATTEMPTS):
            (before,) = _SEQ.unpack_from(mm, base)
            if not before & 1:
                raw = mm[base + _BODY_OFFSET : base + _CRC_OFFSET + _CRC.size]
                (after,) = _SEQ.unpack_from(mm, base)
                body = raw[: _BODY.size]
                (crc,) = _CRC.unpack_from(raw, _BODY.size)
                if before == after and zlib.crc32(body) == crc:
                    epoch, deadline, token = _BODY.unpack(body)
                    return LeaseSnapshot(epoch, deadline, token.rstrip(b"\0").decode())
            if attempt > 10:
                # The writer was preempted mid-write: let it run.
                os.sched_yield()
        return None

    # ------------------------------------------------------------- counters

    @contextlib.contextmanager
    def _counters_locked(self, slot: int) -> Iterator[None]:
        fd = self._counter_fd
        with self._counter_thread_lock:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, slot)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, slot)

    def count_validation(self, role: str, ok: bool) -> None:
        """Count a validation done in a child (metrics).

        Children of one worker count at the same time: the increments are
        serialized, so none is lost (the metrics would undercount).
        """
        i = self._index.get(role)
        if i is None:
            return
        offsets = [_VALIDATIONS_OFFSET] if ok else [_VALIDATIONS_OFFSET, _FAILURES_OFFSET]
        with self._counters_locked(i):
            for offset in offsets:
                off = i * _SLOT_SIZE + offset
                (count,) = _SEQ.unpack_from(self._mm, off)
                _SEQ.pack_into(self._mm, off, count + 1)

    def validation_counts(self, role: str) -> tuple[int, int]:
        """Validations done and failed in children so far: ``(done, failed)``."""
        i = self._index.get(role)
        if i is None:
            return (0, 0)
        # Both read at one instant: a failure is never seen before its validation.
        with self._counters_locked(i):
            (done,) = _SEQ.unpack_from(self._mm, i * _SLOT_SIZE + _VALIDATIONS_OFFSET)
            (failed,) = _SEQ.unpack_from(self._mm, i * _SLOT_SIZE + _FAILURES_OFFSET)
        return (int(done), int(failed))

    def request_validation(self, role: str) -> None:
        """Ask the parent to validate its token against KV soon."""
        i = self._index.get(role)
        if i is not None:
            self._mm[i * _SLOT_SIZE + _REQUEST_OFFSET] = 1

    def take_validation_request(self, role: str) -> bool:
        """Whether a child asked for a validation (and reset the request)."""
        i = self._index.get(role)
        if i is None:
            return False
        off = i * _SLOT_SIZE + _REQUEST_OFFSET
        if self._mm[off]:
            self._mm[off] = 0
            return True
        return False


class LocalLeadership(Protocol):
    """What the main process answers about its own roles (the worker service)."""

    def current_token(self, role: str) -> FencingToken | None:
        """The token while this process leads ``role`` (lease checked), else ``None``."""
        ...

    def validate(self, role: str, token: FencingToken, timeout: float | None) -> bool:
        """Confirm ``token`` against KV; ``False`` on any doubt."""
        ...


@dataclass(frozen=True)
class LeadershipCheck:
    """The answer of :func:`check_leadership`.

    Attributes:
        role: The role checked.
        token: The fencing token if this worker leads the role, else ``None``.
        checked_at: ``time.monotonic()`` taken *before* the state was read: the
            worker's term had not ended at this instant (useful in ledgers).
        reason: Why the check failed ("" when it passed).

    """

    role: str
    token: FencingToken | None
    checked_at: float
    reason: str = ""

    @property
    def leading(self) -> bool:
        """Whether the check passed."""
        return self.token is not None


class WorkerLeadership:
    """The worker's leadership as seen from any of its processes.

    Created in the main process before the pool forks, installed with
    :func:`install`, inherited by children.

    Args:
        shared: The shared slots.
        local: The main process's service (used only in the main process).
        instance_id: The worker's election id (written in leader records).
        bucket: The KV bucket.
        connection: How children connect to NATS to validate.
        request_timeouts: Per-role KV request timeout, seconds.

    """

    def __init__(
        self,
        shared: SharedLeadership,
        local: LocalLeadership,
        *,
        instance_id: str,
        bucket: str,
        connection: ConnectOptions,
        request_timeouts: Mapping[str, float],
    ) -> None:
        self.shared = shared
        self.local = local
        self.instance_id = instance_id
        self.bucket = bucket
        self.connection = connection
        self.request_timeouts = dict(request_timeouts)
        self.main_pid = os.getpid()
        self._reader = TermReader(connection, bucket)

    @property
    def in_main_process(self) -> bool:
        """Tell whether the caller runs in the process that hosts the elector."""
        return os.getpid() == self.main_pid

    def check(
        self, role: str, *, validate: bool = False, timeout: float | None = None
    ) -> LeadershipCheck:
        """Whether this worker leads ``role`` now (and, with ``validate``, per KV)."""
        # Read the clock first: if the state read afterwards says "leading",
        # the term was not over at this instant.
        now = time.monotonic()
        if self.in_main_process:
            token = self.local.current_token(role)
        else:
            snapshot = self.shared.read(role)
            # The lease is judged on a clock read after the slot: a deadline
            # that passed while we read does not count.
            token = snapshot.token_at(time.monotonic()) if snapshot is not None else None
        if token is None:
            if self.shared.index(role) is None:
                return LeadershipCheck(
                    role, None, now, f"this worker does not campaign for {role!r}"
                )
            return LeadershipCheck(role, None, now, "not the leader")
        if validate and not self._validate(role, token, timeout):
            return LeadershipCheck(role, None, now, f"fencing token {token} failed validation")
        return LeadershipCheck(role, token, now)

    def _validate(self, role: str, token: FencingToken, timeout: float | None) -> bool:
        if self.in_main_process:
            return self.local.validate(role, token, timeout)
        limit = timeout if timeout is not None else 2 * self.request_timeouts.get(role, 1.0)
        ok = self._reader.holds(role, token, self.instance_id, timeout=limit)
        self.shared.count_validation(role, ok)
        if ok:
            # The parent may have been demoted while we read: re-check the slot.
            snapshot = self.shared.read(role)
            ok = snapshot is not None and snapshot.token_at(time.monotonic()) == token
        else:
            # The parent's watch normally notices within milliseconds; make
            # it look now in case its watch went blind.
            self.shared.request_validation(role)
        return ok


class _Process:
    """Holds the leadership of the current process (set by :func:`install`)."""

    leadership: WorkerLeadership | None = None


def install(state: WorkerLeadership | None) -> None:
    """Make ``state`` this process's leadership (done by the worker bootstep)."""
    _Process.leadership = state


def current() -> WorkerLeadership | None:
    """Return this process's leadership, or ``None`` outside a worker with the bootstep."""
    return _Process.leadership


def check_leadership(
    role: str, *, validate: bool = False, timeout: float | None = None
) -> LeadershipCheck:
    """Whether the worker running this code leads ``role`` right now.

    Works in the worker's main process (threads and solo pools) and in prefork
    children. Cheap without ``validate`` (a few microseconds, no I/O); with
    ``validate`` it also reads the role's key from KV (one round trip).

    Args:
        role: The role.
        validate: Also confirm the fencing token against KV.
        timeout: Seconds for the KV read; default twice the request timeout.

    Returns:
        The result; ``result.token`` is the fencing token when leading.

    """
    state = _Process.leadership
    if state is None:
        return LeadershipCheck(
            role,
            None,
            time.monotonic(),
            "no leader election runs in this process (is the nats-leader bootstep installed?)",
        )
    return state.check(role, validate=validate, timeout=timeout)


#: Every live slot table, so that a forked child renews their thread locks.
_INSTANCES: weakref.WeakSet[SharedLeadership] = weakref.WeakSet()


def _renew_locks_in_child() -> None:
    for shared in list(_INSTANCES):
        shared._renew_thread_lock_after_fork()


os.register_at_fork(after_in_child=_renew_locks_in_child)
