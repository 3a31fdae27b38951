"""The worker's start-up check of the once-guard's buckets.

With ticks run once (the default under a leader scheduler) every tick a
worker receives is claimed in the once-guard's buckets before it runs. A
worker that cannot use them (the buckets missing and its NATS user not
allowed to create them, a permission missing, a bucket made with other
settings) runs no tick at all: each one is retried every few seconds, for
ever. That must not wait for the first tick to be found, nor look like a
healthy worker, so at start-up the worker opens the buckets as a claim
would (creating them where its user may) and:

* says what to change at ERROR, again every :data:`REPEAT_SECONDS` while the
  problem lasts, and checks again as often (a bucket created by an operator
  is picked up without a restart);
* sets ``nats_leader_once_guard_ready`` (0 or 1) on its metrics port, which
  the shipped alert rules watch;
* with ``nats_leader_required``, refuses to start instead.

NATS being unreachable is not the guard's problem (the election reports it);
the check waits for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery_nats_leader.config.settings import LeaderSettings, is_leader_scheduler
from celery_nats_leader.core.errors import ElectionError, is_transient
from celery_nats_leader.worker.once_tasks import OnceService, guards_its_runs

__all__ = ["REPEAT_SECONDS", "OnceGuardCheck", "OnceGuardUnusableError", "once_guard_in_use"]

logger = logging.getLogger(__name__)

#: Seconds between two checks (and two ERROR lines) while the buckets are unusable.
REPEAT_SECONDS = 30.0

#: Seconds between two tries while NATS cannot be asked.
RETRY_SECONDS = 5.0


class OnceGuardUnusableError(ElectionError):
    """The once-guard's buckets cannot be used by this worker; says what to change."""


def once_guard_in_use(app: Any, settings: LeaderSettings) -> bool:
    """Whether this worker's tasks will claim runs in the once-guard.

    True when beat runs under a leader scheduler and ticks run once
    (``nats_leader_beat_once``, the default), or when a registered task
    guards its own runs (``OnceTask``, ``@run_once``).
    """
    if settings.beat_once and is_leader_scheduler(app.conf.get("beat_scheduler")):
        return True
    return any(guards_its_runs(task) for task in list(app.tasks.values()))


def unusable(settings: LeaderSettings, exc: ElectionError, *, app_name: str) -> str:
    """What a worker says when the once-guard's buckets cannot be used: the fix included."""
    return (
        f"the once-guard cannot use its buckets {settings.once_bucket + '_leases'!r} and "
        f"{settings.once_bucket!r} ({exc}): the ticks beat sends to run once, and OnceTask "
        "and @run_once tasks, are retried and never run on this worker until it can. "
        "Create the buckets as a NATS user allowed to "
        f"(`celery -A {app_name} nats-leader bucket --create`, or "
        "`manage.py election_bucket --create`), give this worker's user the once-guard's "
        "permissions (deploy/nats/permissions.conf), or set nats_leader_beat_once = False "
        "if ticks need not run once"
    )


class OnceGuardCheck:
    """Checks the once-guard's buckets from a worker's main process.

    Args:
        settings: The worker's settings.
        app_name: The app's name, for the command in the message.
        report: Called with ``True`` or ``False`` after each conclusive check
            (the metric).
        service: The guard to check (default: this process's).
        repeat: Seconds between two checks while the buckets are unusable.

    """

    def __init__(
        self,
        settings: LeaderSettings,
        *,
        app_name: str,
        report: Callable[[bool], None] | None = None,
        service: OnceService | None = None,
        repeat: float = REPEAT_SECONDS,
    ) -> None:
        self.settings = settings
        self.app_name = app_name
        self.report = report or (lambda _ready: None)
        # Not for_settings(): the check must not open the process's client.
        self.service = service or OnceService(settings)
        self.repeat = repeat
        self.ready: bool | None = None
        self.problem: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool | None:
        """One check: ``True`` usable, ``False`` unusable (said at ERROR), ``None`` unknown."""
        try:
            self.service.check()
        except ElectionError as exc:
            if is_transient(exc):
                logger.debug("nats-leader: once-guard check postponed: %s", exc)
                return None
            self.problem = unusable(self.settings, exc, app_name=self.app_name)
            logger.error("nats-leader: %s", self.problem)
            self._conclude(False)
            return False
        if self.ready is False:
            logger.info("nats-leader: the once-guard's buckets are usable again")
        self.problem = None
        self._conclude(True)
        return True

    def require(self) -> None:
        """Check once, for ``nats_leader_required``.

        Raises:
            OnceGuardUnusableError: The buckets cannot be used (the message says
                what to change).
            ElectionError: NATS could not be asked.

        """
        try:
            self.service.check()
        except ElectionError as exc:
            if is_transient(exc):
                raise
            self._conclude(False)
            raise OnceGuardUnusableError(
                unusable(self.settings, exc, app_name=self.app_name)
            ) from exc
        self._conclude(True)

    def start(self) -> None:
        """Check in the background until the buckets are found usable."""
        self._thread = threading.Thread(
            target=self._run, name="nats-leader-once-check", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop checking (idempotent)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            outcome = self.check()
            if outcome:
                return
            self._stop.wait(RETRY_SECONDS if outcome is None else self.repeat)

    def _conclude(self, ready: bool) -> None:
        self.ready = ready
        try:
            self.report(ready)
        except Exception:  # a metric must not stop the check
            logger.exception("nats-leader: could not report the once-guard's state")
