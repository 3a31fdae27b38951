"""Fast tests of the Celery layer that need no worker, broker or NATS server."""

from __future__ import annotations

import inspect
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_nats_leader import LeaderTask, install, leader_only
from celery_nats_leader.core.errors import ConfigError
from celery_nats_leader.worker import shared_leadership
from celery_nats_leader.worker.shared_leadership import SharedLeadership
from celery_nats_leader.worker.tasks import leader_options, upgrade_tasks


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("units", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        nats_leader_roles=["alpha", "beta"],
        nats_leader_queue_prefix="lq.",
        # A route of the user's own: it wins over the leader router.
        task_routes={"units.routed_by_hand": {"queue": "elsewhere"}},
    )
    install(app)
    yield app
    app.close()


def queue_of(app: Celery, task: Any, **options: Any) -> str:
    route = app.amqp.router.route(options, task.name, (), {}, task)
    return str(route["queue"].name)


def test_routing_and_delivery_settings(app: Celery) -> None:
    @app.task(shared=False)
    @leader_only
    def bare() -> None: ...

    @app.task(shared=False)
    @leader_only(role="beta", validate=True, on_follower="skip")
    def with_args() -> None: ...

    @app.task(shared=False, base=LeaderTask, leader_role="beta")
    def class_based() -> None: ...

    @app.task(shared=False, name="units.routed_by_hand")
    @leader_only(role="beta")
    def routed_by_hand() -> None: ...

    @app.task(shared=False)
    def ordinary() -> None: ...

    app.finalize()
    # The role defaults to the first configured one; the queue follows the prefix.
    assert queue_of(app, bare) == "lq.alpha"
    assert queue_of(app, with_args) == "lq.beta"
    assert queue_of(app, class_based) == "lq.beta"
    assert queue_of(app, routed_by_hand) == "elsewhere"
    assert queue_of(app, bare, queue="by-call") == "by-call"
    assert queue_of(app, ordinary) == app.conf.task_default_queue
    # The worker upgrades leader-only tasks to late acknowledgement.
    upgrade_tasks(app)
    for task in (bare, with_args, class_based, routed_by_hand):
        assert task.acks_late is True
        assert task.reject_on_worker_lost is True
    assert not ordinary.acks_late
    options = leader_options(with_args)
    assert options is not None
    assert (options.role, options.validate, options.on_follower) == ("beta", True, "skip")
    assert leader_options(ordinary) is None


def test_token_parameter_is_hidden_from_callers(app: Celery) -> None:
    @app.task(shared=False)
    @leader_only
    def job(x: int, leader_token: Any = None) -> int:
        return x

    assert "leader_token" not in inspect.signature(job.run).parameters
    # Direct and eager calls run the body without any check.
    assert job(3) == 3
    assert job.apply(args=(4,)).get() == 4


def test_eager_leader_task_runs_without_election(app: Celery) -> None:
    from celery_nats_leader.worker.tasks import EAGER_TOKEN

    seen: list[Any] = []

    @app.task(shared=False, bind=True, base=LeaderTask)
    def job(self: Any) -> str:
        seen.append(getattr(self.request, "leader_token", "unset"))
        return "ran"

    assert job.apply().get() == "ran"
    assert seen == [EAGER_TOKEN]
    assert EAGER_TOKEN.epoch == 0


def test_bad_decorator_use_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigError, match="on_follower='drop' is unknown"):
        leader_only(on_follower="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a valid role name"):
        leader_only(role="two words")

    @app.task(shared=False)
    def ordinary() -> None: ...

    with pytest.raises(TypeError, match=r"under @app\.task"):
        leader_only(ordinary)


def test_check_outside_a_worker_says_why() -> None:
    result = shared_leadership.check_leadership("alpha")
    assert not result.leading
    assert "bootstep" in result.reason


# ------------------------------------------------------------- shared slots


def test_shared_slots_round_trip() -> None:
    shared = SharedLeadership(("a", "b"))
    token = "0f0e5c52-2a4b-4cc1-9f4e-8a2a0c1d3e4f"
    deadline = time.monotonic() + 5
    shared.publish("b", 42, deadline, token)
    snap = shared.read("b")
    assert snap is not None and (snap.epoch, snap.deadline, snap.token) == (42, deadline, token)
    assert snap.token_at(time.monotonic()) is not None
    assert snap.token_at(deadline) is None  # the lease is over at the deadline
    empty = shared.read("a")
    assert empty is not None and empty.token_at(time.monotonic()) is None
    assert shared.read("unknown") is None
    shared.clear("b")
    cleared = shared.read("b")
    assert cleared is not None and cleared.token_at(time.monotonic()) is None


def test_shared_slots_never_trust_a_torn_read() -> None:
    shared = SharedLeadership(("a",))
    shared.publish("a", 7, time.monotonic() + 5, "tok")
    mm = shared._mm
    # A writer caught mid-write (odd sequence number): no answer, fail closed.
    seq = int.from_bytes(mm[0:8], "little")
    mm[0:8] = (seq | 1).to_bytes(8, "little")
    assert shared.read("a") is None
    mm[0:8] = (seq + 2).to_bytes(8, "little")
    assert shared.read("a") is not None
    # Bytes that do not match their checksum: no answer either.
    mm[8] ^= 0xFF
    assert shared.read("a") is None


def test_forked_child_reads_the_parents_slots() -> None:
    shared = SharedLeadership(("a",))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: wait for the parent's publish, report what it sees
        os.close(read_fd)
        deadline = time.monotonic() + 10
        seen = None
        while time.monotonic() < deadline:
            snap = shared.read("a")
            if snap is not None and snap.epoch:
                seen = [snap.epoch, snap.token]
                break
            time.sleep(0.001)
        os.write(write_fd, json.dumps(seen).encode())
        os._exit(0)
    os.close(write_fd)
    shared.publish("a", 9, time.monotonic() + 5, "from-parent")
    with os.fdopen(read_fd) as pipe:
        seen = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert seen == [9, "from-parent"]


def test_children_counting_at_once_lose_no_validation() -> None:
    # Pool children count their validations in the shared block, the parent
    # reports them as metrics. Unserialized, two children counting at once
    # lost about 3 increments in 4 here (and a metrics test waited forever).
    shared = SharedLeadership(("a",))
    per_child = 20_000
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            for i in range(per_child):
                shared.count_validation("a", ok=i % 10 != 0)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    assert shared.validation_counts("a") == (2 * per_child, 2 * per_child // 10)


def test_a_child_killed_while_counting_does_not_wedge_the_others() -> None:
    shared = SharedLeadership(("a",))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # take the counter lock and die holding it
        with shared._counters_locked(0):
            os.write(write_fd, b"locked")
            time.sleep(60)
        os._exit(0)
    assert os.read(read_fd, 6) == b"locked"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read_fd)
    os.close(write_fd)
    shared.count_validation("a", ok=True)  # the kernel released the dead child's lock
    assert shared.validation_counts("a") == (1, 0)


def test_unknown_settings_are_reported_with_the_closest_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from celery_nats_leader.config.settings import LeaderSettings, unknown_celery_settings

    app = Celery("typos", set_as_current=False)
    app.conf.update(nats_leader_rolse=["jobs"], nats_leader_ttl=4, broker_url="memory://")
    assert unknown_celery_settings(app.conf) == [
        "unknown setting 'nats_leader_rolse' is ignored; did you mean 'nats_leader_roles'?"
    ]
    with caplog.at_level("WARNING", logger="celery_nats_leader.config.settings"):
        settings = LeaderSettings.from_celery(app.conf)
    assert settings.roles == ("default",)  # the typo did not set the roles
    assert "did you mean 'nats_leader_roles'?" in caplog.text

    # Under Django's CELERY namespace, the names are the ones in settings.py;
    # Django's own NATS_LEADER dict is not a Celery setting.
    class DjangoSettings:
        CELERY_NATS_LEADER_HEARTBEAT_INTERVALL = 1
        CELERY_NATS_LEADER_TTL = 4
        NATS_LEADER = ("not", "a", "celery", "setting")

    django_app = Celery("typos-django", set_as_current=False)
    django_app.config_from_object(DjangoSettings, namespace="CELERY")
    assert unknown_celery_settings(django_app.conf) == [
        "unknown setting 'CELERY_NATS_LEADER_HEARTBEAT_INTERVALL' is ignored; "
        "did you mean 'CELERY_NATS_LEADER_HEARTBEAT_INTERVAL'?"
    ]
    app.close()
    django_app.close()


def test_setting_errors_name_the_setting_as_written() -> None:
    from celery_nats_leader.config.settings import LeaderSettings

    app = Celery("names", set_as_current=False)
    app.conf.update(nats_leader_roles=["bad role"])
    with pytest.raises(ConfigError, match=r"^nats_leader_roles='bad role' is not a valid role"):
        LeaderSettings.from_celery(app.conf)
    app.conf.update(nats_leader_roles=["jobs"], nats_leader_ttl=-1)
    with pytest.raises(ConfigError, match=r"nats_leader_ttl=-1 must be a non-negative"):
        LeaderSettings.from_celery(app.conf)

    class DjangoSettings:
        CELERY_NATS_LEADER_START_TIMEOUT = 0

    django_app = Celery("names-django", set_as_current=False)
    django_app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(ConfigError, match=r"^CELERY_NATS_LEADER_START_TIMEOUT=0 must be"):
        LeaderSettings.from_celery(django_app.conf)
    app.close()
    django_app.close()


def test_leader_services_by_decorator_and_by_name(app: Celery) -> None:
    from celery_nats_leader import leader_service
    from celery_nats_leader.worker.leader_services import registered_services

    @leader_service(app)
    def poll(ctx: Any) -> None: ...

    @leader_service(app, role="beta", grace=3.0)
    async def follow(ctx: Any) -> None: ...

    specs = registered_services(app, {"beta": ["os.path:join"]}, "alpha")
    assert [(s.function, s.role, s.grace) for s in specs] == [
        (poll, "alpha", None),  # no role: the first of nats_leader_roles
        (follow, "beta", 3.0),
        (os.path.join, "beta", None),
    ]
    with pytest.raises(ConfigError, match=r"nats_leader_services\['beta'\]: cannot import"):
        registered_services(app, {"beta": ["proj.nowhere:poll"]}, "alpha")
    with pytest.raises(ConfigError, match="must map roles to lists"):
        registered_services(app, ["proj.feeds:poll"], "alpha")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a valid role name"):
        leader_service(app, role="no spaces")


@pytest.mark.parametrize("ttl", [1.0, 3.0, 5.0, 10.0, 60.0])
def test_a_worker_stop_leaves_room_for_demote_callbacks_and_the_release(ttl: float) -> None:
    # The stop used to be bounded by min(10, max(2, ttl)): under a TTL of 5 s
    # or less that is no longer than demote_timeout (5 s), so a slow demote
    # receiver got the release cancelled, the key was not deleted and the
    # successor waited a whole TTL.
    from celery_nats_leader.config.settings import LeaderSettings

    settings = LeaderSettings(ttl=ttl, roles=("a", "b"), role_options={"b": {"demote_timeout": 7}})
    longest = max(
        settings.election_config(r).demote_timeout + settings.election_config(r).request_timeout
        for r in ("a", "b")
    )
    assert settings.release_bound(("a", "b")) == pytest.approx(longest + 1.0)
    assert settings.release_bound(("a", "b")) > 7.0
    assert settings.release_bound(("a",)) > settings.election_config("a").demote_timeout


# Forking with a second thread alive is the point (Python 3.12+ warns of it).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_a_parent_thread_counts_can_count() -> None:
    # The elector's thread counts every half heartbeat; a fork at that
    # instant copied the held thread lock into the child, where nothing
    # could release it: the child's first count (its first
    # @leader_only(validate=True) task) hung forever.
    import threading

    shared = SharedLeadership(("a",))
    holding, release = threading.Event(), threading.Event()

    def parent_thread_counting() -> None:
        with shared._counters_locked(0):
            holding.set()
            release.wait(10)

    counter = threading.Thread(target=parent_thread_counting)
    counter.start()
    assert holding.wait(10)
    pid = os.fork()
    if pid == 0:  # child: count once; exit 0 if that returned within 5 s
        signal.alarm(5)
        shared.count_validation("a", ok=True)
        os._exit(0)
    release.set()
    counter.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the child's count hung (status {status:#x})"
    )


def test_the_readme_task_runs_under_task_always_eager(caplog: pytest.LogCaptureFixture) -> None:
    # The README's quickstart task, in development mode (task_always_eager,
    # the default of common project templates): it used to fail with
    # "'NoneType' object has no attribute 'epoch'".
    from celery_nats_leader.worker import tasks as leader_tasks

    app = Celery("eager", set_as_current=False)
    app.conf.update(task_always_eager=True, nats_leader_roles=["reports"])
    install(app)
    printed: list[str] = []

    @app.task(bind=True)
    @leader_only(role="reports")
    def nightly_report(self: Any, day: str = "yesterday", leader_token: Any = None) -> str:
        printed.append(f"report for {day} under epoch {leader_token.epoch}")
        return str(self.request.leader_token.epoch)

    class Weekly(LeaderTask):
        leader_role = "reports"

    @app.task(bind=True, base=Weekly)
    def weekly_report(self: Any, leader_token: Any = None) -> int:
        return int(leader_token.epoch)

    caplog.set_level("WARNING", logger="celery_nats_leader.worker.tasks")
    leader_tasks._eager_warned = False
    assert nightly_report.delay("2026-11-23").get() == "0"
    assert printed == ["report for 2026-11-23 under epoch 0"]
    assert weekly_report.apply().get() == 0
    warned = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(warned) == 1, warned  # once per process
    # A direct call is a plain function call: no token unless given.
    with pytest.raises(AttributeError, match="epoch"):
        nightly_report("2026-11-24")


def test_an_eager_leader_only_task_under_a_base_with_its_own_call_gets_the_token() -> None:
    # OnceTask's __call__ calls super().__call__: before Celery 5.4 that
    # pushes a fresh request (not eager) over the eager tracer's one.
    from celery_nats_leader import OnceTask
    from celery_nats_leader.worker.tasks import EAGER_TOKEN

    app = Celery("eager-once", set_as_current=False)
    app.conf.update(task_always_eager=True, nats_leader_roles=["reports"])
    install(app)

    @app.task(bind=True, base=OnceTask)
    @leader_only(role="reports")
    def job(self: Any, leader_token: Any = None) -> int:
        assert leader_token is EAGER_TOKEN
        return int(leader_token.epoch)

    assert job.delay().get() == 0
