"""TermReader: a role's current term read from synchronous code, on a real server."""

from __future__ import annotations

import logging
import uuid

import pytest

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.errors import ElectionError, NatsUnavailableError
from celery_nats_leader.term import TermReader
from celery_nats_leader.term.token import FencingToken
from celery_nats_leader.testing import NatsServer, free_port


def test_reads_the_live_term_and_sees_it_end(nats_server: NatsServer) -> None:
    bucket = f"term_{uuid.uuid4().hex[:8]}"
    elector = Elector(nats_server.url, name="term-test")
    handle = elector.add_role(
        ElectionConfig(role="r", bucket=bucket, ttl=2.0, instance_id="a", create_bucket=True)
    )
    reader = TermReader(ConnectOptions(servers=(nats_server.url,)), bucket)
    try:
        elector.start(timeout=10)
        token = handle.token
        assert token is not None
        term = reader.read("r", timeout=2)
        assert term is not None and term.record is not None
        assert (term.epoch, term.record.id) == (token.epoch, "a")
        assert reader.holds("r", token, "a", timeout=2)
        assert not reader.holds("r", token, "b", timeout=2)
        assert not reader.holds("r", FencingToken(token.epoch + 1, token.value), timeout=2)
        assert reader.read("other", timeout=2) is None

        elector.stop()  # releases the key
        assert reader.read("r", timeout=2) is None
        assert not reader.holds("r", token, "a", timeout=2)
    finally:
        elector.stop()
        reader.close()


def test_unreachable_nats_fails_closed(caplog: pytest.LogCaptureFixture) -> None:
    reader = TermReader(ConnectOptions(servers=(f"nats://127.0.0.1:{free_port()}",)), "leaders")
    try:
        with pytest.raises(NatsUnavailableError):
            reader.read("r", timeout=0.5)
        with caplog.at_level(logging.WARNING, logger="celery_nats_leader.term"):
            assert not reader.holds("r", FencingToken(1, "x"), timeout=0.5)
        assert "could not validate the token of 'r'" in caplog.text
    finally:
        reader.close()


def test_missing_bucket_is_an_error(nats_server: NatsServer) -> None:
    reader = TermReader(ConnectOptions(servers=(nats_server.url,)), "no_such_bucket")
    try:
        with pytest.raises(ElectionError, match="does not exist"):
            reader.read("r", timeout=2)
    finally:
        reader.close()
