"""The synchronous facade: many roles on one connection, and connecting late."""

from __future__ import annotations

import logging
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
    """Signals once the elector logged ``count`` failed connection attempts."""

    def __init__(self, count: int) -> None:
        super().__init__(logging.WARNING)
        self.failures = 0
        self._count = count
        self.reached = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "NATS unreachable" in record.getMessage():
            self.failures += 1
            if self.failures >= self._count:
                self.reached.set()


def test_without_require_connection_roles_start_once_a_server_appears() -> None:
    port = free_port()
    elector = Elector(f"nats://127.0.0.1:{port}", name="patient")
    handle = elector.add_role(config("alpha", "patient", create_bucket=True))
    retries = Retries(2)
    logger = logging.getLogger("celery_nats_leader.elector")
    logger.addHandler(retries)
    try:
        began = time.monotonic()
        elector.start(timeout=1.0, require_connection=False)
        assert time.monotonic() - began < 1.0  # the caller goes on
        assert elector.running and not elector.connected
        assert not handle.is_leader
        # It keeps trying (and says so) while nothing listens on the port.
        assert retries.reached.wait(10.0)
        assert not elector.connected and not handle.is_leader

        with NatsServer(port=port) as server:
            appeared_at = time.monotonic()
            assert handle.wait_for_leadership(timeout=15.0)
            # Retries back off, but not beyond a few seconds.
            assert time.monotonic() - appeared_at < 10.0 + SLACK
            assert elector.connected
            assert handle.validate_token()
            assert wait_connections(server, 1) == ["patient"]
            elector.stop()
    finally:
        logger.removeHandler(retries)
        elector.stop()
