"""Harness of the beat tests: real ``celery beat`` replicas, a real worker, a real nats-server.

``BeatCluster`` starts ``celery -A cnl_beat_app beat`` replicas (or ``worker
-B``) and a worker that records every executed tick in the ledger, and a
``KVRecorder`` that records, from the test process, every write to the beat
role's key and to the schedule state bucket, so that the assertions
(:mod:`cnl_beat_checks`) can tell who wrote what under which term.

Brokers (``tests.support.brokers``), processes (``tests.support.procs``) and
the ledger's plumbing (``tests.support.ledger``) are shared with
``tests/celery``. Brokers: kombu's filesystem transport always runs. Redis and RabbitMQ are used
at their usual local ports (or ``CNL_REDIS_URL`` / ``CNL_AMQP_URL``); when
``CI=true`` they must be reachable (the test fails), elsewhere a missing one
is skipped with the reason. Django tests use PostgreSQL (``CNL_PG_*``, default
127.0.0.1:5432, database ``test``, user ``postgres`` or ``root``, trust auth)
in a schema of their own, or SQLite when PostgreSQL is unreachable outside CI.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
from cnl_beat_ledger import BeatLedger, Run
from nats.js.api import KeyValueConfig

from celery_nats_leader.beat.schedule_store import EntryState, decode_state, state_key
from celery_nats_leader.beat.ticks import slot_text
from celery_nats_leader.core.backend import Operation
from celery_nats_leader.core.errors import RecordFormatError
from celery_nats_leader.core.loop_thread import EventLoopThread
from celery_nats_leader.nats.jetstream import kv_operation
from celery_nats_leader.ops.seed import SEED_WRITER
from celery_nats_leader.term.record import LeaderRecord, decode_record
from celery_nats_leader.testing import NatsServer
from tests.support import REPO
from tests.support.brokers import Broker
from tests.support.key_history import copies_of, key_of, republish
from tests.support.procs import Proc
from tests.support.services import wait_for

HERE = Path(__file__).resolve().parent
CELERY = str(Path(sys.executable).parent / "celery")
PG_HOST = os.environ.get("CNL_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("CNL_PG_PORT", "5432"))
PG_DB = os.environ.get("CNL_PG_DB", "test")

#: Election TTL of the tests (seconds): short, to keep the suite to minutes.
TTL = 1.5
#: Room for what a busy 2-core machine adds to any deadline (process
#: scheduling, the worker's broker polling, the catch-up burst after a
#: failover): semantic bounds below are "what the design promises + SLACK".
SLACK = 3.0
#: Longest a crash or a pause may leave the role without a scheduler: the key
#: expires at most TTL after the last renewal, then a follower takes over.
FAILOVER = TTL + SLACK

BEAT_ROLE = "beat"
LEADERS_BUCKET = "leaders"
STATE_BUCKET = "leaders_beat"


# ------------------------------------------------------------- databases


@dataclass
class Database:
    """Django ``DATABASES['default']`` for the subprocesses."""

    vendor: str
    settings: dict[str, Any]
    cleanup: Callable[[], None] = lambda: None


def pg_connect(user: str) -> Any:
    import psycopg2

    return psycopg2.connect(host=PG_HOST, port=PG_PORT, dbname=PG_DB, user=user, connect_timeout=3)


# --------------------------------------------------------------- KV recorder


@dataclass(frozen=True)
class Observed:
    """One write seen by the recorder."""

    bucket: str
    key: str
    revision: int
    deleted: bool
    value: bytes
    mono: float


class KVRecorder:
    """Records every write to the beat role's key and to the schedule state bucket.

    Every write: a KV watch would not do. The buckets keep one value a key
    (history 1), so a revision replaced before a watch's consumer sent it is
    gone from the stream and never delivered (a release and the successor's
    claim milliseconds apart, on a loaded machine). The buckets made by
    :func:`create_buckets` republish each stored message with its sequence to
    a core subject, which this reads; what the buckets hold when it starts
    is read first.
    """

    #: What is recorded: the beat role's key, every key of the state bucket.
    WATCHED = ((LEADERS_BUCKET, BEAT_ROLE), (STATE_BUCKET, ">"))

    def __init__(self, url: str) -> None:
        self.url = url
        #: Every write seen, in revision order within each bucket.
        self.seen: list[Observed] = []
        self._revisions: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._loop = EventLoopThread(name="kv-recorder")
        self._nc: Any = None

    def start(self) -> None:
        self._loop.start()
        self._loop.run(self._start(), 20)

    async def _start(self) -> None:
        self._nc = await nats.connect(self.url)
        for bucket, key in self.WATCHED:

            async def copied(msg: Any, bucket: str = bucket) -> None:
                headers = msg.headers or {}
                revision = int(headers["Nats-Sequence"])
                self._record(bucket, key_of(bucket, msg.subject), headers, msg.data, revision)

            await self._nc.subscribe(copies_of(bucket, key), cb=copied)
        await self._nc.flush()
        js = self._nc.jetstream()
        for bucket, key in self.WATCHED:
            stream = f"KV_{bucket}"
            info = await js.stream_info(stream, subjects_filter=f"$KV.{bucket}.{key}")
            assert info.config.republish is not None, f"{bucket}: not made by create_buckets"
            for subject in info.state.subjects or {}:
                try:
                    msg = await js.get_msg(stream, subject=subject, direct=False)
                except nats.js.errors.NotFoundError:
                    continue  # expired (max_age) since the listing
                name = key_of(bucket, subject)
                self._record(bucket, name, msg.headers, msg.data, int(msg.seq or 0))

    def rewatch(self) -> None:
        """Read the buckets again on a new connection: after a server restart.

        The old connection may still be reconnecting; what was written while
        the recorder had no subscription is read from the buckets (their
        latest value a key), and writes already seen are not recorded twice.
        """

        async def rewatch() -> None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            await self._start()

        self._loop.run(rewatch(), 30)

    def _record(
        self,
        bucket: str,
        key: str,
        headers: dict[str, str] | None,
        data: bytes | None,
        revision: int,
    ) -> None:
        observed = Observed(
            bucket,
            key,
            revision,
            kv_operation(headers) is not Operation.PUT,
            bytes(data or b""),
            time.monotonic(),
        )
        with self._lock:
            if (bucket, revision) in self._revisions:
                return  # the value read at a start, republished too
            self._revisions.add((bucket, revision))
            # In revision order: a start's read may come after a later write's copy.
            bisect.insort(self.seen, observed, key=lambda s: (s.bucket, s.revision))

    def stop(self) -> None:
        if not self._loop.is_running:
            return

        async def stop() -> None:
            if self._nc is not None:
                await self._nc.close()

        with contextlib.suppress(Exception):
            self._loop.run(stop(), 10)
        self._loop.stop()

    # ----------------------------------------------------------- queries

    def terms(self) -> dict[int, LeaderRecord]:
        """Every term of the beat role seen: epoch -> record."""
        found: dict[int, LeaderRecord] = {}
        with self._lock:
            seen = list(self.seen)
        for item in seen:
            if item.bucket != LEADERS_BUCKET or item.deleted:
                continue
            try:
                record = decode_record(item.value, item.revision)
            except RecordFormatError:
                continue
            found.setdefault(record.epoch, record)
        return found

    def leader(self) -> LeaderRecord | None:
        """The latest record of the beat role (``None`` after a release or before any)."""
        with self._lock:
            seen = [s for s in self.seen if s.bucket == LEADERS_BUCKET]
        if not seen or seen[-1].deleted:
            return None
        last = seen[-1]
        return decode_record(last.value, last.revision)

    def state_writes(self, name: str) -> list[tuple[Observed, EntryState]]:
        key = state_key(BEAT_ROLE, name)
        with self._lock:
            seen = [s for s in self.seen if s.bucket == STATE_BUCKET and s.key == key]
        return [(s, decode_state(s.value, s.revision)) for s in seen if not s.deleted]

    def all_state_writes(self) -> list[tuple[Observed, EntryState]]:
        with self._lock:
            seen = [s for s in self.seen if s.bucket == STATE_BUCKET and not s.deleted]
        return [(s, decode_state(s.value, s.revision)) for s in seen]


async def create_buckets(url: str, ttl: float) -> None:
    """Create the buckets as an operator would (the schedulers do not create them)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        # Both republish every write for the recorder (tests.support.key_history).
        await js.create_key_value(
            KeyValueConfig(
                bucket=LEADERS_BUCKET, history=1, ttl=ttl, republish=republish(LEADERS_BUCKET)
            )
        )
        await js.create_key_value(
            KeyValueConfig(bucket=STATE_BUCKET, history=1, republish=republish(STATE_BUCKET))
        )
    finally:
        await nc.close()


# ------------------------------------------------------------------ cluster


class BeatCluster:
    """Three (or more) beat replicas and a worker around one nats-server."""

    def __init__(
        self,
        tmp_path: Path,
        nats_server: NatsServer,
        broker: Broker,
        *,
        entries: list[dict[str, Any]],
        scheduler: str = "nats_leader",
        database: Database | None = None,
        ttl: float = TTL,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.tmp = tmp_path
        self.nats = nats_server
        self.broker = broker
        self.ttl = ttl
        self.entries = entries
        self.queue = f"cnl-beat-{uuid.uuid4().hex[:8]}"
        broker.queues.add(self.queue)
        self.ledger_path = str(tmp_path / "ledger.sqlite3")
        self.ledger = BeatLedger(self.ledger_path)
        self.ledger.create()
        self.t0 = time.time()
        self.config: dict[str, Any] = {
            "broker_url": broker.url,
            "broker_transport_options": broker.transport_options,
            "queue": self.queue,
            "nats_url": nats_server.url,
            "bucket": LEADERS_BUCKET,
            "beat_role": BEAT_ROLE,
            "ttl": ttl,
            "ledger": self.ledger_path,
            "entries": entries,
            "t0": self.t0,
            "speed": 60,
            "max_interval": 0.2,
            "scheduler": scheduler,
            "extra": extra or {},
        }
        self.database = database
        if database is not None:
            self.config["django"] = True
        self.scheduler = scheduler
        #: A program each ``celery beat`` is started under (its argv prefix),
        #: e.g. single-beat; with its environment variables.
        self.beat_wrapper: list[str] = []
        self.wrapper_env: dict[str, str] = {}
        asyncio.run(create_buckets(nats_server.url, ttl))
        self.recorder = KVRecorder(nats_server.url)
        self.recorder.start()
        self.beats: list[Proc] = []
        self.embedded: list[Proc] = []
        self.workers: list[Proc] = []
        self.started_at = time.monotonic()

    # ------------------------------------------------------------ set-up

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CNL_BEAT_CONFIG"] = json.dumps(self.config)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO)])
        env.pop("DJANGO_SETTINGS_MODULE", None)
        if self.database is not None:
            env["CNL_BEAT_DB"] = json.dumps(self.database.settings)
            env["DJANGO_SETTINGS_MODULE"] = "cnl_beat_django"
        return env

    def django_setup(self) -> None:
        """Migrate and create the entries' rows (as a deployment would, once)."""
        result = subprocess.run(
            [sys.executable, "-m", "cnl_beat_django", "setup"],
            env=self.env,
            cwd=str(HERE),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr

    def start_worker(self, *, pool: str = "threads", concurrency: int = 4) -> Proc:
        index = len(self.workers)
        proc = Proc(
            f"worker{index}",
            [
                CELERY,
                "-A",
                "cnl_beat_app",
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-Q",
                self.queue,
                "-n",
                f"w{index}-{self.queue}@%h",
                "-l",
                "INFO",
            ],
            env=self.env,
            log_path=self.tmp / f"worker{index}.log",
            cwd=HERE,
        )
        self.workers.append(proc)
        return proc

    def start_beat(self) -> Proc:
        index = len(self.beats)
        proc = Proc(
            f"beat{index}",
            [
                *self.beat_wrapper,
                CELERY,
                "-A",
                "cnl_beat_app",
                "beat",
                "-S",
                self.scheduler,
                "-s",
                str(self.tmp / f"schedule{index}"),
                "-l",
                "INFO",
            ],
            env={**self.env, **self.wrapper_env},
            log_path=self.tmp / f"beat{index}.log",
            cwd=HERE,
        )
        self.beats.append(proc)
        return proc

    def start_embedded(self, extra: dict[str, Any] | None = None) -> Proc:
        """A worker with its embedded beat (``celery worker -B``).

        It consumes a queue of its own, so that stopping it at the end loses
        no tick: the plain worker executes them. ``extra`` adds
        ``nats_leader_*`` settings for this process only (its ports).
        """
        index = len(self.embedded)
        env = self.env
        if extra:
            config = dict(self.config, extra={**self.config["extra"], **extra})
            env["CNL_BEAT_CONFIG"] = json.dumps(config)
        proc = Proc(
            f"worker-B{index}",
            [
                CELERY,
                "-A",
                "cnl_beat_app",
                "worker",
                "-B",
                # (for `celery worker`, -S is --statedb)
                "--scheduler",
                self.scheduler,
                "-s",
                str(self.tmp / f"schedule-w{index}"),
                "-P",
                "prefork",
                "-c",
                "2",
                "-Q",
                f"{self.queue}-idle",
                "-n",
                f"wb{index}-{self.queue}@%h",
                "-l",
                "INFO",
            ],
            env=env,
            log_path=self.tmp / f"worker-B{index}.log",
            cwd=HERE,
        )
        self.embedded.append(proc)
        return proc

    # ----------------------------------------------------------- queries

    def runs(self, entry: str | None = None) -> list[Run]:
        runs = [r for r in self.ledger.runs() if r.entry is not None and r.tick is not None]
        return [r for r in runs if entry is None or r.entry == entry]

    def leader_pid(self) -> int | None:
        record = self.recorder.leader()
        if record is None:
            return None
        pid = record.meta.get("pid")
        return int(pid) if pid is not None else None

    def beat_by_pid(self, pid: int) -> Proc | None:
        """The replica whose beat runs as ``pid`` (a beat, or a worker hosting it)."""
        for proc in self.beats:
            if proc.pid == pid:
                return proc
        for proc in self.embedded:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(pid) == proc.pid:
                    return proc
        return None

    def leading(self, record: LeaderRecord) -> Proc:
        """The replica whose beat holds the term ``record`` (by the pid it carries)."""
        proc = self.beat_by_pid(int(record.meta["pid"]))
        assert proc is not None, (record, self.diagnostics())
        return proc

    def kill_leader(self, record: LeaderRecord) -> Proc:
        """SIGKILL the replica that holds the term ``record`` (a crash) and reap it."""
        proc = self.leading(record)
        proc.signal(signal.SIGKILL)
        proc.wait(10)
        return proc

    def wait_new_term(self, after: int, timeout: float = FAILOVER + 10) -> LeaderRecord:
        """Wait for a term of the beat role newer than epoch ``after``."""

        def found() -> LeaderRecord | None:
            record = self.recorder.leader()
            return record if record is not None and record.epoch > after else None

        return wait_for(found, timeout, f"a beat term after epoch {after}", self.diagnostics)

    def drain(self) -> None:
        """Stop every scheduler, then wait until the worker ran every committed tick.

        A seeded state (``seed-beat``) is not one: the previous scheduler sent it.
        """
        for proc in [*self.beats, *self.embedded]:
            proc.stop()

        def executed_all() -> bool:
            runs = {(r.entry, r.tick) for r in self.runs()}
            for spec in self.entries:
                writes = [
                    (seen, state)
                    for seen, state in self.recorder.state_writes(spec["name"])
                    if state.by != SEED_WRITER
                ]
                final = writes[-1][1] if writes else None
                if (
                    final is not None
                    and final.runs
                    and (spec["name"], slot_text(final.slot)) not in runs
                ):
                    return False
            return True

        wait_for(executed_all, 30, "the worker to execute every committed tick", self.diagnostics)

    def wait_leader(self, exclude: tuple[Proc, ...] = (), timeout: float = 30.0) -> LeaderRecord:
        """Wait for a term held by a replica not in ``exclude``."""
        excluded = {p.pid for p in exclude}

        def found() -> LeaderRecord | None:
            record = self.recorder.leader()
            if record is None:
                return None
            proc = self.beat_by_pid(int(record.meta.get("pid", 0)))
            return record if proc is not None and proc.pid not in excluded else None

        return wait_for(found, timeout, f"a beat leader not in {exclude}", self.diagnostics)

    def wait_runs_by(self, epoch: int, count: int, timeout: float = 30.0) -> None:
        """Wait until ``count`` ticks of every entry were executed under ``epoch``."""

        def done() -> bool:
            runs = self.runs()
            return all(
                sum(1 for r in runs if r.entry == e["name"] and r.epoch == epoch) >= count
                for e in self.entries
                if e["kind"] != "cron"
            )

        wait_for(
            done, timeout, f"{count} ticks of every entry under epoch {epoch}", self.diagnostics
        )

    def operator(
        self, *args: str, config: dict[str, Any] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``celery nats-leader ARGS``, run to completion with ``config`` (default: ours)."""
        env = dict(self.env, CNL_BEAT_CONFIG=json.dumps(self.config if config is None else config))
        return subprocess.run(
            [CELERY, "-A", "cnl_beat_app", "nats-leader", *args],
            env=env,
            cwd=str(HERE),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def diagnostics(self) -> str:
        terms = sorted(self.recorder.terms().items())
        parts = [
            f"terms: {[(e, r.id, r.meta.get('pid')) for e, r in terms]}",
            f"runs: {[(r.entry, r.tick, r.epoch) for r in self.runs()][-30:]}",
        ]
        for proc in [*self.beats, *self.embedded, *self.workers]:
            parts.append(f"--- {proc} log tail:\n{proc.log()[-4000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in [*self.beats, *self.embedded, *self.workers]:
            with contextlib.suppress(Exception):
                proc.signal(signal.SIGCONT)
        for proc in [*self.beats, *self.embedded, *self.workers]:
            proc.stop()
        self.recorder.stop()
        self.ledger.close()
