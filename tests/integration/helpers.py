"""Helpers of the integration tests (the fixtures are in conftest.py).

Two kinds of candidates:

* :class:`~celery_nats_leader.testing.CandidateGroup`: child processes
  (``python -m tests.harness.candidate``), for everything a
  process does to itself: crash (SIGKILL), freeze (SIGSTOP), stop (SIGTERM).
  Their events carry ``time.monotonic()`` of the child, which on Linux is the
  same clock as the test's, so times of different processes compare.
* :class:`LocalElections`: elections in the test's own event loop, when the
  test needs to look inside (logs, calls) or needs many of them (the herd).

Timing bounds are semantic (TTL, heartbeat, grace) plus a slack for a loaded
2-core machine; latency is what the benchmarks measure, not these tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig

from celery_nats_leader import DemoteReason, ElectionConfig, ElectionError, FencingToken, KvElection
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats import JetStreamBackend
from celery_nats_leader.nats.jetstream import REPLICATED_CREATE_SECONDS, kv_operation
from celery_nats_leader.term.record import LeaderRecord, decode_record
from celery_nats_leader.testing import NatsServer
from tests.harness.candidate_control import CandidateEvent, CandidateGroup
from tests.support.key_history import copies_of, republish

T = TypeVar("T")

#: The election TTL of most tests, seconds. Derived: heartbeat 0.5 s, request
#: timeout 0.25 s, lease margin 0.2 s (lease 1.8 s), disconnect grace 1 s.
TTL = 2.0
HEARTBEAT = TTL / 4
REQUEST_TIMEOUT = HEARTBEAT / 2
MARGIN = TTL / 10
LEASE = TTL - MARGIN
GRACE = 2 * HEARTBEAT
#: Scheduling noise allowed on top of a semantic bound: the machine has two
#: cores and other test suites run on it at the same time.
SLACK = 1.0
#: Clients reconnect fast, so that reconnect waits do not dominate the tests.
RECONNECT_WAIT = 0.1

BUCKET = "leaders"
ROLE = "job"


async def create_bucket(
    url: str | list[str], bucket: str = BUCKET, *, ttl: float = TTL, replicas: int = 1
) -> None:
    """Create an election bucket as an operator would (history 1, max_age = ttl).

    The server answers a replicated create once the new stream's RAFT group
    has elected a leader; a RAFT election timeout is seconds long, and on a
    loaded machine the answer once took more than nats-py's default 5 s
    (2.9.10, a 3-node cluster, CI's two lanes running). The wait is for that
    answer, not a second try.

    One addition, for :class:`KeyHistory`: the stream republishes every
    message it stores to the core subject ``_key_history.<bucket>.<key>``
    (nats-server 2.9 can set that only at creation). Nothing else reads it.
    """
    nc = await nats.connect(url)
    try:
        await nc.jetstream(timeout=REPLICATED_CREATE_SECONDS).create_key_value(
            KeyValueConfig(
                bucket=bucket,
                history=1,
                ttl=ttl,
                replicas=replicas,
                republish=republish(bucket),
            )
        )
    finally:
        await nc.close()


async def in_thread(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking call (a group's wait, a server restart) off the test's loop."""
    return await asyncio.to_thread(func, *args, **kwargs)


def candidate_group(url: str) -> CandidateGroup:
    """Candidate processes for ``ROLE`` in ``BUCKET`` on the server at ``url``, TTL ``TTL``."""
    return CandidateGroup(
        url,
        role=ROLE,
        bucket=BUCKET,
        ttl=TTL,
        log_level="INFO",
        reconnect_wait=RECONNECT_WAIT,
    )


def wait_follows(
    group: CandidateGroup, name: str, leader: str, *, timeout: float = 5.0
) -> CandidateEvent:
    """Wait until candidate ``name`` reports ``leader`` as the leader it observes."""
    return group.wait_for(
        "leader", {name}, timeout=timeout, where=lambda event: event["leader_id"] == leader
    )


def wait_connections(server: NatsServer, count: int, *, timeout: float = 5.0) -> list[str]:
    """Poll the server's monitoring until it counts ``count`` client connections.

    A client's close reaches the server a moment after ``close()`` returned,
    and no event tells when. Blocking: from async tests call it in a thread.

    Returns:
        The names of the connections.

    """
    deadline = time.monotonic() + timeout
    while True:
        connz = server.monitor("connz")
        if int(connz["num_connections"]) == count:
            return sorted(str(c.get("name", "")) for c in connz.get("connections", []))
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} connection(s) expected on {server.url}: {connz}")
        time.sleep(0.02)


def assert_increasing(epochs: Iterable[int]) -> None:
    values = list(epochs)
    assert values == sorted(set(values)), f"epochs must strictly increase: {values}"


async def poll(condition: Callable[[], Awaitable[bool]], *, timeout: float, what: str) -> None:
    """Poll ``condition`` until true: only for states that no event reports."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:g}s")
        await asyncio.sleep(0.02)


@dataclass(frozen=True)
class KeyRevision:
    """One revision of the role's key as an operator saw it stored."""

    op: str
    revision: int
    leader: str | None
    at: float


class KeyHistory:
    """Records every revision of the role's key, from an independent client.

    Every revision: a watch would not do. The buckets keep one value a key
    (history 1), so a revision replaced before the watch's consumer sent it
    is gone from the stream and never delivered (a release and the
    successor's claim 6 ms apart, on a loaded machine). A bucket made by
    :func:`create_bucket` republishes each stored message with its sequence
    to a core subject, which this reads; the key's value when it starts is
    read first.

    Usage: ``async with KeyHistory(nc, bucket) as history: ...`` then
    :meth:`until_revision`.
    """

    def __init__(self, nc: Client, bucket: str, key: str = ROLE) -> None:
        self._nc = nc
        self._bucket = bucket
        self._key = key
        self.entries: list[KeyRevision] = []
        self._seen = asyncio.Event()
        self._sub: Any = None

    async def __aenter__(self) -> KeyHistory:
        js = self._nc.jetstream(timeout=REPLICATED_CREATE_SECONDS)
        stream = f"KV_{self._bucket}"
        republish = (await js.stream_info(stream)).config.republish
        assert republish is not None, f"{self._bucket}: not made by create_bucket"
        self._sub = await self._nc.subscribe(copies_of(self._bucket, self._key), cb=self._on_copy)
        await self._nc.flush()
        subject = f"$KV.{self._bucket}.{self._key}"
        try:
            current = await js.get_msg(stream, subject=subject, direct=False)
        except nats.js.errors.NotFoundError:
            return self
        self._record(current.headers, current.data, int(current.seq or 0))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._sub.unsubscribe()

    async def _on_copy(self, msg: Msg) -> None:
        self._record(msg.headers, msg.data, int((msg.headers or {})["Nats-Sequence"]))

    def _record(self, headers: dict[str, str] | None, data: bytes | None, revision: int) -> None:
        if any(e.revision == revision for e in self.entries):
            return  # the value read at the start, republished too
        op = kv_operation(headers).value
        leader = decode_record(data, revision).id if op == "PUT" and data else None
        self.entries.append(KeyRevision(op, revision, leader, time.monotonic()))
        self.entries.sort(key=lambda e: e.revision)
        self._seen.set()

    async def until_revision(self, revision: int, timeout: float = 10.0) -> list[KeyRevision]:
        """Wait until ``revision`` was recorded; return the entries up to it."""

        async def wait() -> None:
            while not any(e.revision >= revision for e in self.entries):
                self._seen.clear()
                await self._seen.wait()

        await asyncio.wait_for(wait(), timeout)
        return [e for e in self.entries if e.revision <= revision]


@dataclass(frozen=True)
class LocalEvent:
    """What one local election's callbacks saw, timed on the monotonic clock."""

    kind: str
    name: str
    at: float
    value: Any = None


@dataclass
class LocalElections:
    """Elections in the test's event loop, with their callback events.

    Same vocabulary as the candidate processes: ``promoted`` (value: the
    token), ``demoted`` (the reason), ``leader`` (the record or None),
    ``error`` (the exception).
    """

    urls: list[str]
    elections: dict[str, KvElection] = field(default_factory=dict)
    log: list[LocalEvent] = field(default_factory=list)
    connections: list[Client] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(
        self,
        name: str,
        *,
        connection: Client | None = None,
        url: str | None = None,
        **overrides: Any,
    ) -> KvElection:
        """Build (not start) election ``name``; ``overrides`` go to its config."""
        options: dict[str, Any] = {"role": ROLE, "bucket": BUCKET, "ttl": TTL, "instance_id": name}
        options.update(overrides)
        connect_options = ConnectOptions(
            servers=(url,) if url else tuple(self.urls),
            options={"reconnect_time_wait": RECONNECT_WAIT},
        )
        # Several elections may share one test-owned connection: each gets a
        # backend on it that leaves it open (the test closes it).
        backend = JetStreamBackend(connection) if connection is not None else None
        election = KvElection(ElectionConfig(**options), backend, connect_options=connect_options)
        self.elections[name] = election

        @election.on_promote
        async def promoted(token: FencingToken) -> None:
            self._record("promoted", name, token)

        @election.on_demote
        async def demoted(reason: DemoteReason) -> None:
            self._record("demoted", name, reason)

        @election.on_leader_change
        async def changed(record: LeaderRecord | None) -> None:
            self._record("leader", name, record)

        @election.on_error
        async def failed(exc: ElectionError) -> None:
            self._record("error", name, exc)

        return election

    def __getitem__(self, name: str) -> KvElection:
        return self.elections[name]

    async def connect(self, count: int) -> list[Client]:
        """Open ``count`` connections to share, set up as the Elector's (no write buffer)."""
        made = [
            await nats.connect(self.urls, pending_size=0, reconnect_time_wait=RECONNECT_WAIT)
            for _ in range(count)
        ]
        self.connections.extend(made)
        return made

    def _record(self, kind: str, name: str, value: Any) -> None:
        self.log.append(LocalEvent(kind, name, time.monotonic(), value))
        self._changed.set()

    def events(self, kind: str, among: Iterable[str] | None = None) -> list[LocalEvent]:
        names = None if among is None else set(among)
        return [e for e in self.log if e.kind == kind and (names is None or e.name in names)]

    async def wait_for(
        self,
        kind: str,
        among: Iterable[str] | None = None,
        *,
        after: float = 0.0,
        timeout: float = 30.0,
        where: Callable[[LocalEvent], bool] | None = None,
    ) -> LocalEvent:
        """The first ``kind`` event of one of ``among`` that happened at or after ``after``."""
        names = None if among is None else set(among)
        deadline = time.monotonic() + timeout
        while True:
            for event in self.log:
                if (
                    event.kind == kind
                    and event.at >= after
                    and (names is None or event.name in names)
                    and (where is None or where(event))
                ):
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                recent = "\n  ".join(repr(e) for e in self.log[-20:])
                raise AssertionError(
                    f"no {kind!r} event from {sorted(names) if names else 'anyone'} within "
                    f"{timeout:g}s; recent:\n  {recent}"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue

    def leaders(self) -> list[str]:
        """Names of the local elections that lead right now."""
        return [name for name, e in self.elections.items() if e.is_leader]

    async def close(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.elections.values()), return_exceptions=True)
        for connection in self.connections:
            await connection.close()


class LogCounter(logging.Handler):
    """Keeps the log records it is given; counts those containing a text."""

    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def count(self, text: str, *, name: str | None = None) -> int:
        return sum(
            text in record.getMessage() and (name is None or record.name == name)
            for record in self.records
        )


def servers_under_test() -> dict[str, str]:
    """``nats-server-<version>`` -> binary: this run's server, Debian's and the newest.

    For the tests that must cover 2.9.10 and the newest server in every run
    (and, in a matrix run, the version under test as well); each binary once.
    """
    from celery_nats_leader.testing import (
        binary_version,
        find_nats_server_binary,
        server_binary,
    )

    found: dict[str, str] = {}
    for binary in (find_nats_server_binary(), server_binary("system"), server_binary("newest")):
        found.setdefault(f"nats-server-{binary_version(binary)}", binary)
    return found
