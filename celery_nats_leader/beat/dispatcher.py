"""The tick dispatcher: validate the token, commit the tick in KV, send it, revert on failure.

One :class:`TickDispatcher` per scheduler. It holds the KV state of every
entry for the current term and dispatches one tick at a time:

1. **validate** the fencing token against KV (one read of the role's key);
   on a mismatch nothing is dispatched and the election demotes;
2. **commit** the tick to the entry's state with a compare-and-set on the
   key's revision, so two schedulers that both believe they lead cannot both
   commit the same tick;
3. **send** it (a callback: the Celery mixin publishes the message), unless
   the lease ended meanwhile;
4. **revert** the commit when the tick was not sent, so the active scheduler
   dispatches it later.

Delivery is at most once per tick: a crash between the commit and the send
loses that one tick (the error log line names it).

This module imports neither Celery nor Django: the send is a callable, the
lease anything with ``is_leader`` and ``validate_token()`` (a
:class:`~celery_nats_leader.elector.RoleHandle`), so it runs as is on the
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

from celery_nats_leader.beat.state import EntryState
from celery_nats_leader.beat.ticks import slot_text, to_utc
from celery_nats_leader.errors import (
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ElectionError,
    KeyExistsError,
    PermissionDeniedError,
    RecordFormatError,
    RevisionMismatchError,
)
from celery_nats_leader.token import FencingToken

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
    """Where entry states live (a :class:`~celery_nats_leader.beat.state.ScheduleStateStore`)."""

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

    """

    name: str
    slot: datetime
    task: str = ""
    skipped: int = 0


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
    #: Committed, not sent, and the commit could not be undone: the tick is lost.
    LOST = "lost"


@dataclass(frozen=True)
class Dispatched:
    """The answer of :meth:`TickDispatcher.dispatch`.

    Attributes:
        outcome: What happened.
        state: The entry's state afterwards, as known (``None`` if unknown).
        error: The send's exception, for ``REVERTED``/``LOST`` after a failed send.

    """

    outcome: Outcome
    state: EntryState | None = None
    error: BaseException | None = None


class TickDispatcher:
    """Holds the term's entry states and dispatches ticks one at a time.

    Args:
        store: The state store.
        instance_id: This scheduler's election id (written as ``by``).
        send_guard: A context manager factory entered around "check the lease,
            send" (the Celery mixin defers SIGTERM there, so a graceful stop
            cannot fall between the commit and the send).

    """

    def __init__(
        self,
        store: StateStore,
        instance_id: str,
        *,
        send_guard: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.store = store
        self.instance_id = instance_id
        self.send_guard = send_guard
        self.states: dict[str, EntryState] = {}
        self.term: FencingToken | None = None

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
        # 2. Commit: compare-and-set on the entry's revision.
        new = dataclasses.replace(
            state.advanced(tick.slot, epoch=token.epoch, by=self.instance_id, skipped=tick.skipped),
            task=tick.task or state.task,
        )
        committed = self._commit(lease, token, state, new)
        if isinstance(committed, Dispatched):
            return committed
        # 3. Send, unless the lease ended meanwhile; 4. revert when not sent.
        with self.send_guard():
            if not lease.is_leader:
                return self._revert(committed, state, token, "the lease ended before the send")
            try:
                send(committed)
            except Exception as exc:
                logger.error(
                    "nats-leader beat: sending %r (tick %s) failed: %r",
                    tick.name,
                    slot_text(committed.slot),
                    exc,
                    exc_info=True,
                )
                return self._revert(committed, state, token, "the send failed", exc)
        self.states[tick.name] = committed
        return Dispatched(Outcome.SENT, committed)

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
                "be read; not sending it (at most once). If the commit was stored, this tick "
                "is lost.",
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
                "could not be undone (%s): this tick is lost (at most once)",
                slot_text(committed.slot),
                committed.entry,
                why,
                exc,
            )
            return Dispatched(Outcome.LOST, None, error)
        self.states[committed.entry] = reverted
        logger.warning(
            "nats-leader beat: tick %s of %r not sent (%s); commit undone, the tick is "
            "dispatched later by the active scheduler",
            slot_text(committed.slot),
            committed.entry,
            why,
        )
        return Dispatched(Outcome.REVERTED, reverted, error)
