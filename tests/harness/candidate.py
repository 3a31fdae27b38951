"""One election candidate per process: the child program.

Tests, benchmarks and demos need candidates that can crash (SIGKILL), freeze
(SIGSTOP) and stop gracefully (SIGTERM) like real processes.
``python -m tests.harness.candidate --url URL --role R --ttl T
--id NAME [...]`` runs one :class:`~celery_nats_leader.KvElection` and prints one
JSON line per event on stdout, e.g.
``{"event": "promoted", "id": "c1", "at": 1234.5, "pid": 42, "epoch": 7}``.
``at`` is :func:`time.monotonic` in the child: on Linux that clock is shared by
every process of the host, so the parent may compare the times of different
children (never across hosts). Events:

============ ===============================================================
ready        ``start()`` returned (``state``, ``leader_id``)
promoted     this candidate leads (``epoch``)
demoted      it stopped leading (``reason``, a :class:`DemoteReason` value)
leader       the leader it observes changed (``leader_id``, ``epoch``)
renewed      a renewal was confirmed (``sent``: when it was sent; the lease
             runs until ``sent + ttl - lease_margin``)
validate     answer to ``validate`` (``result``, ``epoch``)
status       answer to ``status`` (``status``: :meth:`KvElection.describe`)
resigned     answer to ``resign``
disconnected its NATS connection went down
reconnected  its NATS connection is back
error        a permanent error stopped the election (``error``, ``message``)
stopped      ``stop()`` returned (after SIGTERM, SIGINT, ``stop`` or EOF)
============ ===============================================================

Commands, one per line on stdin: ``validate``, ``status``, ``resign``, ``stop``.

The parent side (spawning, events, signals) is
:mod:`tests.harness.candidate_control`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from celery_nats_leader import DemoteReason, ElectionConfig, ElectionError, KvElection
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats import ConnectionListener, open_backend
from celery_nats_leader.term.record import LeaderRecord
from celery_nats_leader.term.token import FencingToken

__all__ = ["main"]


class _Printer:
    """Prints one JSON line per event; thread-safe, flushed at once."""

    def __init__(self, name: str, out: TextIO) -> None:
        self._name = name
        self._out = out
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps(
            {"event": event, "id": self._name, "at": time.monotonic(), "pid": os.getpid(), **fields}
        )
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


class _RenewalPrinter:
    """An election observer that prints each confirmed renewal's send time."""

    def __init__(self, printer: _Printer) -> None:
        self._printer = printer

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        """Ignore (the callbacks report what matters)."""

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        """Ignore."""

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        """Print ``renewed`` with the send time of a confirmed renewal."""
        if ok:
            self._printer.emit("renewed", sent=time.monotonic() - seconds)

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        """Ignore."""


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.harness.candidate",
        description="Run one leader-election candidate; print its events as JSON lines.",
    )
    parser.add_argument(
        "--url", action="append", required=True, help="NATS URL (repeat for a cluster)"
    )
    parser.add_argument("--id", dest="name", required=True, help="the instance id")
    parser.add_argument("--role", default="default")
    parser.add_argument("--bucket", default="leaders")
    parser.add_argument("--ttl", type=float, default=2.0, help="seconds (the bucket's max_age)")
    parser.add_argument("--priority", type=int, default=0)
    parser.add_argument("--allow-takeover", action="store_true")
    parser.add_argument("--fast-failover", action="store_true")
    parser.add_argument("--create-bucket", action="store_true")
    parser.add_argument("--replicas", type=int, default=1, help="when creating the bucket")
    parser.add_argument("--heartbeat", type=float, default=0.0, help="0: ttl / 4")
    parser.add_argument("--request-timeout", type=float, default=0.0)
    parser.add_argument("--disconnect-grace", type=float, default=0.0)
    parser.add_argument("--validation-interval", type=float, default=0.0)
    parser.add_argument("--no-release-on-stop", action="store_true")
    parser.add_argument(
        "--health-file",
        help="health check: healthy while this file exists (remove it to fail the check)",
    )
    parser.add_argument("--health-failures", type=int, default=0, help="0: the default")
    parser.add_argument("--reconnect-wait", type=float, default=None, help="seconds")
    parser.add_argument(
        "--stop-on-eof",
        action="store_true",
        help="stop gracefully when stdin closes (the parent went away)",
    )
    parser.add_argument("--log-level", help="configure logging to stderr at this level")
    parser.add_argument(
        "--no-leader-events",
        action="store_true",
        help="do not print leader changes (benchmarks: a follower then does no more "
        "work on a change than a user's would)",
    )
    return parser.parse_args(argv)


def _stdin_lines(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[str | None]) -> None:
    """Forward stdin lines to the loop, then ``None`` at end of file.

    A thread, because stdin may be ``/dev/null`` (which epoll refuses), and
    raw ``os.read`` on the descriptor, because a daemon thread blocked inside
    ``sys.stdin`` would hold its buffer lock while the interpreter shuts down.
    """
    buffer = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            break
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            with contextlib.suppress(RuntimeError):  # the loop is closed: we are exiting
                loop.call_soon_threadsafe(lines.put_nowait, line.decode(errors="replace").strip())
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(lines.put_nowait, None)


class _ConnectionEvents(ConnectionListener):
    """Reports the connection's state changes, and wakes the election on them.

    The candidate owns its connection (as the Elector does), so it must pass
    these on: the election applies its disconnect grace when woken.
    """

    def __init__(self, printer: _Printer) -> None:
        self._printer = printer
        self.election: KvElection | None = None

    def disconnected(self) -> None:
        self._printer.emit("disconnected")
        if self.election is not None:
            self.election.wake()

    def reconnected(self) -> None:
        self._printer.emit("reconnected")
        if self.election is not None:
            self.election.wake()


async def _run(args: argparse.Namespace, printer: _Printer) -> int:
    options: dict[str, Any] = {}
    if args.reconnect_wait is not None:
        options["reconnect_time_wait"] = args.reconnect_wait
    extra: dict[str, Any] = {}
    if args.health_file:
        health_file: str = args.health_file

        def healthy() -> bool:
            return os.path.exists(health_file)

        extra["health_check"] = healthy
    if args.health_failures:
        extra["health_check_failures"] = args.health_failures
    config = ElectionConfig(
        role=args.role,
        bucket=args.bucket,
        instance_id=args.name,
        ttl=args.ttl,
        heartbeat_interval=args.heartbeat,
        request_timeout=args.request_timeout,
        disconnect_grace=args.disconnect_grace,
        validation_interval=args.validation_interval,
        priority=args.priority,
        allow_takeover=args.allow_takeover,
        fast_failover=args.fast_failover,
        create_bucket=args.create_bucket,
        bucket_replicas=args.replicas,
        release_on_stop=not args.no_release_on_stop,
        **extra,
    )
    urls = tuple(u for url in args.url for u in url.split(",") if u)
    listener = _ConnectionEvents(printer)
    try:
        backend = await open_backend(
            ConnectOptions(servers=urls, options=options), listeners=[listener], name=args.name
        )
    except ElectionError as exc:
        printer.emit("error", error=type(exc).__name__, message=str(exc))
        return 2
    async with backend:
        election = KvElection(config, backend, observer=_RenewalPrinter(printer))
        return await _elect(args, printer, election, listener)


async def _elect(
    args: argparse.Namespace, printer: _Printer, election: KvElection, listener: _ConnectionEvents
) -> int:
    listener.election = election
    failed = asyncio.Event()

    # Async callbacks run on the loop right after the event: the times printed
    # are as close to the state change as a callback can be.
    @election.on_promote
    async def _promoted(token: FencingToken) -> None:
        printer.emit("promoted", epoch=token.epoch)

    @election.on_demote
    async def _demoted(reason: DemoteReason) -> None:
        printer.emit("demoted", reason=reason.value)

    async def _leader(record: LeaderRecord | None) -> None:
        printer.emit(
            "leader",
            leader_id=None if record is None else record.id,
            epoch=None if record is None else record.epoch,
        )

    if not args.no_leader_events:
        election.on_leader_change(_leader)

    @election.on_error
    async def _error(exc: ElectionError) -> None:
        printer.emit("error", error=type(exc).__name__, message=str(exc))
        failed.set()

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await election.start()
    except ElectionError as exc:
        printer.emit("error", error=type(exc).__name__, message=str(exc))
        return 2
    printer.emit("ready", state=election.state.value, leader_id=election.leader_id)

    lines: asyncio.Queue[str | None] = asyncio.Queue()
    threading.Thread(target=_stdin_lines, args=(loop, lines), daemon=True).start()

    async def serve() -> None:
        while True:
            line = await lines.get()
            if line is None:
                if args.stop_on_eof:
                    stop.set()
                return
            if line == "validate":
                result = await election.validate_token()
                token = election.token
                printer.emit("validate", result=result, epoch=token.epoch if token else None)
            elif line == "status":
                printer.emit("status", status=election.describe())
            elif line == "resign":
                await election.resign()
                printer.emit("resigned")
            elif line == "stop":
                stop.set()
            elif line:
                printer.emit("unknown_command", command=line)

    server = loop.create_task(serve())
    stopping = loop.create_task(stop.wait())
    failing = loop.create_task(failed.wait())
    await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    for task in (server, stopping, failing):
        task.cancel()
    await asyncio.gather(server, stopping, failing, return_exceptions=True)
    await election.stop()
    printer.emit("stopped")
    return 2 if failed.is_set() else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one candidate until SIGTERM/SIGINT, ``stop`` on stdin, or a permanent error.

    Args:
        argv: Command line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 after a graceful stop, 2 after an election error.

    """
    args = _parse_args(argv)
    if args.log_level:
        logging.basicConfig(
            level=args.log_level.upper(),
            stream=sys.stderr,
            format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
        )
    return asyncio.run(_run(args, _Printer(args.name, sys.stdout)))


if __name__ == "__main__":
    sys.exit(main())
