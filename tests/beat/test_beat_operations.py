"""What an operator sees from beat: start-up logs, a role held by the wrong process, metrics.

The leader scheduler runs in the test process against a real nats-server;
schedules run on a manual clock so a tick is due exactly when the test says.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import schedule

from celery_nats_leader.beat import LeaderScheduler
from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError
from celery_nats_leader.election.elector import Elector
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.worker.election import WorkerElection

pytestmark = [pytest.mark.integration]

UTC = timezone.utc
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
NOW = [T0]


def manual_now() -> datetime:
    """The ``nowfun`` of the test schedules (a module function: shelve pickles it)."""
    return NOW[0]


class Recording(LeaderScheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[str] = []
        super().__init__(*args, **kwargs)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw: Any) -> Any:
        self.sent.append(entry.name)
        return None

    @property
    def producer(self) -> Any:
        return None


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    with NatsServer() as running:
        yield running


@pytest.fixture
def bucket() -> str:
    return f"ops{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make(server: NatsServer, bucket: str, tmp_path: Path) -> Iterator[Callable[..., Recording]]:
    made: list[Recording] = []

    def factory(**conf: Any) -> Recording:
        NOW[0] = T0
        app = Celery(f"ops-{len(made)}", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            result_expires=None,
            timezone="UTC",
            beat_schedule={
                "every-ten": {
                    "task": "ops.ten",
                    "schedule": schedule(timedelta(seconds=10), nowfun=manual_now),
                }
            },
            **{
                "nats_leader_servers": server.url,
                "nats_leader_bucket": bucket,
                "nats_leader_create_bucket": True,
                "nats_leader_ttl": 2.0,
                "nats_leader_beat_follower_interval": 0.05,
                "nats_leader_instance_id": f"ops-{len(made)}-{uuid.uuid4().hex[:4]}",
                **conf,
            },
        )
        scheduler = Recording(
            app=app, schedule_filename=str(tmp_path / f"s{len(made)}"), max_interval=1
        )
        made.append(scheduler)
        return scheduler

    yield factory
    for scheduler in made:
        scheduler.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("celery_nats_leader")
    ]


# ------------------------------------------------------ issue 10 #6


def test_no_connection_warning_when_nats_is_up(
    make: Callable[..., Recording], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_nats_leader")
    # Not required (the default): start() returns before the connection completes.
    scheduler = make(nats_leader_required=False)
    handle = scheduler.beat_role
    assert handle is not None and handle.wait_for_leadership(10)
    for _ in range(3):
        scheduler.tick()
    assert warnings_of(caplog) == []
    assert scheduler.is_leader


def test_an_overdue_connection_is_reported_once(
    make: Callable[..., Recording], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_nats_leader")
    scheduler = make(
        nats_leader_required=False,
        nats_leader_servers="nats://127.0.0.1:1",
        nats_leader_start_timeout=0.3,
    )

    def beat_warnings() -> list[str]:
        return [m for m in warnings_of(caplog) if m.startswith("nats-leader beat")]

    # Within start_timeout a follower says nothing; after it, once.
    assert scheduler.tick() == 0.0
    assert beat_warnings() == []
    for _ in range(200):
        scheduler.tick()  # each waits beat_follower_interval (0.05 s)
        if beat_warnings():
            break
    [warning] = beat_warnings()
    assert "still not connected to NATS" in warning
    for _ in range(5):
        scheduler.tick()
    assert len(beat_warnings()) == 1


# ------------------------------------------------------ issue 10 #7


def test_a_worker_refuses_the_beat_role_among_its_roles() -> None:
    app = Celery("roles", set_as_current=False)
    settings = LeaderSettings(roles=("default", "beat"))
    with pytest.raises(ConfigError, match="contains the beat role 'beat'"):
        WorkerElection(app, settings)
    renamed = LeaderSettings(roles=("default", "beat"), beat_role="scheduler")
    # A role named "beat" is fine when beat uses another.
    WorkerElection(app, renamed).stop()


def test_a_celery_worker_with_the_beat_role_does_not_start(tmp_path: Path) -> None:
    (tmp_path / "wrong_roles.py").write_text(
        "import celery_nats_leader\n"
        "from celery import Celery\n"
        "app = Celery('wrong_roles', broker='memory://')\n"
        "app.conf.nats_leader_roles = ['default', 'beat']\n"
        "celery_nats_leader.install(app)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "wrong_roles", "worker", "--pool", "solo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "nats_leader_roles ['default', 'beat'] contains the beat role 'beat'" in done.stderr


def test_a_replica_says_when_a_non_scheduler_holds_the_beat_role(
    make: Callable[..., Recording],
    server: NatsServer,
    bucket: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Something that is not a scheduler (a worker's meta) took the beat role first.
    squatter = Elector(server.url)
    handle = squatter.add_role(
        ElectionConfig(
            role="beat",
            bucket=bucket,
            ttl=2.0,
            create_bucket=True,
            instance_id="worker-1",
            meta={"hostname": "web-1", "pid": 42, "worker": "celery@web-1"},
        )
    )
    squatter.start(timeout=10)
    try:
        assert handle.wait_for_leadership(10)
        caplog.set_level(logging.WARNING, logger="celery_nats_leader")
        scheduler = make(nats_leader_required=True)
        for _ in range(5):
            scheduler.tick()
        errors = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.ERROR and "not a beat scheduler" in r.getMessage()
        ]
        assert len(errors) == 1, errors  # said once (every 30 s), not on every tick
        assert "worker-1" in errors[0] and "nats_leader_roles" in errors[0]
        assert scheduler.sent == []
    finally:
        squatter.stop()


# ------------------------------------------------------ issue 10 #8


@pytest.mark.parametrize("namespace", [None, "billing_leader"])
def test_beat_serves_election_and_tick_metrics(
    make: Callable[..., Recording], bucket: str, namespace: str | None
) -> None:
    conf = {} if namespace is None else {"nats_leader_metrics_namespace": namespace}
    scheduler = make(nats_leader_required=True, nats_leader_metrics_port=0, **conf)
    handle = scheduler.beat_role
    assert handle is not None and handle.wait_for_leadership(10)
    scheduler.tick()  # anchors the entry
    for _ in range(3):
        NOW[0] += timedelta(seconds=10)
        while scheduler.tick() == 0.0:
            pass
    assert scheduler.sent == ["every-ten"] * 3
    port = scheduler.nats_leader_metrics_port
    assert port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    prefix = namespace or "nats_leader"
    instance = scheduler.instance_id
    # instance_id, not instance: Prometheus's own target label.
    labels = f'bucket="{bucket}",instance_id="{instance}",role="beat"'
    assert f"{prefix}_is_leader{{{labels}}} 1.0" in text
    assert (
        f'{prefix}_beat_ticks_total{{entry="every-ten",instance_id="{instance}",'
        f'outcome="dispatched",role="beat"}} 3.0'
    ) in text
    assert "instance=" not in text


def test_an_embedded_beat_leaves_the_metrics_port_to_its_worker(
    make: Callable[..., Recording],
) -> None:
    # celery worker -B runs beat in a process (or thread) named "Beat"; the worker
    # serves nats_leader_metrics_port, so the embedded beat must not take it.
    ports: list[int | None] = []

    def embedded_beat() -> None:
        scheduler = make(nats_leader_required=True, nats_leader_metrics_port=0)
        ports.append(scheduler.nats_leader_metrics_port)
        # Closed by the thread that opened it, as Celery's embedded beat does:
        # on Python 3.13 beat's shelve is dbm.sqlite3, whose connection
        # refuses to be closed from another thread.
        scheduler.close()

    thread = threading.Thread(target=embedded_beat, name="Beat")
    thread.start()
    thread.join(30)
    assert ports == [None]
