"""Fixtures of the beat tests (the harness is in ``cnl_beat_harness``).

Every test gets its own ``nats-server`` (never the system one), KV buckets,
queue and ledger. No ``__init__.py`` here, like ``tests/celery``: helper
modules are imported by their own (unique) names, and the subprocesses find
them through ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_harness import PG_DB, PG_HOST, PG_PORT, BeatCluster, Database, pg_connect

from celery_nats_leader.testing import NatsServer
from tests.support.brokers import Broker, make_broker
from tests.support.services import IN_CI, reachable


@pytest.fixture
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    kind = getattr(request, "param", "filesystem")
    spec = make_broker(
        kind, tmp_path, key_prefix=f"cnl-beat-{uuid.uuid4().hex[:10]}:", store_processed=False
    )
    try:
        yield spec
    finally:
        spec.cleanup()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    """PostgreSQL (a schema of this test's own) where reachable, else SQLite."""
    if reachable(f"pg://{PG_HOST}:{PG_PORT}"):
        conn, user = None, ""
        errors = []
        for user in (os.environ.get("CNL_PG_USER", "postgres"), "root"):
            try:
                conn = pg_connect(user)
                break
            except Exception as exc:
                errors.append(f"{user}: {exc}")
        if conn is None:
            if IN_CI:
                pytest.fail(f"PostgreSQL at {PG_HOST}:{PG_PORT} refused every user: {errors}")
            pytest.skip(f"PostgreSQL at {PG_HOST}:{PG_PORT} refused every user: {errors}")
        schema = f"cnl_beat_{uuid.uuid4().hex[:10]}"
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE SCHEMA {schema}")

        def drop() -> None:
            with conn.cursor() as cur:
                cur.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            conn.close()

        db = Database(
            "postgresql",
            {
                "ENGINE": "django.db.backends.postgresql",
                "HOST": PG_HOST,
                "PORT": PG_PORT,
                "NAME": PG_DB,
                "USER": user,
                "OPTIONS": {"options": f"-c search_path={schema}"},
            },
            drop,
        )
    else:
        if IN_CI:
            pytest.fail(f"PostgreSQL not reachable at {PG_HOST}:{PG_PORT} (CI=true: it must be up)")
        db = Database(
            "sqlite",
            {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(tmp_path / "beat.sqlite3"),
                "OPTIONS": {"timeout": 60},
            },
        )
    try:
        yield db
    finally:
        db.cleanup()


@pytest.fixture
def cluster_factory(
    tmp_path: Path, nats_server: NatsServer, broker: Broker
) -> Iterator[Callable[..., BeatCluster]]:
    clusters: list[BeatCluster] = []

    def make(**kwargs: Any) -> BeatCluster:
        cluster = BeatCluster(tmp_path, nats_server, broker, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()
