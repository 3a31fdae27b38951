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
import json
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_app import make_app
from cnl_beat_harness import CELERY, HERE, BeatCluster, wait_for

from celery_nats_leader.testing import NatsServer
from tests.support import REPO
from tests.support.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(180)]

PERMISSIONS = REPO / "deploy" / "nats" / "permissions.conf"
PASSWORDS = {"worker": "w-pw-2", "beat": "b-pw-2", "viewer": "v-pw-2", "admin": "a-pw-2"}
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
    config = dict(cluster.config, extra={k: v for k, v in EXTRA.items() if k != "connect_options"})
    env = dict(cluster.env, CNL_BEAT_CONFIG=json.dumps(config))
    return subprocess.run(
        [CELERY, "-A", "cnl_beat_app", "nats-leader", *args],
        env=env,
        cwd=str(HERE),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


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
