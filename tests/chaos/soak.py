"""A chaos soak: random faults, in combinations, against real processes and servers.

Set-up: a 3-node NATS cluster (JetStream store capped, so that it can run
out), an R3 election bucket, and election candidates
(:mod:`~tests.chaos.soak_child`), each campaigning for every
role and, while leading, writing through two fences (a file and, when
reachable, PostgreSQL). Every candidate reaches each server through a
:class:`~celery_nats_leader.testing.fault_proxy.ThreadedFaultProxy` of its own.
The first candidate runs in a network namespace of its own (when the
``partition`` fault is on; that needs root), its proxies listening on the
root side of its veth pair.

A fault scheduler then injects faults at random moments; several run at once
(a kill during a failover, a pause during a node restart):

=================== ===========================================================
sigkill             SIGKILL a candidate (a leader more often than not), restart it
sigstop             SIGSTOP a candidate for longer than the TTL, then SIGCONT
sigterm             SIGTERM (graceful: releases its roles), restart it
blackhole           drop every byte between a candidate and NATS for a while
reset               abort a candidate's connections (TCP RST)
latency             add 50-500 ms to a candidate's NATS traffic for a while
partition           cut the first candidate's network namespace off (its veth
                    down: a real partition, see :mod:`.netns`) for a while
node_kill           SIGKILL a NATS server, restart it
stream_leader_kill  SIGKILL the server leading the bucket's stream, restart it
out_of_storage      fill JetStream's store until writes fail, then free it
bucket_recreate     an operator deletes the bucket, clears the fences (as
                    documented: epochs restart), recreates it, restarts the
                    candidates (which stopped on the missing bucket)
=================== ===========================================================

Every process appends its events to one directory; the fault scheduler adds
``fault``, ``killed``, ``paused``, ``resumed`` and ``exited`` lines. The
independent :mod:`~tests.chaos.checker` judges the run from
those files alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType, StreamConfig

from celery_nats_leader.core.constants import BACKOFF_MAX_SECONDS
from celery_nats_leader.testing.cluster import NatsCluster
from celery_nats_leader.testing.fault_proxy import ThreadedFaultProxy
from celery_nats_leader.testing.nats_server import NatsServer
from celery_nats_leader.testing.process import thread_states
from tests.chaos.checker import Report, check, load_events
from tests.chaos.netns import NetnsHost
from tests.chaos.soak_child import MODULE as CHILD_MODULE
from tests.chaos.soak_child import EventLog, FileFence, pg_settings
from tests.support import REPO

__all__ = [
    "DRAIN_TIMEOUT",
    "FAULT_KINDS",
    "Soak",
    "SoakOptions",
    "drain_worker",
    "kinds_from",
    "postgres_reachable",
    "run_soak",
]

logger = logging.getLogger(__name__)

#: Every fault kind, with its weight in the random choice.
FAULT_KINDS: dict[str, float] = {
    "sigkill": 3,
    "sigstop": 3,
    "sigterm": 3,
    "blackhole": 2,
    "reset": 2,
    "latency": 2,
    "partition": 2,
    "node_kill": 1,
    "stream_leader_kill": 1,
    "out_of_storage": 0.5,
    "bucket_recreate": 0.25,
}

#: JetStream store cap per server: small enough to fill in a moment.
STORE_LIMIT_BYTES = 48 * 1024 * 1024

#: Seconds the beat worker gets to run its last ticks once the beats stopped
#: (a deferred tick runs ``lease / 3`` = 10 s after its failed claim).
DRAIN_TIMEOUT = 60.0
_FILLER_STREAM = "SOAK_FILLER"
_NODE_FAULTS = frozenset({"node_kill", "stream_leader_kill", "out_of_storage", "bucket_recreate"})


@dataclass
class SoakOptions:
    """What to run.

    Attributes:
        faults: Faults to inject.
        ttl: Election TTL, seconds.
        candidates: Candidate processes.
        roles: Roles every candidate campaigns for.
        mean_gap: Mean seconds between two fault injections (exponential).
        max_concurrent: Faults in progress at once, at most.
        kinds: Fault kinds and weights (default :data:`FAULT_KINDS`).
        binary: ``nats-server`` executable (default: the harness's choice).
        pg: Also fence through PostgreSQL (needs it reachable).
        seed: Random seed (printed, so a run can be replayed).
        workdir: Where events and logs go (a new temp dir by default).
        quiet: Seconds without faults before the final stop.
        beats: ``celery beat`` replicas (0: none), with one worker running
            their ticks; they need ``beat_app_dir`` and ``broker_url``.
        beat_app_dir: The directory of the beat tests' Celery app
            (``tests/beat``: ``cnl_beat_app`` and its ledger).
        broker_url: The broker of beat and the workers (Redis or RabbitMQ).
        workers: Celery workers running leader-only tasks (0: none); they
            need ``celery_app_dir`` and ``broker_url``. A sender sends one
            task every ``task_interval`` seconds while the faults run.
        celery_app_dir: The directory of the Celery tests' app
            (``tests/celery``: ``cnl_celery_app`` and its ledger).
        task_interval: Seconds between two leader-only tasks.
        fast_failover: Every election (candidates, beats, workers) runs with
            ``fast_failover=True``: a designated successor takes over about a
            second after its leader goes silent, whatever the TTL.
        servers: NATS servers: 3 (a cluster, R3 buckets) or 1 (a single
            server, R1 buckets; a ``node_kill`` then kills the only server).

    """

    faults: int = 200
    ttl: float = 2.0
    candidates: int = 5
    roles: tuple[str, ...] = ("alpha", "beta")
    mean_gap: float = 1.0
    max_concurrent: int = 3
    kinds: dict[str, float] = field(default_factory=lambda: dict(FAULT_KINDS))
    binary: str | None = None
    pg: bool = False
    seed: int | None = None
    workdir: Path | None = None
    quiet: float = 0.0
    beats: int = 0
    beat_app_dir: Path | None = None
    broker_url: str = ""
    workers: int = 0
    celery_app_dir: Path | None = None
    task_interval: float = 0.25
    fast_failover: bool = False
    servers: int = 3


class _Candidate:
    """A soak process: an election candidate (behind its own fault proxies) or a beat."""

    def __init__(
        self, soak: Soak, name: str, *, kind: str = "candidate", host: NetnsHost | None = None
    ) -> None:
        self.soak = soak
        self.name = name
        self.kind = kind
        self.beat = kind != "candidate"  # a Celery process: no proxies, its own program
        # A candidate on a namespace host reaches the servers through proxies
        # on the root side of its veth pair (the servers listen on loopback).
        self.host = host
        listen = "127.0.0.1" if host is None else host.root_address
        self.proxies = (
            []
            if self.beat
            else [
                ThreadedFaultProxy(server.host, server.port, listen_host=listen)
                for server in soak.cluster.servers
            ]
        )
        for proxy in self.proxies:
            proxy.start()
        self.process: subprocess.Popen[bytes] | None = None
        self.lock = threading.RLock()
        self.busy = False  # a process fault is in progress
        self._end_logged = True

    def ensure_running(self) -> None:
        """Record the end of a dead process (once), and start a new one."""
        with self.lock:
            if self.alive:
                return
            self.note_end("exited")
            self._start()

    def note_end(self, kind: str) -> None:
        """Record that the current process is dead (``killed`` or ``exited``), once."""
        with self.lock:
            if not self._end_logged and not self.alive:
                self.soak.log.emit(kind, proc=self.name)
                self._end_logged = True

    def _start(self) -> None:
        if self.kind == "beat":
            self._spawn(self.soak.beat_command(self.name), self.soak.beat_env())
            return
        if self.kind == "worker":
            self._spawn(self.soak.worker_command(self.name), self.soak.worker_env())
            return
        opts = self.soak.options
        cmd = [sys.executable, "-m", CHILD_MODULE, "--id", self.name]
        for proxy in self.proxies:
            cmd += ["--url", proxy.url]
        cmd += [
            "--roles",
            ",".join(self.soak.roles),
            "--bucket",
            self.soak.bucket,
            "--ttl",
            str(opts.ttl),
            "--events",
            str(self.soak.events_dir),
            "--fence",
            str(self.soak.fence_path),
        ]
        if opts.pg:
            cmd.append("--pg")
        if opts.fast_failover:
            cmd.append("--fast-failover")
        if self.host is not None:
            cmd = self.host.command(cmd)  # execs in place: the pid is the candidate's
        self._spawn(cmd, child_env())

    def _spawn(self, cmd: list[str], env: dict[str, str] | None) -> None:
        log = open(self.soak.logs_dir / f"{self.name}.log", "ab")  # noqa: SIM115 - owned by Popen
        try:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        finally:
            log.close()
        self._end_logged = False
        self.soak.names[self.process.pid] = self.name

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGCONT)
                self.process.kill()
            self.process.wait(10)
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                proxy.stop()


class Soak:
    """One soak run; use :meth:`run` (or :func:`run_soak`).

    Args:
        options: What to run.

    """

    def __init__(self, options: SoakOptions) -> None:
        self.options = options
        self.seed = options.seed if options.seed is not None else random.randrange(2**32)
        self.rng = random.Random(self.seed)
        run_id = os.urandom(3).hex()
        self.workdir = options.workdir or Path(tempfile.mkdtemp(prefix="cnl-soak-"))
        self.events_dir = self.workdir / "events"
        self.logs_dir = self.workdir / "logs"
        self.events_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.fence_path = self.workdir / "fence.json"
        self.bucket = f"soak_{run_id}"
        self.roles = tuple(f"{role}-{run_id}" for role in options.roles)
        self.log = EventLog(self.events_dir / "chaos.jsonl", "chaos")
        self.config_path = self.workdir / "nats.conf"
        self.config_path.write_text(f"jetstream {{ max_file_store: {STORE_LIMIT_BYTES} }}\n")
        if options.servers not in (1, 3):
            raise ValueError(f"servers={options.servers}: a soak runs 1 server or a 3-node cluster")
        self.replicas = options.servers
        self.cluster: NatsCluster | _SingleServer = (
            NatsCluster(
                3,
                advertise=False,
                binary=options.binary,
                extra_args=["-c", str(self.config_path)],
            )
            if options.servers == 3
            else _SingleServer(
                NatsServer(
                    binary=options.binary,
                    extra_args=["-c", str(self.config_path)],
                    startup_timeout=20.0,
                )
            )
        )
        self.candidates: list[_Candidate] = []
        self.names: dict[int, str] = {}  # pid -> process name (the ledgers know pids)
        self.beat_role = f"beat-{run_id}"
        self.beat_queue = f"soak-{run_id}"
        self.ledger_path = self.workdir / "ledger.sqlite3"
        self.t0 = time.time()
        self.worker: subprocess.Popen[bytes] | None = None
        self.task_role = f"tasks-{run_id}"
        self.tasks_ledger = self.workdir / "tasks.sqlite3"
        self.celery_config: dict[str, Any] = {
            "broker_url": options.broker_url,
            # A crashed worker's unacknowledged task comes back after this
            # (Redis; kombu's default is an hour, longer than a soak), found
            # by a sweep every second (kombu's default: every 100 s).
            "broker_transport_options": {
                "visibility_timeout": 10,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
                # A worker killed during its sweep leaves kombu's sweep lock
                # behind: it expires after this (kombu's default: 300 s).
                "unacked_mutex_expire": 10,
            },
            "default_queue": f"soak-default-{run_id}",
            "nats_url": "",  # set once the cluster runs
            "bucket": self.bucket,
            "roles": [self.task_role],
            "ttl": options.ttl,
            "queue_prefix": f"soak-leader-{run_id}.",
            "ledger": str(self.tasks_ledger),
            "start_timeout": 30.0,
            "extra": {"fast_failover": True} if options.fast_failover else {},
        }
        self._sender: threading.Thread | None = None
        self._sent = 0
        self._leaders: dict[str, str] = {}
        self._offsets: dict[Path, int] = {}
        self._node_fault = threading.Lock()
        self._bucket_lock = threading.RLock()  # held while the bucket is being recreated
        self._stop = threading.Event()
        #: Faults that failed to run, as ``kind: exception`` (logged, and shown by the tests).
        self.errors: list[str] = []
        self._threads: list[threading.Thread] = []
        self.injected = 0
        self.netns_host: NetnsHost | None = None

    # ------------------------------------------------------------ helpers

    def _nats(self, coro_factory: Callable[[Any], Any]) -> Any:
        """Run one operator action on a fresh connection to the cluster."""

        async def run() -> Any:
            nc = await nats.connect(
                servers=self.cluster.urls, connect_timeout=2, max_reconnect_attempts=3
            )
            try:
                return await coro_factory(nc)
            finally:
                await nc.close()

        return asyncio.run(run())

    def _create_bucket(self) -> None:
        async def create(nc: Any) -> None:
            await nc.jetstream(timeout=10).create_key_value(
                KeyValueConfig(
                    bucket=self.bucket,
                    history=1,
                    ttl=self.options.ttl,
                    replicas=self.replicas,
                    storage=StorageType.FILE,
                )
            )

        self._retry("create the bucket", lambda: self._nats(create))

    def _wait_for_the_bucket(self, timeout: float) -> None:
        """Wait until the bucket's stream answers with a leader (JetStream recovered).

        The quiet window judges the election once the faults are over; a
        cluster still electing the stream's leader, or a store still
        recovering, is the tail of the last fault, not quiet.
        """

        async def has_leader(nc: Any) -> None:
            info = await nc.jetstream(timeout=2).stream_info(f"KV_{self.bucket}")
            if self.replicas > 1 and not (info.cluster and info.cluster.leader):
                raise RuntimeError("the bucket's stream has no leader yet")

        self._retry(
            "reach the bucket's stream leader",
            lambda: self._nats(has_leader),
            attempts=max(1, int(timeout / 0.5)),
        )

    def _retry(self, what: str, action: Callable[[], Any], attempts: int = 20) -> Any:
        for attempt in range(attempts):
            try:
                return action()
            except Exception as exc:
                if attempt == attempts - 1:
                    raise
                logger.info("soak: %s failed (%s); retrying", what, exc)
                time.sleep(0.5)
        return None

    def _refresh_leaders(self) -> dict[str, str]:
        """Who leads what, from the candidates' own event files (read incrementally)."""
        for path in self.events_dir.glob("c*.jsonl"):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            complete = data.rfind(b"\n") + 1
            self._offsets[path] = offset + complete
            for line in data[:complete].splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                role = event.get("role")
                if event.get("kind") == "promote":
                    self._leaders[role] = event["proc"]
                elif event.get("kind") == "demote" and self._leaders.get(role) == event["proc"]:
                    del self._leaders[role]
        return dict(self._leaders)

    def _pick_candidate(self, *, beats: bool = True) -> _Candidate | None:
        leaders = set(self._refresh_leaders().values())
        free = [c for c in self.candidates if not c.busy and c.alive and (beats or not c.beat)]
        if not free:
            return None
        preferred = [c for c in free if c.name in leaders]
        if preferred and self.rng.random() < 0.7:
            return self.rng.choice(preferred)
        return self.rng.choice(free)

    def _pick_partitionable(self) -> _Candidate | None:
        free = [c for c in self.candidates if c.host is not None and not c.busy and c.alive]
        return self.rng.choice(free) if free else None

    # -------------------------------------------------------------------- beat

    def beat_env(self) -> dict[str, str]:
        """Environment of the beat replicas and their worker (``cnl_beat_app``)."""
        assert self.options.beat_app_dir is not None
        config = {
            "broker_url": self.options.broker_url,
            "queue": self.beat_queue,
            "nats_url": ",".join(self.cluster.urls),
            "bucket": self.bucket,
            "beat_role": self.beat_role,
            "ttl": self.options.ttl,
            "ledger": str(self.ledger_path),
            # A crontab whose schedule clock runs 60x: one tick a second.
            "entries": [{"kind": "fastcron", "name": "every-second"}],
            "t0": self.t0,
            "speed": 60,
            "max_interval": 0.2,
            "scheduler": "nats_leader",
            # Every missed tick caught up, whatever the gap: some faults
            # (a blackhole, a re-created bucket) leave the role leaderless
            # longer than the default catch-up window, after which beat
            # deliberately coalesces (tests/beat/test_beat_catch_up.py);
            # the soak checks that each tick runs exactly once.
            "extra": {
                "beat_catch_up_window": float("inf"),
                **({"fast_failover": True} if self.options.fast_failover else {}),
            },
            # The soak inspects the worker to drain it before it stops.
            "remote_control": True,
        }
        env = dict(os.environ)
        env["CNL_BEAT_CONFIG"] = json.dumps(config)
        app_dir = self.options.beat_app_dir
        env["PYTHONPATH"] = os.pathsep.join([str(app_dir), str(app_dir.parent.parent)])
        env.pop("DJANGO_SETTINGS_MODULE", None)
        return env

    def beat_command(self, name: str) -> list[str]:
        """The command of beat replica ``name``."""
        celery = str(Path(sys.executable).with_name("celery"))
        schedule = self.workdir / f"schedule-{name}"
        return [celery, "-A", "cnl_beat_app", "beat", "-S", "nats_leader", "-s", str(schedule)]

    def _start_beat_part(self) -> None:
        assert self.options.beat_app_dir is not None
        # The ledger module and the repository root (it imports tests.support).
        paths = [str(self.options.beat_app_dir), str(self.options.beat_app_dir.parent.parent)]
        sys.path[:0] = paths
        try:
            from cnl_beat_ledger import BeatLedger  # type: ignore[import-not-found]
        finally:
            for path in paths:
                sys.path.remove(path)
        BeatLedger(str(self.ledger_path)).create()

        async def state_bucket(nc: Any) -> None:
            await nc.jetstream(timeout=10).create_key_value(
                KeyValueConfig(
                    bucket=f"{self.bucket}_beat",
                    history=1,
                    replicas=self.replicas,
                    storage=StorageType.FILE,
                )
            )

        self._retry("create the beat state bucket", lambda: self._nats(state_bucket))
        celery = str(Path(sys.executable).with_name("celery"))
        log = open(self.logs_dir / "worker.log", "ab")  # noqa: SIM115 - owned by Popen
        try:
            self.worker = subprocess.Popen(
                [
                    *(celery, "-A", "cnl_beat_app", "worker", "-P", "threads", "-c", "4"),
                    *("-Q", self.beat_queue, "-n", f"{self.beat_queue}@%h"),
                ],
                env=self.beat_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()
        for i in range(self.options.beats):
            beat = _Candidate(self, f"beat{i + 1}", kind="beat")
            self.candidates.append(beat)
            beat.ensure_running()
        # Faults start once beat runs: its first tick executed.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with contextlib.closing(sqlite3.connect(str(self.ledger_path), timeout=30)) as db:
                if db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"beat ran no tick within 90 s; see {self.logs_dir}")

    def _stop_beat_part(self) -> None:
        """Stop the beats, let the worker finish their ticks, record its runs as events."""
        if self.worker is None:
            return
        name = f"{self.beat_queue}@{socket.gethostname()}"
        if not drain_worker(self.options.broker_url, self.beat_queue, name, DRAIN_TIMEOUT):
            self.errors.append(
                f"the beat worker still had ticks after {DRAIN_TIMEOUT:g}s; stopping it anyway"
            )
        self.worker.terminate()  # warm shutdown: running tasks finish
        try:
            self.worker.wait(60)
        except subprocess.TimeoutExpired:
            self.worker.kill()
            self.worker.wait()
        from celery_nats_leader.beat.ticks import parse_slot

        log = EventLog(self.events_dir / "ledger.jsonl", "ledger")
        try:
            with contextlib.closing(sqlite3.connect(str(self.ledger_path))) as db:
                rows = db.execute(
                    "SELECT entry, tick, task_id, pid, mono FROM runs WHERE tick IS NOT NULL"
                ).fetchall()
            for entry, tick, task_id, pid, mono in rows:
                minute = int(parse_slot(tick).timestamp() // 60)
                log.emit("run", t=mono, tick=f"{entry}@{minute}", task=task_id, worker=pid)
        finally:
            log.close()

    # ----------------------------------------------------------------- workers

    def worker_env(self) -> dict[str, str]:
        """Environment of the leader-only task workers (``cnl_celery_app``)."""
        assert self.options.celery_app_dir is not None
        app_dir = self.options.celery_app_dir
        env = dict(os.environ)
        env["CNL_CONFIG"] = json.dumps(self.celery_config)
        env["PYTHONPATH"] = os.pathsep.join([str(app_dir), str(app_dir.parent.parent)])
        env.pop("DJANGO_SETTINGS_MODULE", None)
        return env

    def worker_command(self, name: str) -> list[str]:
        """The command of worker ``name`` (threads pool: a killed worker leaves no orphans)."""
        celery = str(Path(sys.executable).with_name("celery"))
        queue = self.celery_config["default_queue"]
        return [
            *(celery, "-A", "cnl_celery_app", "worker", "-P", "threads", "-c", "2"),
            *("-n", f"{name}-{self.bucket}@%h", "-Q", queue),
            *("--without-heartbeat", "--without-gossip", "--without-mingle"),
        ]

    def _celery_module(self, name: str) -> Any:
        assert self.options.celery_app_dir is not None
        path = str(self.options.celery_app_dir)
        sys.path.insert(0, path)
        try:
            return __import__(name)
        finally:
            sys.path.remove(path)

    def _start_worker_part(self) -> None:
        self.celery_config["nats_url"] = ",".join(self.cluster.urls)
        self._celery_module("cnl_celery_ledger").Ledger(str(self.tasks_ledger)).create()
        for i in range(self.options.workers):
            worker = _Candidate(self, f"worker{i + 1}", kind="worker")
            self.candidates.append(worker)
            worker.ensure_running()
        app = self._celery_module("cnl_celery_app").make_app(self.celery_config)
        task = app.tasks["cnl.record"]
        sent_log = EventLog(self.events_dir / "sender.jsonl", "sender")

        def send() -> None:
            seq = 0
            try:
                while not self._stop_sending.wait(self.options.task_interval):
                    seq += 1
                    try:
                        task.apply_async(args=(seq,))
                    except Exception as exc:
                        logger.warning("soak: sending task %d failed: %s", seq, exc)
                        continue
                    sent_log.emit("sent", task=str(seq))
                    self._sent = seq
            finally:
                sent_log.close()

        self._stop_sending = threading.Event()
        self._sender = threading.Thread(target=send, name="task-sender", daemon=True)
        self._sender.start()

    def _committed(self) -> int:
        with contextlib.closing(sqlite3.connect(str(self.tasks_ledger), timeout=30)) as db:
            return int(db.execute("SELECT COUNT(*) FROM commits").fetchone()[0])

    def _stop_worker_part(self) -> None:
        """Stop sending, let the leader run what was sent, record the ledger as events."""
        if self._sender is None:
            return
        self._stop_sending.set()
        self._sender.join(30)
        deadline = time.monotonic() + 90  # > the visibility timeout: redeliveries arrive
        while time.monotonic() < deadline and self._committed() < self._sent:
            time.sleep(0.2)
        log = EventLog(self.events_dir / "tasks.jsonl", "tasks")
        lease = self.options.ttl * 0.9  # ttl - the default lease margin
        try:
            with contextlib.closing(sqlite3.connect(str(self.tasks_ledger), timeout=30)) as db:
                for seq, pid, t in db.execute("SELECT seq, main_pid, t FROM commits"):
                    log.emit("run", t=t, task=str(seq), worker=self._name_of(pid))
                for seq, pid, t in db.execute(
                    "SELECT info, main_pid, t FROM events WHERE kind = 'received' AND name = ?",
                    ("cnl.record",),
                ):
                    log.emit("received", t=t, task=seq, worker=self._name_of(pid))
                for event, role, pid, epoch, reason, t in db.execute(
                    "SELECT event, role, main_pid, epoch, reason, t FROM terms"
                ):
                    kind = "promote" if event == "promoted" else "demote"
                    log.emit(
                        kind,
                        t=t,
                        proc=self._name_of(pid),
                        role=role,
                        epoch=epoch,
                        reason=reason,
                        lease=lease,
                    )
            for seq, where in self._left_in_broker():
                log.emit("left", task=seq, where=where)
        finally:
            log.close()

    def _name_of(self, pid: int) -> str:
        """The soak's name of the process ``pid`` recorded in a ledger (``w<pid>`` if unknown)."""
        return self.names.get(pid, f"w{pid}")

    @property
    def _tasks_on_redis(self) -> bool:
        return self.options.broker_url.startswith("redis")

    def _left_in_broker(self) -> list[tuple[str, str]]:
        """Leader-only tasks still waiting in the leader queue or held unacknowledged (Redis).

        Such a task was not lost in the broker's pop window: the checker
        never counts it there.
        """
        if not self._tasks_on_redis:
            return []
        import base64

        import redis

        queue = self.celery_config["queue_prefix"] + self.task_role
        client = redis.Redis.from_url(self.options.broker_url)
        try:
            # kombu's Redis layout: the queue is a list of messages, the
            # unacknowledged ones a hash of [message, exchange, routing key].
            waiting = [("queue", json.loads(raw)) for raw in client.lrange(queue, 0, -1)]
            for raw in client.hvals("unacked"):
                message, _exchange, routing_key = json.loads(raw)
                if routing_key == queue:
                    waiting.append(("unacked", message))
        finally:
            client.close()
        left = []
        for where, message in waiting:
            if message.get("headers", {}).get("task") != "cnl.record":
                continue
            args = json.loads(base64.b64decode(message["body"]))[0]
            left.append((str(args[0]), where))
        return left

    # --------------------------------------------------------- process faults

    def _fault(self, kind: str, target: str, **fields: Any) -> None:
        self.injected += 1
        self.log.emit("fault", fault=kind, target=target, **fields)

    def _restart_later(self, cand: _Candidate) -> None:
        time.sleep(self.rng.uniform(0.2, 1.0))
        with self._bucket_lock:
            cand.ensure_running()

    def _sigkill(self, cand: _Candidate) -> None:
        process = cand.process
        assert process is not None
        self._fault("sigkill", cand.name)
        process.kill()
        process.wait()
        cand.note_end("killed")
        self._restart_later(cand)

    def _sigterm(self, cand: _Candidate) -> None:
        process = cand.process
        assert process is not None
        self._fault("sigterm", cand.name)
        process.terminate()
        try:
            process.wait(3 * self.options.ttl + 10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            cand.note_end("killed")
        else:
            cand.note_end("exited")
        self._restart_later(cand)

    def _sigstop(self, cand: _Candidate) -> None:
        process = cand.process
        assert process is not None
        pid = process.pid
        self._fault("sigstop", cand.name)
        process.send_signal(signal.SIGSTOP)
        # "Paused" only once every thread is stopped: until then it may act.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            states = thread_states(pid)
            if states and all(s in "Tt" for s in states):
                break
            time.sleep(0.001)
        self.log.emit("paused", proc=cand.name)
        self._stop.wait(self.options.ttl + self.rng.uniform(0.2, 1.5))
        with cand.lock:
            if process.poll() is None:
                self.log.emit("resumed", proc=cand.name)
                process.send_signal(signal.SIGCONT)

    def _blackhole(self, cand: _Candidate) -> None:
        self._fault("blackhole", cand.name)
        for proxy in cand.proxies:
            proxy.blackhole()
        self._stop.wait(self.rng.uniform(0.3, 2.5 * self.options.ttl))
        for proxy in cand.proxies:
            proxy.heal()

    def _reset(self, cand: _Candidate) -> None:
        self._fault("reset", cand.name)
        for proxy in cand.proxies:
            proxy.reset()

    def _partition(self, cand: _Candidate) -> None:
        assert cand.host is not None
        self._fault("partition", cand.name, host=cand.host.name)
        cand.host.partition()
        try:
            self._stop.wait(self.rng.uniform(0.3, 2.5 * self.options.ttl))
        finally:
            cand.host.heal()

    def _latency(self, cand: _Candidate) -> None:
        self._fault("latency", cand.name)
        delay = self.rng.uniform(0.05, 0.5)
        for proxy in cand.proxies:
            proxy.delay(delay)
        self._stop.wait(self.rng.uniform(1.0, 2 * self.options.ttl))
        for proxy in cand.proxies:
            proxy.delay(0.0)

    # ------------------------------------------------------------ node faults

    def _node_kill(self, index: int | None = None, kind: str = "node_kill") -> None:
        if index is None:
            index = self.rng.randrange(len(self.cluster))
        server = self.cluster.servers[index]
        self._fault(kind, server.server_name or str(index))
        self.cluster.kill(index)
        self._stop.wait(self.rng.uniform(0.5, 2.0))
        self._retry(f"restart server {index}", lambda: self.cluster.restart(index), attempts=5)

    def _stream_leader_kill(self) -> None:
        async def leader(nc: Any) -> str | None:
            info = await nc.jetstream(timeout=3).stream_info(f"KV_{self.bucket}")
            return info.cluster.leader if info.cluster is not None else None

        try:
            name = self._nats(leader)
        except Exception as exc:
            logger.info("soak: no stream leader to kill (%s)", exc)
            name = None
        index = next((i for i, s in enumerate(self.cluster.servers) if s.server_name == name), None)
        self._node_kill(index if index is not None else None, kind="stream_leader_kill")

    def _out_of_storage(self) -> None:
        self._fault("out_of_storage", "jetstream")

        async def fill(nc: Any) -> int:
            js = nc.jetstream(timeout=5)
            await js.add_stream(
                StreamConfig(
                    name=_FILLER_STREAM,
                    subjects=[f"{_FILLER_STREAM}.>"],
                    num_replicas=self.replicas,
                    storage=StorageType.FILE,
                )
            )
            chunk = os.urandom(512 * 1024)
            sent = 0
            for _ in range(4 * STORE_LIMIT_BYTES // len(chunk)):
                try:
                    await js.publish(f"{_FILLER_STREAM}.x", chunk, timeout=5)
                except Exception:
                    break  # out of storage (or the stream lost quorum)
                sent += 1
            return sent

        async def free(nc: Any) -> None:
            with contextlib.suppress(Exception):
                await nc.jetstream(timeout=5).delete_stream(_FILLER_STREAM)

        try:
            chunks = self._nats(fill)
            self.log.emit("storage_full", chunks=chunks)
            self._stop.wait(self.rng.uniform(1.0, 2 * self.options.ttl))
        finally:
            self._retry("free the store", lambda: self._nats(free), attempts=10)
            self.log.emit("storage_freed")

    def _bucket_recreate(self) -> None:
        with self._bucket_lock:
            self._fault("bucket_recreate", self.bucket)

            async def delete(nc: Any) -> None:
                # Gone already: an earlier try timed out and went through (its
                # answer lost while a server restarted). Ten tries that each
                # found it gone once failed the fault, and left no bucket.
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await nc.jetstream(timeout=5).delete_key_value(self.bucket)

            self._retry("delete the bucket", lambda: self._nats(delete), attempts=10)
            # The candidates stop on the missing bucket (a permanent error).
            deadline = time.monotonic() + 4 * self.options.ttl + 5
            for cand in self.candidates:
                if cand.kind == "beat":
                    continue  # beat keeps trying; its election stops on its own
                if cand.kind == "worker" and cand.process is not None:
                    cand.process.terminate()  # the operator restarts the workers
                while cand.alive and time.monotonic() < deadline:
                    time.sleep(0.05)
                with cand.lock:
                    if cand.alive:  # paused, or stuck: an operator kills it
                        assert cand.process is not None
                        cand.process.kill()
                        cand.process.wait()
                        cand.note_end("killed")
                    cand.note_end("exited")
            # Epochs restart with the bucket: clear the fences with it.
            self._clear_fences()
            self.log.emit("fence_reset")
            self._create_bucket()
            for cand in self.candidates:
                cand.ensure_running()

    def _clear_fences(self) -> None:
        fence = FileFence(self.fence_path)
        try:
            fence.reset()
        finally:
            fence.close()
        if self.options.pg:
            # Plain SQL: the soak's own process may host a Django of its own
            # (a test run), which must not be configured or used for this.
            with contextlib.closing(_pg_connect()) as conn, conn.cursor() as cur:
                cur.execute(
                    "DELETE FROM django_nats_leader_fenceepoch WHERE role = ANY(%s)",
                    (list(self.roles),),
                )
                conn.commit()
        if self.tasks_ledger.exists():
            # The workers' ledger is a fenced resource too (its commits refuse
            # an epoch older than the newest seen).
            with contextlib.closing(sqlite3.connect(str(self.tasks_ledger), timeout=30)) as db:
                db.execute("UPDATE fence SET max_epoch = 0")
                db.commit()

    # -------------------------------------------------------------- scheduling

    def _inject(self, kind: str) -> bool:
        """Start one fault of ``kind`` on a thread; ``False`` if it cannot run now."""
        if kind in _NODE_FAULTS:
            if not self._node_fault.acquire(blocking=False):
                return False
            action: Callable[[], None] = {
                "node_kill": self._node_kill,
                "stream_leader_kill": self._stream_leader_kill,
                "out_of_storage": self._out_of_storage,
                "bucket_recreate": self._bucket_recreate,
            }[kind]
            release: Callable[[], None] = self._node_fault.release
        else:
            # Beats reach NATS directly: only signals apply to them.
            cand = (
                self._pick_partitionable()
                if kind == "partition"
                else self._pick_candidate(beats=kind in ("sigkill", "sigstop", "sigterm"))
            )
            if cand is None:
                return False
            cand.busy = True
            method = getattr(self, f"_{kind}")

            def action() -> None:
                method(cand)

            def release() -> None:
                cand.busy = False

        def body() -> None:
            try:
                if not self._bucket_lock.acquire(timeout=60):
                    return
                self._bucket_lock.release()
                action()
            except Exception as exc:
                logger.exception("soak: fault %s failed", kind)
                self.errors.append(f"{kind}: {exc!r}")
            finally:
                release()

        thread = threading.Thread(target=body, name=f"fault-{kind}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return True

    def _schedule(self, progress: Callable[[str], None] | None) -> None:
        kinds = [k for k, w in self.options.kinds.items() if w > 0]
        weights = [self.options.kinds[k] for k in kinds]
        # Every kind once first (in random order), then by weight: even a
        # short run meets each kind.
        first = self.rng.sample(kinds, len(kinds))
        while self.injected < self.options.faults:
            time.sleep(self.rng.expovariate(1.0 / self.options.mean_gap))
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) >= self.options.max_concurrent:
                continue
            kind = first[0] if first else self.rng.choices(kinds, weights)[0]
            before = self.injected
            if self._inject(kind):
                if first and first[0] == kind:
                    first.pop(0)
                if progress is not None and before % 10 == 0:
                    progress(f"{before}/{self.options.faults} faults injected")
            # Restart any candidate that exited on its own (an error).
            for cand in self.candidates:
                if not cand.busy and not cand.alive:
                    with self._bucket_lock:
                        cand.ensure_running()

    # --------------------------------------------------------------------- run

    def run(self, progress: Callable[[str], None] | None = None) -> Report:
        """Set up, inject the faults, wait for quiet, stop, and check.

        Returns:
            The checker's report on the recorded events.

        """
        opts = self.options
        try:
            self.cluster.start()
            self._create_bucket()
            if opts.pg:
                self._setup_pg()
            self.log.emit(
                "start",
                seed=self.seed,
                ttl=opts.ttl,
                roles=list(self.roles),
                bucket=self.bucket,
                fast_failover=opts.fast_failover,
                servers=opts.servers,
            )
            if opts.kinds.get("partition", 0) > 0:
                # The first candidate runs on a host of its own (a network
                # namespace), which the partition fault cuts off.
                self.netns_host = NetnsHost().create()
            for i in range(opts.candidates):
                cand = _Candidate(self, f"c{i + 1}", host=self.netns_host if i == 0 else None)
                self.candidates.append(cand)
                cand.ensure_running()
            self._wait_for_leaders(30)
            if opts.beats:
                self._start_beat_part()
            if opts.workers:
                self._start_worker_part()
            self._schedule(progress)
            for thread in self._threads:
                thread.join(60)
            # Every candidate up again, then quiet: every role must have a
            # leader. The quiet window outlasts a campaign's longest backoff
            # after JetStream recovers (BACKOFF_MAX_SECONDS), and candidates
            # that exit in it (a stop still running its callbacks when the
            # window began) are started again: the window judges the election,
            # not whether a candidate happened to be running.
            self._wait_for_the_bucket(60)
            quiet = opts.quiet or max(3 * opts.ttl, BACKOFF_MAX_SECONDS + opts.ttl) + 2
            self.log.emit("quiet", seconds=quiet)
            until = time.monotonic() + quiet
            while True:
                for cand in self.candidates:
                    with self._bucket_lock:
                        cand.ensure_running()
                left = until - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(0.2, left))
            self.log.emit("done")
            # Every task sent has run (the workers are still up); then the
            # beats stop, and their worker runs the ticks they dispatched.
            self._stop_worker_part()
            beats = [c for c in self.candidates if c.kind == "beat"]
            for cand in beats:
                if cand.alive:
                    assert cand.process is not None
                    cand.process.terminate()
            for cand in beats:
                if cand.process is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        cand.process.wait(30)
            self._stop_beat_part()
            for cand in self.candidates:
                if cand.alive:
                    assert cand.process is not None
                    cand.process.terminate()
            for cand in self.candidates:
                if cand.process is not None:
                    try:
                        cand.process.wait(3 * opts.ttl + 10)
                    except subprocess.TimeoutExpired:
                        cand.process.kill()
                        cand.process.wait()
                        cand.note_end("killed")
                    cand.note_end("exited")
        finally:
            self._stop.set()
            for cand in self.candidates:
                cand.close()
            if self.worker is not None and self.worker.poll() is None:
                self.worker.kill()
                self.worker.wait()
            self.cluster.close()
            if self.netns_host is not None:
                self.netns_host.close()
            self.log.close()
        events = load_events(self.events_dir)
        # The documented loss window: a beat killed between committing a tick
        # and publishing it loses that tick; at most one per beat crash.
        beat_names = {c.name for c in self.candidates if c.beat}
        window = sum(
            1
            for e in events
            if e.kind == "fault" and e.get("fault") == "sigkill" and e.get("target") in beat_names
        )
        report = check(
            events,
            ttl=opts.ttl,
            loss_window_ticks=window,
            # kombu's Redis transport pops a message before recording it.
            broker_pop_window=bool(opts.workers) and self._tasks_on_redis,
        )
        for error in self.errors:
            logger.warning("soak: %s", error)
        return report

    def _wait_for_leaders(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if set(self._refresh_leaders()) >= set(self.roles):
                return
            time.sleep(0.05)
        raise RuntimeError(f"no leader for every role within {timeout}s; see {self.logs_dir}")

    def _setup_pg(self) -> None:
        """Create the fence's table (Django's migration, in a process of its own)."""
        result = subprocess.run(
            [sys.executable, "-m", CHILD_MODULE, "--migrate"],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"migrating the PostgreSQL fence failed:\n{result.stderr}")


class _SingleServer:
    """One nats-server behind the few :class:`NatsCluster` calls a soak makes."""

    def __init__(self, server: NatsServer) -> None:
        self._server = server

    @property
    def servers(self) -> list[NatsServer]:
        return [self._server]

    @property
    def urls(self) -> list[str]:
        return [self._server.url]

    def __len__(self) -> int:
        return 1

    def start(self) -> None:
        self._server.start()

    def kill(self, index: int) -> None:
        self._server.kill()

    def restart(self, index: int) -> None:
        self._server.restart(graceful=False)  # already killed: simply started

    def close(self) -> None:
        self._server.close()


def child_env() -> dict[str, str]:
    """This environment, with the repository root importable (``-m tests.chaos.soak_child``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def drain_worker(
    broker_url: str,
    queue: str,
    worker: str,
    timeout: float,
    transport_options: dict[str, Any] | None = None,
) -> bool:
    """Wait until a Celery worker has nothing left to run; whether it got there.

    A tick reaches the worker and may still be far from running: the
    once-guard that cannot claim its id (NATS unreachable under a fault)
    retries it ``lease / 3`` seconds later (10 s by default), and the retry
    waits in the worker as a scheduled task. Stopping the worker then leaves
    the tick in the broker, unrun, and the checker would count a tick lost
    that the system still delivers. So a soak stops its worker only once
    ``queue`` is empty and ``worker`` (which needs remote control) reports
    nothing active, reserved or scheduled, twice in a row. The queue is read
    on both sides of the inspection: a message moving from the queue into the
    worker is seen in one or the other.

    Args:
        broker_url: The broker (Redis or RabbitMQ: remote control needs a
            broadcast).
        queue: The worker's queue.
        worker: The worker's node name (``name@host``).
        timeout: Seconds to wait at most.
        transport_options: The broker transport options of the worker's app.

    Returns:
        Whether the worker was idle before ``timeout``.

    """
    from celery import Celery

    app = Celery("cnl-soak-drain", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = transport_options or {}
    deadline = time.monotonic() + timeout
    idle_in_a_row = 0
    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel

            def queued() -> int:
                # Declared as the worker declares it (Celery's default: durable),
                # not passively: a Redis queue exists only through a binding.
                ok = channel.queue_declare(queue=queue, durable=True, auto_delete=False)
                return int(ok.message_count)

            while time.monotonic() < deadline:
                idle = queued() == 0
                if idle:
                    inspect = app.control.inspect(destination=[worker], timeout=1.0)
                    for replies in (inspect.active(), inspect.reserved(), inspect.scheduled()):
                        if not replies or worker not in replies or replies[worker]:
                            idle = False
                            break
                idle = idle and queued() == 0
                idle_in_a_row = idle_in_a_row + 1 if idle else 0
                if idle_in_a_row >= 2:
                    return True
                time.sleep(0.5)
    finally:
        app.close()
    return False


def run_soak(options: SoakOptions, progress: Callable[[str], None] | None = None) -> Report:
    """Run one soak and return the checker's report.

    Args:
        options: What to run.
        progress: Called with a line of progress now and then.

    Returns:
        The report.

    """
    return Soak(options).run(progress)


def _pg_connect() -> Any:
    import psycopg2  # type: ignore[import-untyped]

    db = pg_settings()["DATABASES"]["default"]
    return psycopg2.connect(
        host=db["HOST"],
        port=db["PORT"],
        user=db["USER"],
        password=db["PASSWORD"],
        dbname=db["NAME"],
        connect_timeout=3,
    )


def postgres_reachable() -> bool:
    """Whether the PostgreSQL fence's database answers (``CNL_PG_*``, db ``test``)."""
    try:
        import psycopg2
    except ImportError:
        return False
    try:
        _pg_connect().close()
    except psycopg2.Error:
        return False
    return True


def kinds_from(names: Sequence[str]) -> dict[str, float]:
    """The weights of :data:`FAULT_KINDS` restricted to ``names``.

    Raises:
        ValueError: On an unknown kind.

    """
    unknown = [n for n in names if n not in FAULT_KINDS]
    if unknown:
        raise ValueError(
            f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(FAULT_KINDS)}"
        )
    return {n: FAULT_KINDS[n] for n in names}
