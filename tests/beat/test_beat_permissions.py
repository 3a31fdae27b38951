"""A ``celery worker -B`` running once-guarded tasks as the least-privilege ``worker`` user.

The nats-server runs with ``deploy/nats/permissions.conf`` as shipped (the
file the docs tell operators to include). An operator creates the buckets
with the documented commands; then one worker process with its embedded beat
(``-B``) and ``@run_once`` ticks, connected as ``worker``, elects itself
beat, keeps the schedule's state and runs every tick once through the
once-guard's two buckets, without a single permission refusal.

The harness's own observers (the KV recorder, the bucket set-up) connect
without credentials; the server maps them to the ``admin`` user
(``no_auth_user``), so that only the worker is confined.
"""

from __future__ import annotations

import collections
import logging
import re
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_app import make_app
from cnl_beat_harness import CELERY, HERE, BeatCluster, wait_for

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.ops.bucket import bucket_targets, set_up_buckets
from celery_nats_leader.ops.oneshot import with_backend
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.testing.ports import free_port
from celery_nats_leader.worker.once_check import OnceGuardCheck
from tests.support import REPO
from tests.support.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(180)]

PERMISSIONS = REPO / "deploy" / "nats" / "permissions.conf"
PASSWORDS = {
    "worker": "w-pw-2",
    "beat": "b-pw-2",
    "web": "web-pw-2",
    "viewer": "v-pw-2",
    "admin": "a-pw-2",
}
WORKER = {"user": "worker", "password": PASSWORDS["worker"]}
TICKS = 6


@pytest.fixture
def nats_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NatsServer]:
    """A server with the documented users (passwords from its environment)."""
    conf = tmp_path / "nats"
    conf.mkdir()
    shutil.copy(PERMISSIONS, conf / "permissions.conf")
    for user, password in PASSWORDS.items():
        monkeypatch.setenv(f"{user.upper()}_PASSWORD", password)
    (conf / "server.conf").write_text("include ./permissions.conf\nno_auth_user: admin\n")
    with NatsServer(extra_args=["-c", str(conf / "server.conf")]) as server:
        yield server


def _operator(cluster: BeatCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery nats-leader ...`` as the operator (no credentials: the admin user)."""
    extra = {k: v for k, v in EXTRA.items() if k != "connect_options"}
    return cluster.operator(*args, config=dict(cluster.config, extra=extra))


EXTRA: dict[str, Any] = {"connect_options": WORKER, "once_lease": 2.0, "once_retention": 600.0}


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_worker_with_embedded_beat_and_run_once_as_the_worker_user(
    cluster_factory: Callable[..., BeatCluster], broker: Any, tmp_path: Path
) -> None:
    cluster = cluster_factory(
        entries=[
            {"kind": "interval", "name": "every-second", "seconds": 1, "task": "cnl_beat.run_once"}
        ],
        extra=EXTRA,
    )
    # The operator's steps (docs/production.md): the once-guard's buckets
    # (the harness created the election and beat state buckets the same way).
    created = _operator(cluster, "bucket", "--create", "--once")
    assert created.returncode == 0, created.stdout + created.stderr
    assert "once-guard lease bucket 'leaders_once_leases' created" in created.stdout, created.stdout
    checked = _operator(cluster, "bucket", "--beat-state")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    worker = Proc(
        "worker-B",
        [CELERY, "-A", "cnl_beat_app", "worker", "-B", "--scheduler", "nats_leader",
         "-s", str(tmp_path / "schedule"), "-P", "threads", "-c", "4", "-Q", cluster.queue,
         "-n", f"wb-{cluster.queue}@%h", "-l", "INFO"],
        env=cluster.env,
        log_path=tmp_path / "worker-B.log",
        cwd=HERE,
    )  # fmt: skip
    cluster.embedded.append(worker)  # stopped (and its log shown) by the harness
    record = cluster.wait_leader()
    # The embedded beat is a child process of the worker.
    assert cluster.beat_by_pid(int(record.meta["pid"])) is worker

    # Duplicates of one run_once task (a producer's retry): one run.
    app = make_app(cluster.config)
    task_id = str(uuid.uuid4())
    for _ in range(3):
        app.send_task("cnl_beat.run_once", task_id=task_id, queue=cluster.queue)

    def done() -> bool:
        ticks = [r for r in cluster.runs("every-second")]
        return len(ticks) >= TICKS and "already ran (on " in worker.log()

    wait_for(done, 60, f"{TICKS} ticks run and a duplicate refused", cluster.diagnostics)
    runs = collections.Counter(r.tick for r in cluster.runs("every-second"))
    assert all(count == 1 for count in runs.values()), runs
    direct = [r for r in cluster.ledger.runs("cnl_beat.run_once") if r.task_id == task_id]
    assert len(direct) == 1, direct
    log = worker.log()
    assert "permissions violation" not in log.lower(), log[-4000:]
    assert "PermissionDenied" not in log, log[-4000:]


BEAT = {"user": "beat", "password": PASSWORDS["beat"]}
#: What a worker says at start-up when it cannot use the once-guard's buckets.
UNUSABLE = "the once-guard cannot use its buckets 'leaders_once_leases' and 'leaders_once'"


def _once_guard_ready(port: int) -> float | None:
    """The worker's ``nats_leader_once_guard_ready`` as served on its metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(r'^nats_leader_once_guard_ready\{bucket="leaders_once",[^}]*\} (\S+)$',
                      text, re.MULTILINE)  # fmt: skip
    return float(found.group(1)) if found else None


def _upgrade_cluster(
    cluster_factory: Callable[..., BeatCluster], worker_extra: dict[str, Any]
) -> BeatCluster:
    """A leader-scheduler deployment whose once-guard buckets were never created.

    The election and beat state buckets exist (an earlier version's
    operator made them); the beat replica connects as ``beat``. Workers
    started afterwards connect as ``worker``, with ``worker_extra``.
    """
    cluster = cluster_factory(
        entries=[{"kind": "interval", "name": "plain", "seconds": 1, "task": "cnl_beat.plain"}],
        extra={**EXTRA, "connect_options": BEAT},
    )
    cluster.config["bootstep"] = True
    # As the migration guide has it: the app names the leader scheduler.
    cluster.config["celery"] = {"beat_scheduler": "nats_leader"}
    cluster.start_beat()
    cluster.wait_leader()
    cluster.config["extra"].update(connect_options=WORKER, **worker_extra)
    return cluster


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_worker_user_without_the_once_buckets_is_told_at_start_and_the_operator_create_heals_it(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    port = free_port()
    cluster = _upgrade_cluster(cluster_factory, {"required": False, "metrics_port": port})
    worker = cluster.start_worker()
    wait_for(lambda: UNUSABLE in worker.log(), 30, "the start-up ERROR", cluster.diagnostics)
    line = next(x for x in worker.log().splitlines() if UNUSABLE in x)
    assert "ERROR" in line and "nats-leader bucket --create" in line, line
    assert _once_guard_ready(port) == 0.0
    # Ticks reach the worker and are kept (retried), none runs unguarded.
    wait_for(lambda: "cannot claim its id" in worker.log(), 30, "a tick kept", cluster.diagnostics)
    assert cluster.runs("plain") == []

    # The operator's one command (docs/production.md) now makes them too.
    created = _operator(cluster, "bucket", "--create")
    assert created.returncode == 0, created.stdout + created.stderr
    assert "once-guard lease bucket 'leaders_once_leases' created" in created.stdout, created.stdout
    assert "once-guard done bucket 'leaders_once' created" in created.stdout, created.stdout

    # Without a restart: the kept ticks and the new ones run, each once.
    wait_for(lambda: len(cluster.runs("plain")) >= 5, 60, "ticks running", cluster.diagnostics)
    runs = collections.Counter(r.tick for r in cluster.runs("plain"))
    assert all(count == 1 for count in runs.values()), runs
    assert worker.alive


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_required_worker_without_the_once_buckets_refuses_to_start(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = _upgrade_cluster(cluster_factory, {"required": True})
    worker = cluster.start_worker()
    assert worker.wait(60) == 69, worker.log()[-3000:]
    log = worker.log()
    assert UNUSABLE in log, log[-3000:]
    assert "nats_leader_beat_once = False" in log


def test_the_once_guard_check_says_unusable_until_an_operator_creates_the_buckets(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_nats_leader.worker.once_check")
    settings = LeaderSettings(servers=(nats_server.url,), connect_options=WORKER)
    reports: list[bool] = []
    check = OnceGuardCheck(settings, app_name="proj", report=reports.append, repeat=0.5)
    check.start()
    try:
        wait_for(lambda: reports, 60, "the first conclusive check")
        assert reports == [False]
        assert check.problem is not None and "NATS refused creating KV bucket" in check.problem
        errors = [r for r in caplog.records if r.levelname == "ERROR" and UNUSABLE in r.message]
        assert len(errors) == 1
        # What `nats-leader bucket --create --once` does, as the admin user
        # (no credentials here).
        admin = LeaderSettings(servers=(nats_server.url,))
        outcomes, _floor = with_backend(
            admin,
            lambda backend: set_up_buckets(
                backend, bucket_targets(admin, once=True), "create", timeout=5.0
            ),
            timeout=10.0,
            name="test operator",
        )
        assert [o.problems for o in outcomes] == [[], []]
        wait_for(lambda: reports[-1], 60, "the check to find the buckets usable")
        assert check.problem is None
        assert "usable again" in caplog.text
    finally:
        check.stop()
