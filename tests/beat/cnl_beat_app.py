"""The Celery app of the beat tests (``celery -A cnl_beat_app beat|worker``).

Configured by the JSON in ``$CNL_BEAT_CONFIG`` (see ``conftest.BeatCluster``).
Entries (``config["entries"]``):

* ``interval``: ``schedule(timedelta(seconds=...))``;
* ``cron``: a real ``crontab(minute="*")`` (one tick per wall-clock minute);
* ``fastcron``: a real ``crontab(minute="*")`` whose clock runs ``speed``
  times faster than the wall clock (``nowfun``, the hook Celery schedules
  offer for this), from ``config["t0"]`` on: with ``speed=60`` every
  schedule minute lasts one real second, so the crontab's slot arithmetic is
  exercised once a second. All processes use the same ``t0``, so they agree
  on the schedule clock as they agree on the wall clock.

With ``config["django"]`` the app sets Django up (``cnl_beat_django``
settings) and the entries live in django-celery-beat's tables instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.exceptions import Ignore
from celery.schedules import crontab, schedule
from cnl_beat_ledger import BeatLedger

from celery_nats_leader import install
from celery_nats_leader.beat import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    EPOCH_HEADER,
    RUN_HEADER,
    TICK_HEADER,
    FencedBeatTask,
    check_dispatch_token,
)
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.testing import kombu_fs
from celery_nats_leader.worker.once_tasks import OnceTask, run_once
from celery_nats_leader.worker.refused import NotRun

# kombu's filesystem transport writes a message file non-atomically: a polling
# consumer can read it empty and die. Tests use the atomic variant.
kombu_fs.register()

CONFIG: dict[str, Any] = json.loads(os.environ.get("CNL_BEAT_CONFIG", "{}"))
#: The schedule clock of fastcron entries (set by make_app).
_FAST: dict[str, float] = {"t0": 0.0, "speed": 60.0}


def fast_now() -> datetime:
    """The schedule clock of ``fastcron`` entries: ``speed`` x the wall clock since ``t0``."""
    import time

    t0 = float(_FAST["t0"])
    speed = float(_FAST["speed"])
    return datetime.fromtimestamp(t0 + (time.time() - t0) * speed, tz=timezone.utc)


class FastCron(crontab):  # type: ignore[misc]
    """Celery's crontab on the fast clock, keeping it through every shelve round trip.

    (Before Celery 5.7 an unpickled crontab forgets its keyword arguments, so
    the second round trip through beat's shelve drops ``nowfun``.)
    """

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._orig_kwargs = dict(state)


def beat_schedule(entries: list[dict[str, Any]], task: str, queue: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for spec in entries:
        kind = spec["kind"]
        if kind == "interval":
            sched: Any = schedule(timedelta(seconds=spec["seconds"]))
        elif kind == "cron":
            sched = crontab(minute="*")
        elif kind == "fastcron":
            sched = FastCron(minute="*", nowfun=fast_now)
        else:  # pragma: no cover
            raise ValueError(kind)
        found[spec["name"]] = {
            "task": spec.get("task", task),
            "args": spec.get("args", ()),
            "schedule": sched,
            "options": {"queue": queue, **spec.get("options", {})},
        }
    return found


def _headers(request: Any) -> dict[str, Any]:
    found = dict(request.headers or {}) if isinstance(request.headers, dict) else {}
    for name in (EPOCH_HEADER, ENTRY_HEADER, TICK_HEADER, RUN_HEADER, DISPATCHER_HEADER):
        if name not in found and getattr(request, name, None) is not None:
            found[name] = getattr(request, name)
    return found


def _record(ledger: BeatLedger, task: Any) -> None:
    headers = _headers(task.request)
    epoch = headers.get(EPOCH_HEADER)
    ledger.run(
        task=task.name,
        task_id=task.request.id,
        entry=headers.get(ENTRY_HEADER),
        tick=headers.get(TICK_HEADER),
        epoch=int(epoch) if epoch is not None else None,
        dispatcher=headers.get(DISPATCHER_HEADER),
        run=headers.get(RUN_HEADER),
    )


def _stop_here(folder: str, point: str) -> None:
    """Stop this process (SIGSTOP) if the test asked for a stop at ``point``.

    The test creates the file ``<folder>/<point>``; the first process to
    reach the point claims it by renaming it to ``<point>.<pid>`` (atomic, so
    one process stops per request) and stops itself there, for the test to
    SIGKILL it: a crash at exactly that point of the dispatch.
    """
    try:
        os.rename(os.path.join(folder, point), os.path.join(folder, f"{point}.{os.getpid()}"))
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGSTOP)


def install_kill_points(folder: str) -> None:
    """Points of the dispatch where a ``celery beat`` process can be stopped and killed.

    ``before_commit`` (the token is confirmed, the tick not committed yet),
    ``before_publish`` (committed, not sent: Celery's ``before_task_publish``),
    ``after_publish`` (sent, the send not recorded yet: ``after_task_publish``)
    and ``after_record`` (the send is recorded).
    """
    from celery.signals import after_task_publish, before_task_publish

    from celery_nats_leader.beat.schedule_store import ScheduleStateStore

    def before(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if headers and headers.get(TICK_HEADER):
            _stop_here(folder, "before_publish")

    def after(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if headers and headers.get(TICK_HEADER):
            _stop_here(folder, "after_publish")

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    update = ScheduleStateStore.update

    def patched(self: ScheduleStateStore, state: Any, *, last: int) -> Any:
        if state.pending:
            _stop_here(folder, "before_commit")
        written = update(self, state, last=last)
        if not state.pending:
            _stop_here(folder, "after_record")
        return written

    ScheduleStateStore.update = patched  # type: ignore[method-assign]


def make_app(config: dict[str, Any]) -> Celery:
    _FAST.update(t0=config.get("t0", 0.0), speed=config.get("speed", 60))
    if config.get("django"):
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cnl_beat_django")
        import django

        django.setup()
    app = Celery("cnl_beat", set_as_current=True)
    conf: dict[str, Any] = dict(
        broker_url=config["broker_url"],
        broker_transport_options=config.get("broker_transport_options", {}),
        broker_connection_retry_on_startup=True,
        task_default_queue=config["queue"],
        task_ignore_result=True,
        result_backend=None,
        result_expires=None,
        timezone="UTC",
        enable_utc=True,
        worker_prefetch_multiplier=1,
        # Remote control only where a harness inspects the worker (the soak
        # drains it: nothing queued, running, reserved or scheduled).
        worker_enable_remote_control=bool(config.get("remote_control", False)),
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        beat_max_loop_interval=config.get("max_interval", 0.2),
        beat_enable_remote_control=False,
        nats_leader_servers=config["nats_url"],
        nats_leader_bucket=config["bucket"],
        nats_leader_beat_role=config.get("beat_role", "beat"),
        nats_leader_ttl=config["ttl"],
        nats_leader_required=True,
        nats_leader_start_timeout=30.0,
    )
    # A test's own settings win (nats_leader_required=False, ...).
    conf.update({f"nats_leader_{k}": v for k, v in config.get("extra", {}).items()})
    # Plain Celery settings of a test (another scheduler's: redbeat_*).
    conf.update(config.get("celery", {}))
    app.conf.update(conf)
    if any(spec["kind"] == "fastcron" for spec in config.get("entries", [])) and (
        "beat_catch_up_window" not in config.get("extra", {})
    ):
        # The catch-up window is measured on the schedule's clock: a failover
        # of a few wall-clock seconds lasts ``speed`` times longer on a
        # fastcron's. The default window, on that clock.
        default = LeaderSettings(ttl=config["ttl"]).catch_up_window()
        app.conf.nats_leader_beat_catch_up_window = default * float(config.get("speed", 60))
    if not config.get("django"):
        app.conf.beat_schedule = beat_schedule(
            config.get("entries", []), "cnl_beat.record", config["queue"]
        )
    ledger = BeatLedger(config["ledger"])
    if config.get("bootstep"):
        # The worker runs the election bootstep (campaigning for the
        # "default" role), which also runs every beat tick once.
        install(app)
    if config.get("kill_points") and "beat" in sys.argv:
        install_kill_points(config["kill_points"])

    # Tasks are not shared (shared=False): tests build several apps in one
    # process, and a shared task would be registered again on every later
    # app (Celery then warns of a duplicate task name).
    # The beat tests' tasks use the once-guard, as the documentation
    # recommends: the outbox sends a tick again when a scheduler died after
    # sending it and before recording the send.
    @app.task(shared=False, bind=True, base=OnceTask, name="cnl_beat.record")
    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        _record(ledger, self)

    @app.task(shared=False, bind=True, name="cnl_beat.plain")
    def plain(self: Any, *args: Any, **kwargs: Any) -> None:
        _record(ledger, self)

    class RecordingFencedTask(FencedBeatTask, OnceTask):  # type: ignore[misc]
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            try:
                super().before_start(task_id, args, kwargs)
            except Ignore:
                headers = _headers(self.request)
                verdict = check_dispatch_token(self.request, self.app)
                ledger.refusal(
                    task=self.name,
                    task_id=task_id,
                    entry=headers.get(ENTRY_HEADER),
                    tick=headers.get(TICK_HEADER),
                    token=headers.get(EPOCH_HEADER),
                    reason=verdict.reason,
                )
                raise

    @app.task(shared=False, bind=True, base=RecordingFencedTask, name="cnl_beat.fenced")
    def fenced(self: Any, *args: Any, **kwargs: Any) -> None:
        _record(ledger, self)

    @app.task(shared=False, bind=True, base=RecordingFencedTask, name="cnl_beat.slow")
    def slow(self: Any, seconds: float) -> None:
        # Work that outlasts the tick's period: a run is under way whenever
        # something happens to NATS. Recorded once it is done.
        time.sleep(seconds)
        _record(ledger, self)

    @app.task(shared=False, bind=True, base=OnceTask, name="cnl_beat.once")
    def once(self: Any, *args: Any, **kwargs: Any) -> None:
        _record(ledger, self)

    # The decorator form of the guard, as the documentation shows it.
    @app.task(shared=False, bind=True, name="cnl_beat.run_once")
    @run_once
    def run_once_task(self: Any, *args: Any, **kwargs: Any) -> None:
        _record(ledger, self)

    @app.task(
        shared=False,
        bind=True,
        base=OnceTask,
        name="cnl_beat.once_hold",
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def once_hold(self: Any, hold: str) -> None:
        # Records its start, holds while the file ``hold`` exists (the test
        # kills the process meanwhile), then records its end.
        ledger.run(task="once_hold:start", task_id=self.request.id)
        while os.path.exists(hold):
            time.sleep(0.02)
        ledger.run(task="once_hold:end", task_id=self.request.id)

    @app.task(
        shared=False,
        bind=True,
        name="cnl_beat.plain_hold",
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def plain_hold(self: Any, hold: str) -> None:
        ledger.run(task="plain_hold:start", task_id=self.request.id)
        while os.path.exists(hold):
            time.sleep(0.02)
        ledger.run(task="plain_hold:end", task_id=self.request.id)

    @app.task(shared=False, bind=True, base=OnceTask, name="cnl_beat.once_forward")
    def once_forward(self: Any, forwarded: bool = False) -> None:
        # Hands its message on under the same id and lets this copy go
        # (NotRun), as @leader_only's forward does.
        if not forwarded:
            ledger.run(task="once_forward:handed-on", task_id=self.request.id)
            self.apply_async(kwargs={"forwarded": True}, task_id=self.request.id)
            raise NotRun()
        ledger.run(task="once_forward:ran", task_id=self.request.id)

    # Plain tasks, run once as beat ticks (the once header) by the bootstep.
    @app.task(shared=False, bind=True, name="cnl_beat.tick_replace")
    def tick_replace(self: Any, queue: str) -> None:
        # Celery's Task.replace: sends the replacement under this id, then
        # raises Ignore. The replacement is an OnceTask.
        _record(ledger, self)
        raise self.replace(once.s().set(queue=queue))

    @app.task(shared=False, bind=True, name="cnl_beat.tick_ignore")
    def tick_ignore(self: Any) -> None:
        # Celery's documented "handle it yourself, then raise Ignore".
        _record(ledger, self)
        raise Ignore()

    app.cnl_ledger = ledger  # type: ignore[attr-defined]
    return app


if CONFIG:
    app = make_app(CONFIG)
