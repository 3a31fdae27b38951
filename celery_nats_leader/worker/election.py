"""The leader election of a Celery worker (what the bootstep runs).

One :class:`WorkerElection` per worker, in the worker's main process:

* one :class:`~celery_nats_leader.election.elector.Elector` (one event-loop thread, one
  NATS connection) campaigning for ``nats_leader_roles``;
* the shared-memory slots through which prefork children learn the term
  (:mod:`celery_nats_leader.worker.shared_leadership`), kept current from the elector's
  own loop at every state change and renewal;
* the :class:`LeaderQueueController`, which makes the consumer read a role's
  leader queue only while this worker leads the role;
* the :mod:`~celery_nats_leader.worker.signals` and the Prometheus metrics.

The bootsteps in :mod:`celery_nats_leader.worker.bootstep` only build, start and
stop it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError, ElectionError
from celery_nats_leader.election import DemoteReason, ElectionState
from celery_nats_leader.election.elector import Elector, RoleHandle
from celery_nats_leader.election.leader_services import LeaderServiceRunner
from celery_nats_leader.election.observer import ElectionObserver
from celery_nats_leader.observe.probes import ProbeServer
from celery_nats_leader.term.token import FencingToken
from celery_nats_leader.worker import shared_leadership
from celery_nats_leader.worker.beat_once import guard_beat_ticks
from celery_nats_leader.worker.broker_wake import wake_consumer
from celery_nats_leader.worker.leader_services import on_own_thread, registered_services
from celery_nats_leader.worker.once_check import OnceGuardCheck, once_guard_in_use
from celery_nats_leader.worker.shared_leadership import SharedLeadership, WorkerLeadership
from celery_nats_leader.worker.signals import leader_demoted, leader_promoted
from celery_nats_leader.worker.tasks import leader_tasks, upgrade_tasks

if TYPE_CHECKING:
    from celery_nats_leader.observe.prometheus import PrometheusObserver

logger = logging.getLogger(__name__)

#: Seconds between two reports that an election is still stopped by an error.
ERROR_REPEAT_SECONDS = 30.0


class WorkerElection:
    """Runs the election of one worker and wires it into the worker.

    Build it before the pool forks (the shared slots must be inherited), start
    it after.

    Args:
        app: The Celery app.
        settings: The worker's election settings.
        hostname: The worker's node name, published in the leader record.

    Raises:
        ConfigError: If the settings are unusable (for example metrics asked
            for without ``prometheus-client``).

    """

    def __init__(self, app: Any, settings: LeaderSettings, *, hostname: str | None = None) -> None:
        if settings.beat_role in settings.roles:
            # A worker holding the beat role would make every beat replica
            # follow it, and nothing would be dispatched.
            raise ConfigError(
                f"nats_leader_roles {list(settings.roles)} contains the beat role "
                f"{settings.beat_role!r}: only beat schedulers may campaign for it. Remove it "
                "from nats_leader_roles, or rename the role (nats_leader_beat_role)"
            )
        self.app = app
        self.settings = settings
        self.roles = settings.roles
        self.instance_id = settings.instance_id
        self.queue_names = {role: settings.queue_for(role) for role in settings.roles}
        self.shared = SharedLeadership(settings.roles)
        self.metrics: PrometheusObserver | None = None
        if settings.metrics_port is not None:
            # Imported only when asked for: prometheus-client is an optional extra.
            from celery_nats_leader.observe.prometheus import PrometheusObserver

            self.metrics = PrometheusObserver(
                bucket=settings.bucket, namespace=settings.metrics_namespace
            )
        self.metrics_port: int | None = None
        self.probes: ProbeServer | None = None
        self.elector = Elector(
            settings.servers,
            connect_options=settings.connect_options,
            name=f"celery-nats-leader {hostname or self.instance_id}",
            observer=_ServiceObserver(self, self.metrics),
        )
        self._handles: dict[str, RoleHandle] = {}
        for role in settings.roles:
            config = settings.election_config(role)
            if hostname:
                config = dataclasses.replace(config, meta={**config.meta, "worker": hostname})
            handle = self.elector.add_role(config)
            handle.on_promote(functools.partial(self._on_promote, role))
            handle.on_demote(functools.partial(self._on_demote, role))
            handle.on_error(functools.partial(self._on_error, role))
            # Every move of the deadline reaches the children at once (with
            # fast failover it moves with each promise, and may move earlier).
            handle.election.add_lease_listener(functools.partial(self.publish, role))
            self._handles[role] = handle
        if self.metrics is not None:
            self.metrics.watch_elector(self.elector, self.instance_id)
        self.queues = LeaderQueueController(app, self.queue_names, self.is_leader)
        self.services = self._add_services(app, settings)
        self._refresher: Any = None
        self.once_check: OnceGuardCheck | None = None
        self._started = False
        self._stopped = False
        # Installed now, before the pool forks, so that children inherit it.
        self._leadership = WorkerLeadership(
            self.shared,
            self,
            instance_id=self.instance_id,
            bucket=settings.bucket,
            connection=settings.connection,
            request_timeouts={r: h.config.request_timeout for r, h in self._handles.items()},
        )
        shared_leadership.install(self._leadership)

    def _add_services(self, app: Any, settings: LeaderSettings) -> list[LeaderServiceRunner]:
        """Register the app's leader services with their roles' elections."""
        default = self.roles[0] if self.roles else None
        runners = []
        for spec in registered_services(app, settings.services, default):
            handle = self._handles.get(spec.role) if spec.role else None
            if handle is None:
                logger.warning(
                    "nats-leader: leader service %s runs on the leader of %r, but this worker "
                    "does not campaign for it (nats_leader_roles=%s); it will not run here",
                    spec.name,
                    spec.role,
                    list(self.roles),
                )
                continue
            runners.append(
                handle.run_while_leading(
                    on_own_thread(spec.function), name=spec.name, grace=spec.grace
                )
            )
        return runners

    def prepare_worker(self) -> None:
        """Adjust the app for this worker; call before the consumer starts.

        * Leader queues are removed from the queues the worker always
          consumes (``task_queues``, ``-Q``): they are consumed only while
          leading.
        * Leader-only tasks get ``acks_late`` and ``reject_on_worker_lost``,
          which the requeue policy relies on.
        * Every task runs the ticks our beat schedulers send once
          (:mod:`~celery_nats_leader.worker.beat_once`), unless
          ``nats_leader_beat_once`` is ``False``.
        """
        queues = self.app.amqp.queues
        standing = [
            name
            for name in queues.consume_from
            if name in self.queue_names.values()
            or (self.settings.queue_prefix and name.startswith(self.settings.queue_prefix))
        ]
        if standing:
            logger.warning(
                "nats-leader: not consuming %s at start: leader queues are consumed only while "
                "this worker leads their role",
                ", ".join(standing),
            )
            queues.deselect(standing)
        upgrade_tasks(self.app)
        if self.settings.beat_once:
            guard_beat_ticks(self.app)
        for task, role in leader_tasks(self.app):
            if role not in self.roles:
                logger.warning(
                    "nats-leader: task %s runs only on the leader of %r, but this worker does not "
                    "campaign for %r (nats_leader_roles=%s); it will never run it",
                    task.name,
                    role,
                    role,
                    list(self.roles),
                )

    # ------------------------------------------------------------ queries

    def handle(self, role: str) -> RoleHandle:
        """The elector's handle of ``role``.

        Raises:
            KeyError: If this worker does not campaign for ``role``.

        """
        return self._handles[role]

    def is_leader(self, role: str) -> bool:
        """Whether this worker leads ``role`` now (lease checked)."""
        handle = self._handles.get(role)
        return handle is not None and handle.is_leader

    def current_token(self, role: str) -> FencingToken | None:
        """The token while this worker leads ``role``, else ``None``."""
        handle = self._handles.get(role)
        return handle.token if handle is not None else None

    @property
    def election_errors(self) -> dict[str, str]:
        """Why each role's election is not running, for health checks (empty when all run).

        A role is listed while its election could not start (NATS
        unreachable, the bucket missing or wrong, permission denied) or after
        a permanent error stopped it. Without ``nats_leader_required`` the
        worker keeps serving ordinary tasks meanwhile; readiness probes and
        the ``nats_leader_election_error`` metric read this.
        """
        start_error = self.elector.start_error
        errors = {}
        for role, handle in self._handles.items():
            error = handle.error or (start_error if handle.state is ElectionState.INIT else None)
            if error is not None:
                errors[role] = f"{type(error).__name__}: {error}"
        return errors

    @property
    def election_error(self) -> str | None:
        """One line saying why the election is not running, or ``None`` if it runs."""
        errors = self.election_errors
        if not errors:
            return None
        return "; ".join(f"{role}: {message}" for role, message in errors.items())

    def validate(self, role: str, token: FencingToken, timeout: float | None) -> bool:
        """Confirm ``token`` against KV (one read); ``False`` on any doubt."""
        handle = self._handles.get(role)
        if handle is None:
            return False
        return handle.validate_token(timeout) and handle.token == token

    # ---------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Serve metrics, connect and campaign.

        With ``required`` it waits for NATS and the first campaign and raises
        if NATS cannot be reached; otherwise it returns at once and keeps
        trying in the background, logging every failed attempt.

        Raises:
            NatsUnavailableError: NATS unreachable and ``required`` is set.
            ElectionError: A permanent problem (missing bucket, ...) and
                ``required`` is set.
            ConfigError: The metrics port cannot be served.

        """
        settings = self.settings
        if self.metrics is not None and settings.metrics_port is not None:
            port = int(settings.metrics_port)
            # /metrics, /healthz and /readyz of this worker on one port.
            self.probes = ProbeServer.for_elector(self.elector, registry=self.metrics.registry)
            try:
                self.metrics_port = self.probes.serve(port, settings.metrics_address)
            except OSError as exc:
                raise ConfigError(
                    f"nats_leader_metrics_port={port}: cannot serve metrics on "
                    f"{settings.metrics_address}:{port} ({exc}); pick a free port per worker "
                    "or unset it"
                ) from exc
        logger.info(
            "nats-leader: instance %s campaigns for %s in bucket %r on %s (leader queues: %s)",
            self.instance_id,
            ", ".join(self.roles),
            settings.bucket,
            ", ".join(settings.servers),
            ", ".join(self.queue_names.values()),
        )
        self._started = True
        # Without ``required`` this returns at once; the elector connects in
        # the background and logs a warning for every failed attempt, while
        # the worker serves ordinary tasks.
        self.elector.start(timeout=settings.start_timeout, require_connection=settings.required)
        self._check_once_guard()
        if self._handles:
            self._refresher = self.elector.loop.submit(self._refresh_forever())
        else:
            logger.warning("nats-leader: nats_leader_roles is empty; this worker leads nothing")

    def _check_once_guard(self) -> None:
        """Check the once-guard's buckets now (``required``) or in the background."""
        if not once_guard_in_use(self.app, self.settings):
            return
        metrics = self.metrics

        def report(ready: bool) -> None:
            if metrics is not None:
                metrics.set_once_guard_ready(self.settings.once_bucket, self.instance_id, ready)

        self.once_check = OnceGuardCheck(
            self.settings, app_name=self.app.main or "<app>", report=report
        )
        if self.settings.required:
            self.once_check.require()
        else:
            self.once_check.start()

    def stop(self) -> None:
        """Stop campaigning; a leader releases its roles first. Idempotent.

        Called at the very start of a warm shutdown, before Celery waits for
        running tasks, so that a successor takes over in milliseconds. Tasks
        already running here finish; their fencing token is from the old
        term (see the docs on delivery semantics).
        """
        if self._stopped:
            return
        self._stopped = True
        if self.once_check is not None:
            self.once_check.stop()
        self.queues.close()
        if self._started:
            logger.info("nats-leader: releasing leadership and leaving the election")
            # Demote callbacks run (each role waits for them at most its
            # demote_timeout), then each held key is deleted (one request):
            # the bound leaves room for both, so that a slow demote callback
            # does not cancel the release and make the successor wait a TTL.
            self.elector.stop(timeout=self.settings.release_bound(self.roles))
        self.shared.clear_all()
        # A stopped service leaves no election behind: checks in this process
        # then say that none runs, not that this worker skips the role.
        if shared_leadership.current() is self._leadership:
            shared_leadership.install(None)
        if self.probes is not None:
            self.probes.close()

    # ---------------------------------------------- publishing to children

    def publish(self, role: str) -> None:
        """Copy ``role``'s term into the shared slot. Elector loop thread only.

        The deadline written is never later than the election's own: the
        clock is read *before* the remaining lease, so ``now + remaining`` is
        at most the true deadline.
        """
        handle = self._handles.get(role)
        if handle is None:
            return
        now = time.monotonic()
        token = handle.token
        remaining = handle.election.lease_remaining
        if token is None or remaining <= 0:
            self.shared.clear(role)
        else:
            self.shared.publish(role, token.epoch, now + remaining, token.value)

    async def _refresh_forever(self) -> None:
        """Safety net on the elector loop: republish, count, reconcile.

        The observer hooks publish every change as it happens; this catches
        lease extensions that come without a hook (a timed-out renewal found
        to have landed), serves children's validation requests, and re-asks
        the consumer to reconcile its queues if a request was lost.
        """
        interval = max(0.05, min(h.config.heartbeat_interval for h in self._handles.values()) / 2)
        seen = {role: self.shared.validation_counts(role) for role in self.roles}
        next_error_report = time.monotonic() + ERROR_REPEAT_SECONDS
        while True:
            await asyncio.sleep(interval)
            try:
                errors = self.election_errors
                if self.metrics is not None:
                    for role in self.roles:
                        self.metrics.set_election_error(role, self.instance_id, role in errors)
                if errors and time.monotonic() >= next_error_report:
                    # Said again and again: a worker running without its
                    # election must not look healthy in the logs.
                    next_error_report = time.monotonic() + ERROR_REPEAT_SECONDS
                    self._report_stopped(errors)
                for role, handle in self._handles.items():
                    self.publish(role)
                    counts = self.shared.validation_counts(role)
                    if self.metrics is not None:
                        # Validations done in pool children, counted in the
                        # shared block, reported here (metrics live in this process).
                        done = max(0, counts[0] - seen[role][0])
                        failed = min(done, max(0, counts[1] - seen[role][1]))
                        for i in range(done):
                            self.metrics.validation(role, self.instance_id, i >= failed)
                        self.metrics.set_leader(role, self.instance_id, handle.is_leader)
                    seen[role] = counts
                    if self.shared.take_validation_request(role) and handle.is_leader:
                        # A child found a stale token: confirm (and demote) now.
                        await handle.election.validate_token()
                if self.queues.needs_reconcile():
                    self.queues.request_reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("nats-leader: refresh failed")

    # ------------------------------------------------ election callbacks

    def _on_promote(self, role: str, token: FencingToken) -> None:
        logger.info(
            "nats-leader: leading %r (epoch %d); consuming %s",
            role,
            token.epoch,
            self.queue_names[role],
        )
        self.queues.request_reconcile()
        leader_promoted.send(sender=role, token=token, instance_id=self.instance_id)

    def _on_demote(self, role: str, reason: DemoteReason) -> None:
        logger.info(
            "nats-leader: no longer leading %r (%s); leaving %s",
            role,
            reason.value,
            self.queue_names[role],
        )
        self.queues.request_reconcile()
        leader_demoted.send(sender=role, reason=reason, instance_id=self.instance_id)

    def _on_error(self, role: str, error: ElectionError) -> None:
        logger.critical(
            "nats-leader: the election for %r stopped: %s. Leader-only tasks of %r will not run "
            "on this worker until it restarts.",
            role,
            error,
            role,
        )

    def _report_stopped(self, errors: Mapping[str, str]) -> None:
        stopped = [role for role in errors if self._handles[role].error is not None]
        # Errors of a start still being retried are repeated by the elector itself.
        for role in stopped:
            logger.error(
                "nats-leader: the election for %r is still stopped: %s. Leader-only tasks and "
                "services of %r do not run on this worker until it restarts.",
                role,
                errors[role],
                role,
            )


class _ServiceObserver:
    """Publishes each state change to the shared slots, then feeds metrics."""

    def __init__(self, service: WorkerElection, downstream: ElectionObserver | None) -> None:
        self._service = service
        self._downstream = downstream

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        # Synchronous, on the loop, at the instant the state changes: a
        # demotion reaches the children before anything else happens.
        self._service.publish(role)
        if self._downstream is not None:
            self._downstream.state_changed(role, instance_id, old, new)

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        if self._downstream is not None:
            self._downstream.campaign(role, instance_id, won)

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        if ok:
            # The hook runs just before the election records the renewal;
            # publish right after it, on the same loop.
            asyncio.get_running_loop().call_soon(self._service.publish, role)
        if self._downstream is not None:
            self._downstream.heartbeat(role, instance_id, seconds, ok)

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        if self._downstream is not None:
            self._downstream.validation(role, instance_id, ok)


class LeaderQueueController:
    """Consumes a role's leader queue only while this worker leads the role.

    Promotions and demotions happen on the elector's threads, but a kombu
    consumer may only be touched from the worker's consumer thread. So
    changes are *requested* from any thread (``consumer.call_soon``, which
    wakes the event loop) and *applied* by :meth:`reconcile` on the consumer
    thread, which compares what should be consumed with what is.

    Args:
        app: The Celery app.
        queue_names: Leader queue of each role.
        is_leader: Whether this worker leads a role now.

    """

    def __init__(
        self, app: Any, queue_names: Mapping[str, str], is_leader: Callable[[str], bool]
    ) -> None:
        self._app = app
        self._queue_names = dict(queue_names)
        self._is_leader = is_leader
        self._consumer: Any = None
        self._consuming: frozenset[str] = frozenset()
        self._closed = False

    def attach(self, consumer: Any) -> None:
        """Start managing ``consumer`` (a Celery worker consumer); consumer thread."""
        self._consumer = consumer
        self._consuming = frozenset()
        # Applied by the event loop, once the task consumer is consuming.
        self.request_reconcile()

    def detach(self, consumer: Any) -> None:
        """Stop managing ``consumer`` (it is stopping or reconnecting)."""
        if self._consumer is consumer:
            self._consumer = None
            self._consuming = frozenset()

    def close(self) -> None:
        """Shutting down: never start consuming a leader queue again."""
        self._closed = True

    def request_reconcile(self) -> None:
        """Ask the consumer thread to reconcile soon; callable from any thread."""
        consumer = self._consumer
        if consumer is not None:
            consumer.call_soon(self.reconcile)

    def needs_reconcile(self) -> bool:
        """Whether what is consumed differs from what should be (a hint, any thread)."""
        if self._consumer is None:
            return False
        consuming = self._consuming
        return any(
            (self._is_leader(role) and not self._closed) != (queue in consuming)
            for role, queue in self._queue_names.items()
        )

    def reconcile(self) -> None:
        """Start or stop consuming leader queues to match leadership; consumer thread."""
        consumer = self._consumer
        task_consumer = getattr(consumer, "task_consumer", None)
        if task_consumer is None:
            return
        consuming: set[str] = set()
        added = False
        for role, name in self._queue_names.items():
            want = self._is_leader(role) and not self._closed
            try:
                have = task_consumer.consuming_from(name)
                if want and not have:
                    # Not through Consumer.add_task_queue: that would also
                    # add the queue to the worker's standing selection, and
                    # after a reconnect the worker would consume it again
                    # whether it leads or not.
                    task_consumer.add_queue(self._app.amqp.queues[name])
                    task_consumer.consume()
                    added = True
                    logger.info("nats-leader: started consuming %s (leader of %r)", name, role)
                elif have and not want:
                    task_consumer.cancel_by_queue(name)
                    logger.info("nats-leader: stopped consuming %s (not leader of %r)", name, role)
            except Exception:
                # Left for the next reconcile: the service asks again while
                # what is consumed differs from what should be.
                logger.exception("nats-leader: could not update the consumer of %s", name)
            try:
                if task_consumer.consuming_from(name):
                    consuming.add(name)
            except Exception:  # pragma: no cover - the consumer is gone
                continue
        self._consuming = frozenset(consuming)
        if added:
            # Redis: a BRPOP already waiting on the old queues would read the
            # leader queue only after its timeout (~1 s); end it now.
            wake_consumer(task_consumer)
