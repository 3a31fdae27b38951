"""Celery integration benchmarks: the per-task leadership check, and promotion to first task.

1. Per-task cost of the execution-time check of ``@leader_only``:
   cached state in the worker's main process (threads/solo pools) and in a
   forked child (prefork: the shared-memory slot), the whole guard as a task
   pays it (check + request attributes + token keyword), and ``validate=True``
   (one KV read) next to a bare KV read.
2. Time from a worker's promotion to its first leader-only task executed, with
   tasks already waiting in the leader queue, per pool and broker. The key is
   taken by a forged record (the worker steps down), tasks are queued, then the
   forged record is deleted: the worker campaigns at once, wins, starts
   consuming the leader queue and runs the first task. Measured from the
   delete (so it includes the campaign, about a millisecond) to the first
   task body starting, both on this host's monotonic clock.

Run with ``benchmarks/run`` or ``python benchmarks/celery_overhead.py [--quick]``.
Redis and RabbitMQ rows appear when those brokers are reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.loop_thread import EventLoopThread
from celery_nats_leader.nats import open_backend
from celery_nats_leader.term.record import encode_record
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.worker import shared_leadership
from celery_nats_leader.worker.election import WorkerElection
from celery_nats_leader.worker.tasks import LeaderOptions, _Binding, _run_guarded

ROOT = Path(__file__).resolve().parent.parent
TEST_APP_DIR = ROOT / "tests" / "celery"
CELERY = str(Path(sys.executable).parent / "celery")
ROLE = "bench"


def per_call_us(fn: Any, n: int) -> float:
    """Median over 5 rounds of the mean cost of one call, microseconds."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(rounds)


class _Request:
    """Stands in for ``task.request`` (a Celery Context) in the guard benchmark."""

    delivery_info: dict[str, Any] = {}  # noqa: RUF012 - read only
    id = "bench"


class _Task:
    name = "bench.task"
    acks_late = True

    def __init__(self) -> None:
        self.request = _Request()


def check_overhead(url: str, quick: bool) -> list[tuple[str, float]]:
    n, n_kv = (20_000, 300) if quick else (100_000, 2_000)
    app = Celery("bench", set_as_current=False)
    app.conf.update(
        nats_leader_servers=url,
        nats_leader_roles=[ROLE],
        nats_leader_ttl=5.0,
        nats_leader_bucket="bench_overhead",
        nats_leader_create_bucket=True,
        nats_leader_required=True,  # start() waits for the connection
    )
    service = WorkerElection(app, LeaderSettings.from_celery(app.conf))
    service.start()
    try:
        assert service.handle(ROLE).wait_for_leadership(10), "did not win the role"
        check = shared_leadership.check_leadership
        rows = [("cached check, main process (threads, solo)", per_call_us(lambda: check(ROLE), n))]

        binding = _Binding(LeaderOptions(ROLE), ROLE, "nats_leader." + ROLE)
        task = _Task()

        def body(leader_token: Any = None) -> None:
            return None

        def guarded() -> None:
            _run_guarded(task, binding, body, accepts_token=True, args=(), kwargs={})

        rows.append(
            ("whole guard per task (check + request + token kwarg)", per_call_us(guarded, n))
        )

        # Forked child: the shared-memory path, and a child's own KV connection.
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(read_fd)
            result = {
                "cached": per_call_us(lambda: check(ROLE), n),
                "validate": per_call_us(lambda: check(ROLE, validate=True), n_kv),
            }
            os.write(write_fd, json.dumps(result).encode())
            os._exit(0)
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            child = json.loads(pipe.read())
        os.waitpid(pid, 0)
        rows.append(("cached check, prefork child (shared memory)", child["cached"]))
        rows.append(
            ("validate=True, main process", per_call_us(lambda: check(ROLE, validate=True), n_kv))
        )
        rows.append(("validate=True, prefork child (own connection)", child["validate"]))

        # A bare KV read through a loop thread, for comparison.
        loop = EventLoopThread("bench-kv")
        loop.start()

        async def open_bucket() -> Any:
            backend = await open_backend(ConnectOptions(servers=(url,)))
            return backend, await backend.open_bucket(
                "bench_overhead", ttl=None, create=False, replicas=1, timeout=5
            )

        backend, bucket = loop.run(open_bucket(), 10)
        rows.append(
            (
                "bare KV get (one round trip), for reference",
                per_call_us(lambda: loop.run(bucket.get(ROLE, timeout=2), 5), n_kv),
            )
        )
        loop.run(backend.close(), 5)
        loop.stop()
        return rows
    finally:
        service.stop()


# ------------------------------------------------------- promotion to first task


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), 1.0):
            return True
    except OSError:
        return False


def broker_config(kind: str, tmp: Path) -> tuple[str, dict[str, Any]]:
    if kind == "redis":
        return "redis://127.0.0.1:6379/0", {
            "global_keyprefix": f"cnl-bench-{uuid.uuid4().hex[:8]}:"
        }
    if kind == "amqp":
        return "amqp://guest:guest@127.0.0.1:5672//", {}
    folders = {k: tmp / k for k in ("in", "processed", "control")}
    for folder in folders.values():
        folder.mkdir()
    return "filesystem://", {
        "data_folder_in": str(folders["in"]),
        "data_folder_out": str(folders["in"]),
        "processed_folder": str(folders["processed"]),
        "store_processed": True,
        "control_folder": str(folders["control"]),
        "polling_interval": 0.05,
    }


def cleanup(kind: str, url: str, options: dict[str, Any], queues: tuple[str, ...]) -> None:
    """Remove the run's keys and queues from the shared brokers."""
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=options["global_keyprefix"] + "*"))
        if keys:
            client.delete(*keys)
        client.close()
    elif kind == "amqp":
        from kombu import Connection

        with Connection(url) as conn:
            for name in queues:
                channel = conn.channel()
                channel.queue_delete(name)
                channel.exchange_delete(name)
                channel.close()


def promotion_to_first_task(url: str, kind: str, pool: str, rounds: int) -> list[float]:
    sys.path.insert(0, str(TEST_APP_DIR))
    from cnl_celery_app import make_app  # the tests' worker app
    from cnl_celery_ledger import Ledger

    tmp = Path(tempfile.mkdtemp(prefix="cnl-bench-"))
    broker_url, options = broker_config(kind, tmp)
    token = uuid.uuid4().hex[:8]
    config = {
        "broker_url": broker_url,
        "broker_transport_options": options,
        "default_queue": f"cnl-bench-{token}",
        "nats_url": url,
        "bucket": f"bench_{token}",
        "roles": [ROLE],
        "ttl": 2.0,
        "queue_prefix": f"cnl-bench-{token}.",
        "ledger": str(tmp / "ledger.sqlite3"),
        "extra": {"create_bucket": True},
    }
    ledger = Ledger(config["ledger"])
    ledger.create()
    client = make_app(config)
    queues = (config["default_queue"], f"{config['queue_prefix']}{ROLE}")
    for name in queues:
        with client.connection_for_write() as conn:
            client.amqp.queues[name](conn.default_channel).declare()
    env = {**os.environ, "CNL_CONFIG": json.dumps(config), "PYTHONPATH": str(TEST_APP_DIR)}
    log = (tmp / "worker.log").open("wb")
    worker = subprocess.Popen(
        [
            CELERY,
            "-A",
            "cnl_celery_app",
            "worker",
            "-P",
            pool,
            "-c",
            "2" if pool != "solo" else "1",
            "-Q",
            config["default_queue"],
            "--loglevel=WARNING",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ],
        env=env,
        cwd=tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    loop = EventLoopThread("bench-forge")
    loop.start()

    def wait(predicate: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError(f"benchmark stuck; worker log in {tmp}")
            time.sleep(0.005)

    async def open_bucket() -> Any:
        backend = await open_backend(ConnectOptions(servers=(url,)))
        kv = await backend.open_bucket(
            config["bucket"], ttl=None, create=False, replicas=1, timeout=10
        )
        return backend, kv

    samples: list[float] = []
    try:
        wait(lambda: len(ledger.promotions()) >= 1)
        backend, kv = loop.run(open_bucket(), 10)
        forged = encode_record(
            instance_id="bench:0:0", token=str(uuid.uuid4()), epoch=None, priority=0, meta={}
        )
        for i in range(rounds):
            demoted = sum(1 for t in ledger.terms() if t.event == "demoted")
            revision = loop.run(kv.put(ROLE, forged, timeout=5), 10)  # the worker steps down
            wait(lambda d=demoted: sum(1 for t in ledger.terms() if t.event == "demoted") > d)
            base = 1000 * (i + 1)
            for seq in range(base, base + 5):
                client.tasks["cnl.record"].apply_async(args=[seq])
            released = time.monotonic()
            loop.run(kv.delete(ROLE, last=revision, timeout=5), 10)  # the worker wins at once
            wait(lambda b=base: ledger.count("SELECT COUNT(*) FROM attempts WHERE seq >= ?", b) > 0)
            first = ledger.rows("SELECT MIN(t) FROM attempts WHERE seq >= ?", base)[0][0]
            samples.append(first - released)
            wait(lambda b=base: ledger.count("SELECT COUNT(*) FROM commits WHERE seq >= ?", b) == 5)
        loop.run(backend.close(), 5)
    finally:
        loop.stop()
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        cleanup(kind, broker_url, options, queues)
        client.close()
        ledger.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()
    with NatsServer() as server:
        print("### Execution-time check of @leader_only, per task\n")
        print("| what | cost per task |")
        print("|---|---:|")
        for what, us in check_overhead(server.url, args.quick):
            print(f"| {what} | {us:.1f} µs |")
        print()
        print("### From promotion to the first leader-only task (tasks already queued)\n")
        print("| broker | pool | median | min | max | rounds |")
        print("|---|---|---:|---:|---:|---:|")
        brokers = ["filesystem"]
        if reachable("127.0.0.1", 6379):
            brokers.append("redis")
        if reachable("127.0.0.1", 5672):
            brokers.append("amqp")
        rounds = 3 if args.quick else 7
        for kind in brokers:
            for pool in ("prefork", "threads", "solo"):
                samples = [
                    s * 1000 for s in promotion_to_first_task(server.url, kind, pool, rounds)
                ]
                print(
                    f"| {kind} | {pool} | {statistics.median(samples):.1f} ms | "
                    f"{min(samples):.1f} ms | {max(samples):.1f} ms | {len(samples)} |",
                    flush=True,
                )
        print(
            "\nMeasured from the release of the key (the worker campaigns on the watch event) "
            "to the first task body starting; the filesystem transport applies consumer changes "
            "only between its blocking 2 s polls."
        )


if __name__ == "__main__":
    main()
