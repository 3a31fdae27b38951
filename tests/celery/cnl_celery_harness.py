"""Harness of the Celery integration tests (fixtures in ``conftest.py``).

Every test gets its own ``nats-server`` (never the system one), its own KV
bucket, queue names and ledger, and starts ``celery -A cnl_celery_app worker``
processes configured through ``$CNL_CONFIG``.

Brokers: kombu's filesystem transport always runs. Redis and RabbitMQ are used
at their usual local ports (or ``CNL_REDIS_URL`` / ``CNL_AMQP_URL``); when
``CI=true`` they must be reachable (the test fails), elsewhere a missing one is
skipped with the reason. Tests share those servers with other processes, so
every key and queue name is unique per test and removed afterwards.

There is no ``__init__.py`` here on purpose: this directory is called
``celery`` and must never become importable as a package.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from cnl_celery_ledger import Ledger

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats import open_backend
from celery_nats_leader.testing import NatsServer
from tests.support import REPO
from tests.support.brokers import Broker
from tests.support.procs import Proc
from tests.support.services import wait_for

HERE = Path(__file__).resolve().parent
CELERY = str(Path(sys.executable).parent / "celery")
#: What the worker subprocesses import: this directory's helpers, and tests.support.
PYTHONPATH = os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])


class Cluster:
    """Workers of one test, sharing a NATS server, a broker, a bucket and a ledger."""

    def __init__(
        self,
        tmp_path: Path,
        nats: NatsServer,
        broker: Broker,
        *,
        ttl: float = 2.0,
        roles: tuple[str, ...] = ("jobs",),
        create_bucket: bool = True,
        **config: Any,
    ) -> None:
        token = uuid.uuid4().hex[:8]
        self.tmp_path = tmp_path
        self.nats = nats
        self.broker = broker
        self.config: dict[str, Any] = {
            "broker_url": broker.url,
            "broker_transport_options": broker.transport_options,
            "default_queue": f"cnl-default-{token}",
            "nats_url": nats.url,
            "bucket": f"cnl_{token}",
            "roles": list(roles),
            "ttl": ttl,
            "queue_prefix": f"cnl-leader-{token}.",
            "ledger": str(tmp_path / "ledger.sqlite3"),
            **config,
        }
        broker.queues.add(self.config["default_queue"])
        broker.queues.update(self.leader_queue(role) for role in roles)
        self.ledger = Ledger(self.config["ledger"])
        self.ledger.create()
        if create_bucket:
            asyncio.run(self._create_bucket())
        self.workers: list[Proc] = []
        self._app: Any = None
        self.declare_queues()

    def declare_queues(self) -> None:
        """Declare the queues before any worker starts.

        kombu's filesystem transport corrupts its exchange table when several
        processes declare the same exchange for the first time at once (one
        reads the file another has just created empty); declaring up front
        keeps three workers starting together out of that race.
        """
        names = [
            self.config["default_queue"],
            *(self.leader_queue(r) for r in self.config["roles"]),
        ]
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            for name in names:
                self.app.amqp.queues[name](channel).declare()

    async def _create_bucket(self) -> None:
        async with await open_backend(
            ConnectOptions(servers=(self.nats.url,)), timeout=10
        ) as backend:
            await backend.open_bucket(
                self.config["bucket"], ttl=self.config["ttl"], create=True, replicas=1, timeout=10
            )

    @property
    def role(self) -> str:
        return str(self.config["roles"][0])

    def leader_queue(self, role: str | None = None) -> str:
        return f"{self.config['queue_prefix']}{role or self.role}"

    # -------------------------------------------------------------- client

    @property
    def app(self) -> Any:
        if self._app is None:
            from cnl_celery_app import make_app

            self._app = make_app(self.config)
        return self._app

    def send(self, name: str, *args: Any, **kwargs: Any) -> Any:
        options = kwargs.pop("options", {})
        return self.app.tasks[name].apply_async(args=args, kwargs=kwargs, **options)

    # ------------------------------------------------------------- workers

    def start_worker(
        self,
        name: str,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        queues: tuple[str, ...] = (),
        config: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> Proc:
        worker_config = {**self.config, **(config or {})}
        env = {
            **os.environ,
            "CNL_CONFIG": json.dumps(worker_config),
            "PYTHONPATH": PYTHONPATH,
            "PYTHONUNBUFFERED": "1",
        }
        queue_list = [self.config["default_queue"], *queues]
        log_path = self.tmp_path / f"worker-{name}.log"
        command = [
            CELERY,
            "-A",
            "cnl_celery_app",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "-Q",
            ",".join(queue_list),
            "--loglevel=INFO",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ]
        worker = Proc(name, command, env=env, log_path=log_path, cwd=self.tmp_path)
        self.workers.append(worker)
        if wait:
            self.wait_ready(worker)
        return worker

    def wait_ready(self, worker: Proc, timeout: float = 60.0) -> None:
        def ready() -> bool:
            if not worker.alive:
                raise AssertionError(
                    f"{worker} exited with {worker.proc.returncode}:\n{worker.log()[-4000:]}"
                )
            return f"{worker.name}@" in worker.log() and " ready." in worker.log()

        wait_for(ready, timeout, f"{worker} to be ready", self.diagnostics)

    def by_pid(self, pid: int) -> Proc:
        return next(w for w in self.workers if w.pid == pid)

    def wait_leader(self, exclude: tuple[Proc, ...] = (), timeout: float = 60.0) -> Proc:
        """The worker of the newest promotion, once one not in ``exclude`` is promoted."""
        excluded = {w.pid for w in exclude}

        def promoted() -> Proc | None:
            promotions = [t for t in self.ledger.promotions() if t.role == self.role]
            if not promotions:
                return None
            newest = max(promotions, key=lambda t: t.epoch or 0)
            return None if newest.main_pid in excluded else self.by_pid(newest.main_pid)

        return wait_for(
            promoted, timeout, f"a leader of {self.role!r} not in {exclude}", self.diagnostics
        )

    def diagnostics(self) -> str:
        parts = [f"ledger terms: {self.ledger.terms()}", f"committed: {self.ledger.committed()}"]
        for worker in self.workers:
            parts.append(f"--- {worker} alive={worker.alive} log tail:\n{worker.log()[-3000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        # Teardown: a warm shutdown first (it releases the roles), but no
        # long wait for Celery's own shutdown; the tests that care about a
        # clean exit wait for it themselves.
        for worker in self.workers:
            worker.terminate()
        for worker in self.workers:
            worker.stop(timeout=3)
        if self._app is not None:
            self._app.close()
        self.ledger.close()


def run_cli(cluster: Cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A cnl_celery_app nats-leader ARGS`` with the cluster's configuration."""
    env = {
        **os.environ,
        "CNL_CONFIG": json.dumps(cluster.config),
        "PYTHONPATH": PYTHONPATH,
    }
    return subprocess.run(
        [CELERY, "-A", "cnl_celery_app", "nats-leader", *args],
        env=env,
        cwd=cluster.tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
