"""The tick dispatcher: validate the token, commit the tick in KV, send it, record the send.

One :class:`TickDispatcher` per scheduler. It holds the KV state of every
entry for the current term and dispatches one tick at a time:

1. **validate** the fencing token against KV (one read of the role's key);
   on a mismatch nothing is dispatched and the election demotes;
2. **commit** the tick to the entry's state with a compare-and-set on the
   key's revision, so two schedulers that both believe they lead cannot both
   commit the same tick. The state is marked *pending*: the outbox's intent,
   recorded before the send;
3. **send** it (a callback: the Celery mixin publishes the message), unless
   the lease ended meanwhile;
4. **record the send** (the state is no longer pending), or **revert** the
   commit when the tick was not sent, so the active scheduler dispatches it
   later.

A scheduler that finds an entry's state pending, committed by another term
(its scheduler died between the commit and the record), sends that tick
again before any later one (:meth:`TickDispatcher.pending_tick`): it commits
it again under its own term (same slot, same run number, so the same
deterministic task id) and sends it. Delivery is at least once per tick: a
tick goes out twice only when a scheduler died after its send and before
its record, and the worker-side once-guard
(:class:`~celery_nats_leader.worker.once_tasks.OnceTask`) runs it once.

This module imports neither Celery nor Django: the send is a callable, the
lease anything with ``is_leader`` and ``validate_token()`` (a
:class:`~celery_nats_leader.election.elector.RoleHandle`), so it runs as is on the
in-memory backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from celery_nats_leader.beat.schedule_store import EntryState
from celery_nats_leader.beat.ticks import slot_text, to_utc
from celery_nats_leader.core.errors import (
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ElectionError,
    KeyExistsError,
    PermissionDeniedError,
    RecordFormatError,
    RevisionMismatchError,
)
from celery_nats_leader.term.token import FencingToken

__all__ = ["Dispatched", "Lease", "Outcome", "StateStore", "Tick", "TickDispatcher"]

logger = logging.getLogger(__name__)


class Lease(Protocol):
    """The dispatcher's view of the beat role (a ``RoleHandle``)."""

    @property
    def is_leader(self) -> bool:
        """Whether the lease is held right now (local, no I/O)."""

    def validate_token(self) -> bool:
        """Confirm the token against KV (one read); ``False`` on a mismatch or doubt."""


class StateStore(Protocol):
    """Where entry states live (a :class:`~.schedule_store.ScheduleStateStore`)."""

    @property
    def bucket_name(self) -> str:
        """The state bucket's name."""

    def open(self) -> None:
        """Open (or create) the bucket."""

    def load(self) -> dict[str, EntryState]:
        """Every entry's state, by name."""

    def get(self, name: str) -> EntryState | None:
        """One entry's state."""

    def create(self, state: EntryState) -> EntryState:
        """Write a first state; ``KeyExistsError`` if there is one."""

    def update(self, state: EntryState, *, last: int) -> EntryState:
        """Compare-and-set at revision ``last``."""


@dataclass(frozen=True)
class Tick:
    """A due tick chosen for dispatch.

    Attributes:
        name: The entry's name.
        slot: The tick's slot (its identity).
        task: The entry's task name (stored with the state).
        skipped: Overdue ticks jumped over to reach ``slot``.
        resend: ``slot`` is the entry's pending tick, committed by another
            term and maybe never sent: it is committed again and sent.

    """

    name: str
    slot: datetime
    task: str = ""
    skipped: int = 0
    resend: bool = False


class Outcome(enum.Enum):
    """What became of a tick handed to :meth:`TickDispatcher.dispatch`."""

    #: Committed and sent.
    SENT = "sent"
    #: The token could not be confirmed; nothing written (try again later).
    UNCONFIRMED = "unconfirmed"
    #: The token is no longer the role's; nothing written (now following).
    NOT_LEADING = "not_leading"
    #: Someone wrote the entry's state since it was read; re-read, nothing sent.
    CONFLICT = "conflict"
    #: The commit failed or its outcome is unknown; nothing sent.
    NOT_COMMITTED = "not_committed"
    #: Committed, not sent, and the commit was undone.
    REVERTED = "reverted"
    #: Committed, not sent, and the commit could not be undone: the tick stays
    #: pending and is sent later (by this scheduler or its successor).
    UNSENT = "unsent"
    #: The send failed for good (the message cannot be built): the commit is
    #: kept, so this tick is dropped and the entry goes on with its next one.
    FAILED = "failed"


@dataclass(frozen=True)
class Dispatched:
    """The answer of :meth:`TickDispatcher.dispatch`.

    Attributes:
        outcome: What happened.
        state: The entry's state afterwards, as known (``None`` if unknown).
        error: The send's exception, for ``REVERTED``/``UNSENT`` after a failed send.

    """

    outcome: Outcome
    state: EntryState | None = None
    error: BaseException | None = None


class TickDispatcher:
    """Holds the term's entry states and dispatches ticks one at a time.

    Args:
        store: The state store.
        instance_id: This scheduler's election id (written as ``by``).
        send_guard: A context manager factory entered around "commit, check
            the lease, send, record" (the Celery mixin defers SIGTERM there, so
            a graceful stop cannot fall between the commit and the record).
        is_permanent: Whether a send's exception will recur on every attempt
            (a message that cannot be serialized): such a tick is not handed
            back, since retrying it would only fail again.

    """

    def __init__(
        self,
        store: StateStore,
        instance_id: str,
        *,
        send_guard: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
        is_permanent: Callable[[BaseException], bool] = lambda exc: False,
    ) -> None:
        self.store = store
        self.instance_id = instance_id
        self.send_guard = send_guard
        self.is_permanent = is_permanent
        self.states: dict[str, EntryState] = {}
        self.term: FencingToken | None = None
        # Entry name -> commit id of the pending state whose tick this
        # dispatcher sent itself (known sent, even if the record failed).
        self.sent: dict[str, str] = {}

    # ------------------------------------------------------------ term

    def begin_term(self, token: FencingToken) -> None:
        """Load every entry's state for the term of ``token``.

        Raises:
            BucketNotFoundError: The bucket is missing (permanent).
            BucketConfigError: The bucket expires values (permanent).
            PermissionDeniedError: Not allowed (permanent).
            ElectionError: Anything else (transient: call again later).

        """
        try:
            self.store.open()
            states = self.store.load()
        except (BucketNotFoundError, BucketConfigError, PermissionDeniedError) as exc:
            logger.critical("nats-leader beat: the schedule state is unusable: %s", exc)
            raise
        self.states = states
        self.term = token
        logger.info(
            "nats-leader beat: leading with epoch %d; continuing %d entr%s from KV bucket %r",
            token.epoch,
            len(states),
            "y" if len(states) == 1 else "ies",
            self.store.bucket_name,
        )

    def end_term(self) -> None:
        """Forget the term's states (a follower keeps none)."""
        self.term = None
        self.states.clear()

    # ----------------------------------------------------------- states

    def adopt(
        self, name: str, anchor: datetime, *, runs: int, task: str, token: FencingToken
    ) -> EntryState | None:
        """Give a new entry its KV state, anchored at ``anchor``.

        Returns:
            The entry's state (ours, or one written meanwhile by another
            term), or ``None`` when it could not be written or read now.

        Raises:
            BucketNotFoundError: The bucket is missing (permanent).
            PermissionDeniedError: Not allowed (permanent).

        """
        fresh = EntryState(
            entry=name,
            slot=to_utc(anchor),
            runs=runs,
            epoch=token.epoch,
            by=self.instance_id,
            commit=uuid.uuid4().hex[:12],
            task=task,
        )
        state: EntryState | None
        try:
            state = self.store.create(fresh)
            logger.info(
                "nats-leader beat: new entry %r anchored at %s", name, slot_text(fresh.slot)
            )
        except (KeyExistsError, BackendTimeoutError):
            # Created meanwhile by another term, or our own create landed late.
            state = self.read(name)
        except (BucketNotFoundError, PermissionDeniedError):
            raise
        except ElectionError as exc:
            logger.warning("nats-leader beat: could not create the state of %r: %s", name, exc)
            return None
        if state is not None:
            self.states[name] = state
        return state

    def read(self, name: str) -> EntryState | None:
        """Entry ``name``'s state from KV, or ``None`` (logged) when unreadable."""
        try:
            return self.store.get(name)
        except RecordFormatError as exc:
            logger.error("nats-leader beat: the state of %r is unreadable: %s", name, exc)
            return None
        except ElectionError as exc:
            logger.warning("nats-leader beat: could not read the state of %r: %s", name, exc)
            return None

    def pending_tick(self, name: str) -> Tick | None:
        """The tick to send again before any other of entry ``name``, if any.

        Returns:
            A ``resend`` tick when the entry's state is pending and this
            dispatcher did not send it itself; ``None`` otherwise.

        """
        state = self.states.get(name)
        if state is None or not state.pending or self.sent.get(name) == state.commit:
            return None
        return Tick(name, state.slot, task=state.task, resend=True)

    # --------------------------------------------------------- dispatch

    def dispatch(
        self,
        lease: Lease,
        token: FencingToken,
        tick: Tick,
        send: Callable[[EntryState], object],
    ) -> Dispatched:
        """Validate, commit, send one tick; revert the commit if it was not sent.

        Args:
            lease: The beat role.
            token: The term's token (the one :meth:`begin_term` was given).
            tick: The tick; the entry must have a state (:meth:`adopt`).
            send: Sends the tick, given the committed state; raises on failure.

        Returns:
            The outcome and the entry's state afterwards.

        Raises:
            BucketNotFoundError: The bucket is missing (permanent).
            PermissionDeniedError: Not allowed (permanent).

        """
        state = self.states[tick.name]
        # 1. Validate: the token against KV (one read).
        if not lease.validate_token():
            if lease.is_leader:
                logger.warning(
                    "nats-leader beat: could not confirm the fencing token (epoch %d) against "
                    "KV; not dispatching %r now",
                    token.epoch,
                    tick.name,
                )
                return Dispatched(Outcome.UNCONFIRMED, state)
            logger.warning(
                "nats-leader beat: the fencing token (epoch %d) is no longer the role's; "
                "dispatched nothing, following from now on",
                token.epoch,
            )
            return Dispatched(Outcome.NOT_LEADING, state)
        # 2. Commit: compare-and-set on the entry's revision, marked pending.
        if tick.resend:
            new = dataclasses.replace(
                state, epoch=token.epoch, by=self.instance_id, commit=uuid.uuid4().hex[:12]
            )
            logger.warning(
                "nats-leader beat: tick %s of %r was committed by %s (epoch %d) and maybe never "
                "sent; sending it again under the same task id",
                slot_text(state.slot),
                tick.name,
                state.by,
                state.epoch,
            )
        else:
            new = dataclasses.replace(
                state.advanced(
                    tick.slot, epoch=token.epoch, by=self.instance_id, skipped=tick.skipped
                ),
                task=tick.task or state.task,
                pending=True,
            )
        # A graceful stop (SIGTERM) waits for the commit, the send and the
        # record: it never leaves a pending tick behind it.
        with self.send_guard():
            committed = self._commit(lease, token, state, new)
            if isinstance(committed, Dispatched):
                return committed
            # 3. Send, unless the lease ended meanwhile; 4. revert when not sent.
            if not lease.is_leader:
                return self._revert(committed, state, token, "the lease ended before the send")
            try:
                send(committed)
            except Exception as exc:
                if self.is_permanent(exc):
                    # As Celery: log it and go on; the tick is consumed. It is
                    # recorded as no longer pending: sending it again (the
                    # outbox) would only fail again.
                    self.sent[tick.name] = committed.commit
                    committed = self._record_sent(committed)
                    self.states[tick.name] = committed
                    logger.error(
                        "nats-leader beat: sending %r (tick %s) failed and would fail again: "
                        "%r; tick dropped, the entry goes on with its next tick",
                        tick.name,
                        slot_text(committed.slot),
                        exc,
                    )
                    return Dispatched(Outcome.FAILED, committed, exc)
                logger.error(
                    "nats-leader beat: sending %r (tick %s) failed: %r",
                    tick.name,
                    slot_text(committed.slot),
                    exc,
                    exc_info=True,
                )
                return self._revert(committed, state, token, "the send failed", exc)
            # 4. Record the send: the outbox's completion.
            self.sent[tick.name] = committed.commit
            committed = self._record_sent(committed)
        self.states[tick.name] = committed
        return Dispatched(Outcome.SENT, committed)

    def _record_sent(self, committed: EntryState) -> EntryState:
        """Mark a sent tick's state as sent (one write); on failure it stays pending.

        This dispatcher never sends a pending state it sent itself again
        (:attr:`sent`); the entry's next commit replaces it. Only another
        scheduler finding it pending sends it again, which the worker-side
        once-guard makes harmless.
        """
        try:
            return self.store.update(committed.sent(), last=committed.revision)
        except ElectionError as exc:
            logger.warning(
                "nats-leader beat: tick %s of %r was sent but the send could not be recorded "
                "(%s); another scheduler may send it again (same task id)",
                slot_text(committed.slot),
                committed.entry,
                exc,
            )
            return committed

    def _commit(
        self, lease: Lease, token: FencingToken, state: EntryState, new: EntryState
    ) -> EntryState | Dispatched:
        try:
            return self.store.update(new, last=state.revision)
        except RevisionMismatchError:
            return self._conflict(lease, token, state.entry)
        except BackendTimeoutError:
            found = self._reconcile(new)
            if found is None:
                return Dispatched(Outcome.NOT_COMMITTED, self.states.get(new.entry))
            return found
        except (BucketNotFoundError, PermissionDeniedError) as exc:
            logger.critical("nats-leader beat: the schedule state is unusable: %s", exc)
            raise
        except ElectionError as exc:
            logger.warning(
                "nats-leader beat: could not commit tick %s of %r (%s); retrying",
                slot_text(new.slot),
                new.entry,
                exc,
            )
            return Dispatched(Outcome.NOT_COMMITTED, state)

    def _conflict(self, lease: Lease, token: FencingToken, name: str) -> Dispatched:
        """Someone wrote the entry's state since we read it: re-read, send nothing."""
        fresh = self.read(name)
        if fresh is None:
            self.states.pop(name, None)
            return Dispatched(Outcome.CONFLICT, None)
        self.states[name] = fresh
        logger.warning(
            "nats-leader beat: the state of %r was written by %s (epoch %d) since it was read; "
            "dispatched nothing, re-reading",
            name,
            fresh.by,
            fresh.epoch,
        )
        if fresh.epoch > token.epoch:
            # A newer term wrote it: confirm (the election demotes on a mismatch).
            lease.validate_token()
        return Dispatched(Outcome.CONFLICT, fresh)

    def _reconcile(self, new: EntryState) -> EntryState | None:
        """A commit timed out: it may have landed. Read the key to find out."""
        fresh = self.read(new.entry)
        if fresh is not None and fresh.commit == new.commit:
            return fresh
        if fresh is None:
            self.states.pop(new.entry, None)
            logger.error(
                "nats-leader beat: the commit of tick %s of %r timed out and the state cannot "
                "be read; not sending it now. If the commit was stored, the tick is pending and "
                "is sent when the state is read again.",
                slot_text(new.slot),
                new.entry,
            )
        else:
            self.states[new.entry] = fresh
        return None

    def _revert(
        self,
        committed: EntryState,
        previous: EntryState,
        token: FencingToken,
        why: str,
        error: BaseException | None = None,
    ) -> Dispatched:
        """Undo a commit whose tick was not sent, if nobody wrote the key since."""
        undo = dataclasses.replace(
            previous, epoch=token.epoch, by=self.instance_id, commit=uuid.uuid4().hex[:12]
        )
        try:
            reverted = self.store.update(undo, last=committed.revision)
        except ElectionError as exc:
            self.states.pop(committed.entry, None)
            logger.error(
                "nats-leader beat: tick %s of %r was committed but not sent (%s) and the commit "
                "could not be undone (%s): it stays pending and is sent when the state is read "
                "again",
                slot_text(committed.slot),
                committed.entry,
                why,
                exc,
            )
            return Dispatched(Outcome.UNSENT, None, error)
        self.states[committed.entry] = reverted
        logger.warning(
            "nats-leader beat: tick %s of %r not sent (%s); commit undone, the tick is "
            "dispatched later by the active scheduler",
            slot_text(committed.slot),
            committed.entry,
            why,
        )
        return Dispatched(Outcome.REVERTED, reverted, error)
