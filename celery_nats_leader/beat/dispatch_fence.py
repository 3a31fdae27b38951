"""The worker-side half of the beat fence: refuse tasks sent under an ended term.

The leader scheduler (:mod:`celery_nats_leader.beat`) puts its term's epoch
and the tick's identity in every message's headers (below); never the fencing
token itself, which is a secret of the term (headers end up in logs, brokers
and monitoring tools). The epoch is all the check needs: a term is stale once
a newer one (a higher epoch) has begun. A task that opts
in checks, before its body runs, that no newer term of the beat role has
begun since (one KV read): :class:`FencedBeatTask` as the task base, or
:func:`enforce_dispatch_token` / :func:`check_dispatch_token` from any hook
that may raise (``Task.before_start``, the task's first line). A
``task_prerun`` receiver cannot refuse a task: Celery logs and drops its
exceptions.

The price of the check: a message sent by a leader that then stopped, still
queued when the next term begins, is refused too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import Task

from celery_nats_leader.beat.schedule_store import decode_state, state_key
from celery_nats_leader.config.settings import LeaderSettings, settings_of_app
from celery_nats_leader.core.backend import Operation
from celery_nats_leader.core.constants import (
    ENTRY_HEADER,
    EPOCH_HEADER,
    ONCE_HEADER,
    ROLE_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
)
from celery_nats_leader.core.errors import ElectionError, RecordFormatError, is_transient
from celery_nats_leader.nats.process_client import ProcessClient
from celery_nats_leader.term import TermReader
from celery_nats_leader.term.current import term_of
from celery_nats_leader.term.token import FencingToken
from celery_nats_leader.worker.recheck import recheck_later
from celery_nats_leader.worker.refused import NotRun

if TYPE_CHECKING:
    from celery_nats_leader.config.connection import ConnectOptions

__all__ = [
    "DispatchCheck",
    "DispatchFence",
    "FencedBeatTask",
    "check_dispatch_token",
    "enforce_dispatch_token",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchCheck:
    """The answer of :func:`check_dispatch_token`.

    Attributes:
        fenced: Whether the message carried a beat epoch at all.
        ok: Whether the task may run.
        certain: ``False`` when the current term could not be read (the
            answer is then ``ok=False``: fail closed).
        role: The role named in the message.
        epoch: The epoch of the term that dispatched the message.
        current_epoch: The epoch of the role's current term, if read.
        reason: Why it may not run ("" when it may).
        needs_operator: With ``certain=False``: the read failed for a reason
            that does not pass by itself (a missing bucket, a permission).

    """

    fenced: bool
    ok: bool
    certain: bool = True
    role: str | None = None
    epoch: int | None = None
    current_epoch: int | None = None
    reason: str = ""
    needs_operator: bool = False


def _request_headers(request: Any) -> Mapping[str, Any]:
    """Our headers from a task request: Celery exposes custom headers both ways."""
    found: dict[str, Any] = {}
    headers = getattr(request, "headers", None)
    if isinstance(headers, Mapping):
        found.update(headers)
    for name in (EPOCH_HEADER, TOKEN_HEADER, ROLE_HEADER, ENTRY_HEADER, TICK_HEADER, ONCE_HEADER):
        value = getattr(request, name, None)
        if value is not None and name not in found:
            found[name] = value
    return found


class DispatchFence:
    """Reads the current term of a role, for the worker-side check.

    One per process and settings (:meth:`for_settings`), kept by the
    process's :class:`~celery_nats_leader.nats.process_client.ProcessClient`; it
    reads through a :class:`~celery_nats_leader.term.TermReader` (the
    process's one connection, opened at first use), and remembers the highest
    epoch it has seen (epochs only grow), so that epochs older than that are
    refused without a round trip.

    When nobody leads the role, a newer term may still have begun and ended
    since the message was sent (its successor resigned, its key expired)
    unseen by this process: the entry's schedule state, in ``state_bucket``,
    says which term dispatched the entry last, and a newer one refuses the
    message too.

    Args:
        connection: Where and how to connect.
        bucket: The election bucket.
        timeout: Seconds per read.
        state_bucket: The beat schedule's state bucket (``None``: not read).

    """

    def __init__(
        self,
        connection: ConnectOptions,
        bucket: str,
        *,
        timeout: float = 2.0,
        state_bucket: str | None = None,
    ) -> None:
        self.bucket_name = bucket
        self.state_bucket = state_bucket
        self.timeout = timeout
        self.connection = connection
        self.reader = TermReader(connection, bucket)
        self._highest: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_settings(cls, settings: LeaderSettings) -> DispatchFence:
        """The fence of this process for ``settings`` (created on first use)."""
        return ProcessClient.for_settings(settings).shared(
            ("fence", settings.bucket),
            lambda _client: cls(
                settings.connection,
                settings.bucket,
                timeout=settings.election_config(settings.beat_role).request_timeout * 4,
                state_bucket=settings.beat_state_bucket,
            ),
        )

    def current_epoch(self, role: str) -> int | None:
        """The epoch of ``role``'s current term (``None``: nobody leads it now).

        A value that is not a leader record counts as a term newer than any
        before it (its revision).

        Raises:
            ElectionError: The term could not be read.

        """
        return self.read_role(role)[0]

    def read_role(self, role: str) -> tuple[int | None, int]:
        """``role``'s key as the check reads it: ``(current epoch, vacated at)``.

        Returns:
            The epoch of the current term (``None``: nobody leads), and the
            revision of the marker that vacated the key (0: none, or a term).

        Raises:
            ElectionError: The key could not be read.

        """
        entry = self.reader.read_latest(role, timeout=self.timeout)
        term = term_of(entry)
        if term is None:
            # A delete (or the server's expiry marker) at revision R: every
            # term created below R has ended, whoever released it.
            return None, entry.revision if entry is not None else 0
        with self._lock:
            self._highest[role] = max(self._highest.get(role, 0), term.epoch)
        return term.epoch, 0

    def dispatched_epoch(self, role: str, entry: str) -> int:
        """The epoch of the term that last dispatched ``entry`` of ``role`` (0: none recorded).

        Raises:
            ElectionError: The state could not be read.

        """
        if self.state_bucket is None:
            return 0
        # Not remembered as the role's highest epoch: a state written under
        # another strategy's epochs (an ALLCALL beat role before the move to
        # KV) must not refuse every later term; it is asked only while the
        # role is vacant, and the next leader's dispatches overwrite it.
        found = ProcessClient.for_connection(self.connection).read_key(
            self.state_bucket,
            state_key(role, entry),
            timeout=self.timeout,
            what=f"could not read the schedule state of {entry!r}",
        )
        if found is None or found.operation is not Operation.PUT:
            return 0
        try:
            return decode_state(found.value, found.revision).epoch
        except RecordFormatError:
            return 0  # not a state of ours: it says nothing of terms

    def highest_epoch(self, role: str) -> int:
        """The highest epoch of ``role`` seen by this process (0 if none)."""
        return self._highest.get(role, 0)

    def check(self, role: str, epoch: int, entry: str | None = None) -> DispatchCheck:
        """Whether a message sent by the term of ``epoch`` may still run.

        It may not when a term newer than ``epoch`` began (its epoch is
        higher): the current term's, or, when nobody leads the role right now,
        the term that last dispatched ``entry`` (its schedule state). On any
        doubt it may not (``certain=False``).
        """

        def refused(reason: str, current_epoch: int | None = None) -> DispatchCheck:
            return DispatchCheck(
                True, False, role=role, epoch=epoch, current_epoch=current_epoch, reason=reason
            )

        def unverifiable(reason: str, exc: ElectionError) -> DispatchCheck:
            return DispatchCheck(
                True,
                False,
                certain=False,
                role=role,
                epoch=epoch,
                reason=reason,
                needs_operator=not is_transient(exc),
            )

        highest = self.highest_epoch(role)
        if epoch < highest:
            return refused(
                f"dispatched under epoch {epoch}; a newer term ({highest}) began", highest
            )
        try:
            current, vacated_at = self.read_role(role)
        except ElectionError as exc:
            return unverifiable(f"the current term of {role!r} could not be read: {exc}", exc)
        if current is not None and current > epoch:
            return refused(
                f"dispatched under epoch {epoch}; the current term is {current}", current
            )
        if vacated_at > epoch:
            # Nobody leads, and the key was vacated after the message's term
            # began: that term has ended (a paused ex-leader's late send).
            return refused(
                f"dispatched under epoch {epoch}; that term has ended (the role was released "
                f"at revision {vacated_at} and nobody leads it now)"
            )
        if current is None and entry is not None:
            try:
                dispatched = self.dispatched_epoch(role, entry)
            except ElectionError as exc:
                return unverifiable(
                    f"nobody leads {role!r} and the state of {entry!r} could not be read: {exc}",
                    exc,
                )
            if dispatched > epoch:
                return refused(
                    f"dispatched under epoch {epoch}; a newer term ({dispatched}) has "
                    f"dispatched {entry!r} since",
                    dispatched,
                )
        return DispatchCheck(True, True, role=role, epoch=epoch, current_epoch=current)


def check_dispatch_token(request: Any, app: Any) -> DispatchCheck:
    """Check the beat epoch a task message carries against its role's current term.

    The worker-side half of the fence, for the integration to call before a
    task runs (``Task.before_start``, or a task's first line). One KV read per
    fenced message; messages without the header are not beat dispatches and
    pass. The epoch comes from the ``nats_leader_epoch`` header, or from the
    token header of a message queued by an older version.

    Args:
        request: The task's request (``task.request``).
        app: The Celery app (for the ``nats_leader_*`` settings).

    Returns:
        The verdict: ``ok`` is ``False`` when the message's term is older than
        the current one, its epoch malformed, or (``certain=False``) unverifiable.

    """
    headers = _request_headers(request)
    raw_epoch = headers.get(EPOCH_HEADER)
    raw_token = headers.get(TOKEN_HEADER)
    if raw_epoch is None and raw_token is None:
        return DispatchCheck(False, True, reason="not dispatched by a leader scheduler")
    settings = settings_of_app(app)
    role = str(headers.get(ROLE_HEADER) or settings.beat_role)
    try:
        if raw_epoch is not None:
            epoch = _parse_epoch(raw_epoch)
        else:
            epoch = FencingToken.from_header(str(raw_token)).epoch
    except RecordFormatError as exc:
        return DispatchCheck(True, False, role=role, reason=f"malformed epoch header: {exc}")
    entry = headers.get(ENTRY_HEADER)
    return DispatchFence.for_settings(settings).check(
        role, epoch, str(entry) if entry is not None else None
    )


def _parse_epoch(raw: Any) -> int:
    """An epoch header's value (an int, or its decimal text after a string-only transport)."""
    if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
        return raw
    if isinstance(raw, str) and raw.isdigit() and int(raw) > 0:
        return int(raw)
    raise RecordFormatError(f"not an epoch: {str(raw)[:20]!r}")


def enforce_dispatch_token(task: Any, *, retry_countdown: float = 1.0) -> DispatchCheck:
    """Refuse to run ``task`` if it was dispatched under an ended beat term.

    * stale or malformed epoch: logged at WARNING, the task is ignored
      (:class:`celery.exceptions.Ignore`: acknowledged, not run, not retried);
    * the term could not be read: the message is sent again to be checked
      after ``retry_countdown`` seconds (same id and headers), as often as it
      takes and without spending the task's own retries
      (:func:`~celery_nats_leader.worker.recheck.recheck_later`), so nothing
      is lost while NATS is unreachable;
    * no epoch (not a beat dispatch) or a current one: it runs.

    Args:
        task: The bound task (``self`` in a ``bind=True`` task).
        retry_countdown: Seconds before re-checking on doubt.

    Returns:
        The verdict, when the task may run.

    Raises:
        Ignore: The message's term has ended.
        Retry: The term could not be read.

    """
    verdict = check_dispatch_token(task.request, task.app)
    if verdict.ok:
        return verdict
    headers = _request_headers(task.request)
    if not verdict.certain:
        # Kept, never run unchecked nor dropped. A problem that needs an
        # operator (a missing bucket, a permission) is said at ERROR and
        # checked again less often: it does not pass by itself.
        countdown = retry_countdown * 10 if verdict.needs_operator else retry_countdown
        logger.log(
            logging.ERROR if verdict.needs_operator else logging.WARNING,
            "%s[%s]: cannot check its beat epoch yet (%s); retrying in %gs",
            task.name,
            task.request.id,
            verdict.reason,
            countdown,
        )
        raise recheck_later(task, countdown)
    logger.warning(
        "%s[%s]: not run: %s (entry %r, tick %s)",
        task.name,
        task.request.id,
        verdict.reason,
        headers.get(ENTRY_HEADER),
        headers.get(TICK_HEADER),
    )
    raise NotRun()


class FencedBeatTask(Task):  # type: ignore[misc]  # Celery is untyped
    """Task base that refuses messages sent by a beat scheduler whose term ended.

    ``@app.task(base=FencedBeatTask)``: before the body runs, the beat epoch
    in the message is checked against KV (see :func:`enforce_dispatch_token`).
    Tasks sent without one (not by a leader scheduler) run as usual.
    """

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Check the message's beat epoch before the body runs."""
        enforce_dispatch_token(self)
        super().before_start(task_id, args, kwargs)
