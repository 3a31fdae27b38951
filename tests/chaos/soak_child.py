"""One soak candidate: elections for several roles, fenced writes while leading.

``python -m tests.chaos.soak_child --url URL --id c1 --roles a,b
--events DIR --fence FILE [--pg]`` campaigns for every role on one connection
and appends its events to ``DIR/<id>.jsonl`` (see
:mod:`tests.chaos.checker` for the format): ``promote`` and
``demote`` from the election callbacks, and ``write`` for every fenced write
it attempts while it believes it leads (every ``--write-interval`` seconds
per role):

* to a file fence (``--fence``): a JSON file of the highest epoch accepted per
  role, read and written under a POSIX record lock; a lower epoch is refused.
  The event is written while the lock is held, so the events' times are the
  resource's order;
* with ``--pg``, through :func:`django_nats_leader.fencing.fenced` to the
  ``FenceEpoch`` row of the role in PostgreSQL (``CNL_PG_*`` environment
  variables, database ``test`` by default), inside a transaction whose commit
  is recorded after it returned.

``--fast-failover`` sets ``fast_failover=True``: the leader names a successor,
which takes over about a second after it goes silent (whatever ``--ttl``).

A permanent election error (the bucket deleted) ends the process with status 2;
SIGTERM stops it gracefully (the roles are released).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery_nats_leader import DemoteReason, ElectionConfig, ElectionError, KvElection
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.backoff import Backoff
from celery_nats_leader.core.errors import is_transient
from celery_nats_leader.election.observer import NullObserver
from celery_nats_leader.nats.connection import ConnectionListener, open_backend
from celery_nats_leader.term.token import FencingToken

__all__ = ["EventLog", "FileFence", "main", "pg_settings"]

MODULE = "tests.chaos.soak_child"


class EventLog:
    """Appends one JSON line per event to a file; thread-safe, one ``write`` per line.

    Args:
        path: The file (created if missing, appended to).
        proc: The writer's name, in every line.

    """

    def __init__(self, path: str | os.PathLike[str], proc: str) -> None:
        self.proc = proc
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def emit(self, kind: str, t: float | None = None, **fields: Any) -> float:
        """Append an event stamped with :func:`time.monotonic` (or ``t``); returns the stamp."""
        with self._lock:
            stamp = time.monotonic() if t is None else t
            line = json.dumps({"t": stamp, "proc": self.proc, "kind": kind, **fields})
            os.write(self._fd, (line + "\n").encode())
            return stamp

    def close(self) -> None:
        """Close the file."""
        with contextlib.suppress(OSError):
            os.close(self._fd)


class FileFence:
    """An in-test fenced resource: the highest epoch per role, in a locked JSON file.

    Args:
        path: The file, shared by every candidate of the soak.

    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def reset(self) -> None:
        """Forget every epoch (an operator clearing the fence with a recreated bucket)."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the file."""
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def write(self, role: str, epoch: int, log: EventLog) -> bool:
        """Accept a write of ``epoch`` unless a higher one was accepted; record it.

        Returns:
            Whether the write was accepted.

        """
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            os.lseek(self._fd, 0, os.SEEK_SET)
            raw = b""
            while chunk := os.read(self._fd, 65536):
                raw += chunk
            state: dict[str, int] = json.loads(raw) if raw.strip() else {}
            accepted = epoch >= state.get(role, 0)
            if accepted and epoch > state.get(role, 0):
                state[role] = epoch
                data = json.dumps(state).encode()
                os.lseek(self._fd, 0, os.SEEK_SET)
                os.ftruncate(self._fd, 0)
                os.write(self._fd, data)
            log.emit("write", resource="file", role=role, epoch=epoch, accepted=accepted)
            return accepted
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)


def pg_settings() -> dict[str, Any]:
    """Django settings for the PostgreSQL fence (``CNL_PG_*`` variables, db ``test``)."""
    return {
        "DATABASES": {
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "HOST": os.environ.get("CNL_PG_HOST", "127.0.0.1"),
                "PORT": int(os.environ.get("CNL_PG_PORT", "5432")),
                "USER": os.environ.get("CNL_PG_USER", "postgres"),
                "PASSWORD": os.environ.get("CNL_PG_PASSWORD", ""),
                "NAME": os.environ.get("CNL_PG_DB", "test"),
            }
        },
        "INSTALLED_APPS": ["django_nats_leader"],
        "USE_TZ": True,
        "DEFAULT_AUTO_FIELD": "django.db.models.AutoField",
        "LOGGING_CONFIG": None,
    }


class _PgFence:
    def __init__(self, holder: str) -> None:
        import django
        from django.conf import settings

        if not settings.configured:
            settings.configure(**pg_settings())
            django.setup()
        self._holder = holder

    def write(self, role: str, token: FencingToken, log: EventLog) -> None:
        from django.db import close_old_connections

        from django_nats_leader.fencing import StaleLeaderError, fenced

        close_old_connections()
        try:
            with fenced(role, token, holder=self._holder):
                # Stamped while the row lock is held: the stamps of accepted
                # writes are in the database's commit order.
                locked_at = time.monotonic()
        except StaleLeaderError:
            log.emit("write", resource="pg", role=role, epoch=token.epoch, accepted=False)
            return
        log.emit("write", t=locked_at, resource="pg", role=role, epoch=token.epoch, accepted=True)


class _LeaseObserver(NullObserver):
    """Records each confirmed renewal's lease deadline (``renewed`` events).

    Called right after the renewal's answer: ``now - seconds`` is its send
    time, from which the lease runs. The checker ends a belief at the last
    deadline, even when a starved process writes its ``demote`` line late.
    """

    def __init__(self, log: EventLog, lease: float) -> None:
        self._log = log
        self._lease = lease

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        if ok:
            now = time.monotonic()
            self._log.emit("renewed", t=now, role=role, until=now - seconds + self._lease)


class _Waker(ConnectionListener):
    def __init__(self, elections: list[KvElection]) -> None:
        self._elections = elections

    def disconnected(self) -> None:
        for election in self._elections:
            election.wake()

    def reconnected(self) -> None:
        for election in self._elections:
            election.wake()


def _writer(
    args: argparse.Namespace,
    elections: Sequence[KvElection],
    log: EventLog,
    stop: threading.Event,
) -> None:
    fence = FileFence(args.fence) if args.fence else None
    pg = _PgFence(args.name) if args.pg else None
    while not stop.wait(args.write_interval):
        for election in elections:
            token = election.token
            if token is None:
                continue
            try:
                if fence is not None:
                    fence.write(election.role, token.epoch, log)
                if pg is not None:
                    pg.write(election.role, token, log)
            except Exception as exc:  # a database hiccup must not end the soak
                log.emit("write_error", role=election.role, error=repr(exc))


async def _run(args: argparse.Namespace, log: EventLog) -> int:
    urls = tuple(u for url in args.url for u in url.split(",") if u)
    roles = [r for r in args.roles.split(",") if r]
    elections: list[KvElection] = []
    try:
        backend = await open_backend(
            ConnectOptions(
                servers=urls,
                options={"reconnect_time_wait": 0.1},
            ),
            listeners=[_Waker(elections)],
            name=args.name,
            timeout=5.0,
        )
    except ElectionError as exc:
        log.emit("error", error=type(exc).__name__, message=str(exc))
        return 2
    failed = asyncio.Event()
    for role in roles:
        config = ElectionConfig(
            role=role,
            bucket=args.bucket,
            instance_id=args.name,
            ttl=args.ttl,
            priority=args.priority,
            fast_failover=args.fast_failover,
        )
        election = KvElection(config, backend, observer=_LeaseObserver(log, config.lease_seconds))

        def callbacks(election: KvElection, role: str) -> None:
            @election.on_promote
            async def _promoted(token: FencingToken) -> None:
                log.emit(
                    "promote", role=role, epoch=token.epoch, lease=election.config.lease_seconds
                )

            @election.on_demote
            async def _demoted(reason: DemoteReason) -> None:
                log.emit("demote", role=role, reason=reason.value)

            @election.on_error
            async def _error(exc: ElectionError) -> None:
                log.emit("error", role=role, error=type(exc).__name__, message=str(exc))
                failed.set()

        callbacks(election, role)
        elections.append(election)

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    stop_writer = threading.Event()
    writer = threading.Thread(
        target=_writer, args=(args, elections, log, stop_writer), name="fenced-writer", daemon=True
    )
    code = 0
    try:
        if not await _start_all(elections, log, stopping):
            code = 2
            return code
        log.emit("ready", roles=roles)
        writer.start()
        done = {loop.create_task(stopping.wait()), loop.create_task(failed.wait())}
        _, pending = await asyncio.wait(done, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        code = 2 if failed.is_set() else 0
    finally:
        stop_writer.set()
        if writer.is_alive():
            await asyncio.to_thread(writer.join, 5.0)
        await asyncio.gather(*(e.stop() for e in elections), return_exceptions=True)
        with contextlib.suppress(Exception):
            await backend.close()
        log.emit("stopped", code=code)
    return code


async def _start_all(elections: list[KvElection], log: Any, stopping: asyncio.Event) -> bool:
    """Start every election, retrying transient errors as the Celery layer does.

    A JetStream that answers "temporarily unavailable" (a cluster electing a
    stream leader, a store that was full) or a request that timed out is no
    reason for a candidate to give up: the worker and beat retry their start
    (``retry_transient``), and so does this child, until it is told to stop.
    Returns whether every election started (``False``: a permanent error, or
    a stop while retrying).
    """
    pending = list(elections)
    backoff = Backoff(maximum=1.0, breaker_threshold=1_000_000)
    while pending:
        attempted, pending = pending, []
        results = await asyncio.gather(
            *(e.start(wait=0) for e in attempted), return_exceptions=True
        )
        for election, result in zip(attempted, results, strict=True):
            if not isinstance(result, BaseException):
                continue
            log.emit("error", error=type(result).__name__, message=str(result))
            if not (isinstance(result, ElectionError) and is_transient(result)):
                return False
            pending.append(election)
        if pending:
            # (asyncio.TimeoutError: the builtin TimeoutError only from Python 3.11)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), backoff.failure())
            if stopping.is_set():
                return False
    return True


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    parser.add_argument("--migrate", action="store_true", help="create the PG fence's table")
    parser.add_argument("--url", action="append", help="NATS URL (repeatable)")
    parser.add_argument("--id", dest="name")
    parser.add_argument("--roles", help="comma-separated roles")
    parser.add_argument("--bucket", default="leaders")
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--priority", type=int, default=0)
    parser.add_argument("--events", help="directory of the event files")
    parser.add_argument("--fence", help="the file fence shared by the candidates")
    parser.add_argument("--pg", action="store_true", help="also write through the PG fence")
    parser.add_argument("--write-interval", type=float, default=0.1)
    parser.add_argument(
        "--fast-failover", action="store_true", help="fast_failover=True (designated successor)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the candidate until SIGTERM or a permanent election error.

    Returns:
        0 after a graceful stop, 2 after an election error.

    """
    args = _parse_args(argv)
    if args.migrate:
        _PgFence("migrate")
        from django.core.management import call_command

        call_command("migrate", "django_nats_leader", verbosity=0)
        return 0
    if not (args.url and args.name and args.roles and args.events):
        raise SystemExit("--url, --id, --roles and --events are required")
    log = EventLog(Path(args.events) / f"{args.name}.jsonl", args.name)
    try:
        return asyncio.run(_run(args, log))
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
