"""Fixtures of the integration tests: real nats-server processes, real candidates.

See helpers.py for the two kinds of candidates and the timing constants.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client

from celery_nats_leader.testing import NatsServer, ThreadedFaultProxy
from tests.chaos.netns import NetnsHost
from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import (
    BUCKET,
    LocalElections,
    LogCounter,
    candidate_group,
    create_bucket,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than ~10 seconds (a cluster, a herd)")


@pytest.fixture(autouse=True)
def no_asyncio_errors() -> Iterator[None]:
    """Fail on errors asyncio only logs (a task's lost exception, a callback's error).

    Registered first, so torn down last: the other fixtures' shutdown is watched too.
    """
    handler = LogCounter(logging.ERROR)
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records]


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A JetStream nats-server on free ports with a private store, for one test."""
    with NatsServer() as server:
        yield server


@pytest.fixture
async def bucket(nats_server: NatsServer) -> str:
    """The election bucket, created on ``nats_server`` with ``max_age = TTL``."""
    await create_bucket(nats_server.url)
    return BUCKET


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A plain nats-py client of the test itself (an operator, or an intruder)."""
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
def proxy(nats_server: NatsServer) -> Iterator[ThreadedFaultProxy]:
    """A fault-injecting TCP proxy in front of ``nats_server`` (own thread and loop)."""
    with ThreadedFaultProxy("127.0.0.1", nats_server.port) as prx:
        yield prx


@pytest.fixture
def group(nats_server: NatsServer) -> Iterator[CandidateGroup]:
    """Candidate processes for ``ROLE`` in ``BUCKET`` on ``nats_server``, TTL ``TTL``."""
    with candidate_group(nats_server.url) as made:
        yield made


@pytest.fixture
async def local(nats_server: NatsServer) -> AsyncIterator[LocalElections]:
    """Elections in the test's loop against ``nats_server``; all stopped at the end."""
    made = LocalElections([nats_server.url])
    yield made
    await made.close()


@pytest.fixture
def package_log() -> Iterator[LogCounter]:
    """Every log record of ``celery_nats_leader`` during the test."""
    handler = LogCounter()
    logger = logging.getLogger("celery_nats_leader")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.fixture
def host() -> Iterator[NetnsHost]:
    """A network namespace joined to the root namespace by a veth pair (a second host)."""
    with NetnsHost() as made:
        yield made


@pytest.fixture
def root_server(host: NetnsHost) -> Iterator[NatsServer]:
    """A JetStream nats-server on the root side of ``host``'s veth pair.

    Candidates of both namespaces connect to this address (in the root
    namespace it is a local address, like loopback).
    """
    with NatsServer(host=host.root_address) as server:
        yield server
