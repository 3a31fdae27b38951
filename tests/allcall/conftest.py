"""Fixtures of the ALLCALL tests; see helpers.py for the two tiers they build."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from celery_nats_leader.testing import NatsServer
from tests.allcall.helpers import MemoryCluster, RealNodes


@pytest.fixture
async def cluster() -> AsyncIterator[MemoryCluster]:
    """Candidates on the in-memory bus under one manual clock."""
    made = MemoryCluster()
    yield made
    await made.close()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A nats-server without JetStream, on a free port."""
    with NatsServer(jetstream=False) as server:
        yield server


@pytest.fixture
async def real_nodes() -> AsyncIterator[RealNodes]:
    """Elections with their own connections; all stopped at the end."""
    made = RealNodes()
    yield made
    await made.close()
