"""The synchronous facade: many roles on one connection, and connecting late."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from celery_nats_leader import ElectionConfig, Elector, NatsUnavailableError
from celery_nats_leader.testing import NatsServer, free_port
from tests.integration.helpers import BUCKET, SLACK, TTL, wait_connections

pytestmark = pytest.mark.integration

ROLES = ("alpha", "beta")


def config(role: str, instance_id: str, **overrides: object) -> ElectionConfig:
    return ElectionConfig(role=role, bucket=BUCKET, ttl=TTL, instance_id=instance_id, **overrides)  # type: ignore[arg-type]


def test_two_roles_on_one_connection_and_their_status(nats_server: NatsServer, bucket: str) -> None:
    with Elector(nats_server.url, name="first") as first:
        mine = {role: first.add_role(config(role, "first")) for role in ROLES}
        # Leaders at once: the roles were free.
        assert all(handle.is_leader for handle in mine.values())
        with Elector(nats_server.url, name="second") as second:
            theirs = {role: second.add_role(config(role, "second")) for role in ROLES}
            # One connection per elector, whatever the number of roles.
            assert wait_connections(nats_server, 2) == ["first", "second"]

            rows = {row.role: row for row in second.status()}
            assert sorted(rows) == sorted(ROLES)
            for role in ROLES:
                row = rows[role]
                token = mine[role].token
                assert token is not None
                assert (row.leader_id, row.epoch) == ("first", token.epoch)
                assert row.has_leader
                assert {c["id"] for c in row.candidates} == {"first", "second"}
                leader_view = next(c for c in row.candidates if c["is_leader"])
                assert leader_view["id"] == "first"
                assert row.term_age is not None and row.term_age >= 0
                assert row.expires_in is not None and 0 < row.expires_in <= TTL
                assert not theirs[role].is_leader
                assert theirs[role].leader_id == "first"
                assert mine[role].validate_token()

            # Resigning one role moves only that role.
            promoted = threading.Event()
            theirs["beta"].on_promote(lambda token: promoted.set())
            mine["beta"].resign()
            assert promoted.wait(TTL)
            assert theirs["beta"].is_leader and not mine["beta"].is_leader
            assert mine["alpha"].is_leader and not theirs["alpha"].is_leader
            rows = {row.role: row for row in first.status()}
            assert (rows["alpha"].leader_id, rows["beta"].leader_id) == ("first", "second")


def test_require_connection_fails_fast_on_a_dead_url() -> None:
    elector = Elector(f"nats://127.0.0.1:{free_port()}")
    handle = elector.add_role(config("alpha", "lonely"))
    began = time.monotonic()
    with pytest.raises(NatsUnavailableError, match="could not connect"):
        elector.start(timeout=1.0)
    assert time.monotonic() - began < 1.0 + SLACK
    assert not elector.running
    assert not handle.is_leader


class Retries(logging.Handler):
    """Signals once the elector logged ``count`` failed attempts to start (any level)."""

    def __init__(self, count: int) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._count = count
        self.reached = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "leader election is not running" in record.getMessage():
            self.records.append(record)
            if len(self.records) >= self._count:
                self.reached.set()

    @property
    def failures(self) -> int:
        return len(self.records)

    def loud(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


def test_without_require_connection_roles_start_once_a_server_appears() -> None:
    port = free_port()
    elector = Elector(f"nats://127.0.0.1:{port}", name="patient")
    handle = elector.add_role(config("alpha", "patient", create_bucket=True))
    retries = Retries(2)
    logger = logging.getLogger("celery_nats_leader.election.elector")
    logger.addHandler(retries)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        began = time.monotonic()
        elector.start(timeout=1.0, require_connection=False)
        assert time.monotonic() - began < 1.0  # the caller goes on
        assert elector.running and not elector.connected
        assert not handle.is_leader
        # It keeps trying (and says so) while nothing listens on the port.
        assert retries.reached.wait(10.0)
        assert not elector.connected and not handle.is_leader
        assert isinstance(elector.start_error, NatsUnavailableError)
        # Said loudly once, then at most every 30 s (the retries in between
        # are at DEBUG); a delay is never printed as "0.0s", and a timeout
        # never leaves "within 1s: " without a reason.
        loud = retries.loud()
        assert len(loud) == 1, loud
        assert "NatsUnavailableError: could not connect to NATS" in loud[0]
        messages = [r.getMessage() for r in retries.records]
        assert not any("0.0s" in m or m.rstrip().endswith(":") for m in messages), messages
        assert not any(re.search(r"within \S+: ;", m) for m in messages), messages

        with NatsServer(port=port) as server:
            appeared_at = time.monotonic()
            assert handle.wait_for_leadership(timeout=15.0)
            # Retries back off, but not beyond a few seconds.
            assert time.monotonic() - appeared_at < 10.0 + SLACK
            assert elector.connected and elector.start_error is None
            assert handle.validate_token()
            assert wait_connections(server, 1) == ["patient"]
            elector.stop()
    finally:
        logger.removeHandler(retries)
        logger.setLevel(level)
        elector.stop()


def test_permanent_start_error_is_repeated_and_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery_nats_leader.core.errors import BucketNotFoundError
    from celery_nats_leader.election import elector as elector_module

    # Shortened for the test: 30 s each in production.
    monkeypatch.setattr(elector_module, "_PERMANENT_RETRY", 0.2)
    monkeypatch.setattr(elector_module, "_REPEAT_INTERVAL", 0.5)
    retries = Retries(1)
    logger = logging.getLogger("celery_nats_leader.election.elector")
    logger.addHandler(retries)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with NatsServer() as server:
            elector = Elector(server.url, name="bucketless")
            handle = elector.add_role(config("alpha", "bucketless", create_bucket=False))
            elector.start(timeout=2.0, require_connection=False)
            try:
                deadline = time.monotonic() + 10
                while len(retries.loud()) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                loud = retries.loud()
                # Repeated (every _REPEAT_INTERVAL), each time one line with the advice.
                assert len(loud) >= 2, loud
                assert all("BucketNotFoundError: KV bucket" in m for m in loud), loud
                assert retries.failures > len(loud)  # retried in between, quietly
                assert isinstance(elector.start_error, BucketNotFoundError)
                assert all(r.exc_info is None for r in retries.records)  # no tracebacks

                # An operator creates the bucket: the next retry starts the role.
                creator = Elector(server.url, name="creator")
                creator.add_role(config("beta", "creator", create_bucket=True))
                creator.start(timeout=5.0)
                creator.stop()
                assert handle.wait_for_leadership(timeout=10.0)
                assert elector.start_error is None
            finally:
                elector.stop()
    finally:
        logger.removeHandler(retries)
        logger.setLevel(level)


async def test_connection_errors_during_an_outage_are_said_once() -> None:
    import asyncio

    from celery_nats_leader.nats import connection as connection_module

    records: list[logging.LogRecord] = []
    three_errors = asyncio.Event()
    back = asyncio.Event()

    def errors() -> list[logging.LogRecord]:
        return [r for r in records if "NATS connection error" in r.getMessage()]

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)
            if len(errors()) >= 3:
                three_errors.set()

    class Back(connection_module.ConnectionListener):
        def reconnected(self) -> None:
            back.set()

    logger = logging.getLogger(connection_module.__name__)
    handler = Collect(logging.DEBUG)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with NatsServer() as server:
            nc = await connection_module.connect(
                connection_module.ConnectOptions(servers=(server.url,)),
                listeners=[Back()],
                timeout=5.0,
            )
            server.stop()
            await asyncio.wait_for(three_errors.wait(), 15)  # reconnects every 0.5 s
            server.start()
            await asyncio.wait_for(back.wait(), 15)
            await nc.close()
        seen = errors()
        # One warning for the whole outage; the repeats at DEBUG, counted.
        assert [r.levelno for r in seen].count(logging.WARNING) == 1, [r.getMessage() for r in seen]
        assert "(1 since the last connection)" in seen[0].getMessage()
        assert all(not r.getMessage().rstrip().endswith(":") for r in seen)
        reconnected = [r.getMessage() for r in records if "reconnected to NATS" in r.getMessage()]
        assert re.search(r"after \d+ connection errors", reconnected[0]), reconnected
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
