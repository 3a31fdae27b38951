"""Fixtures of the Django tests: Django configured here, a private nats-server, live candidates.

Django is configured by ``settings.configure()`` from this directory's
settings module in ``pytest_configure`` (pytest-django's documented
alternative to DJANGO_SETTINGS_MODULE), so the other test directories run
without Django settings and no DJANGO_SETTINGS_MODULE leaks into the
environment of the subprocesses they start.

Every test that talks to NATS gets this module's own nats-server (never the
system one on 4222) and a unique bucket; candidates are real Electors in the
test process.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from celery_nats_leader import ElectionConfig, Elector, RoleHandle
from celery_nats_leader.testing import NatsServer

IN_CI = os.environ.get("CI", "").lower() == "true"

#: Why PostgreSQL is not usable (None when it is); set in pytest_configure.
PG_PROBLEM: list[str | None] = [None]


def pytest_configure(config: pytest.Config) -> None:
    import django
    from django.conf import settings

    from tests.django import settings as test_settings

    if not settings.configured:
        problem = test_settings.postgres_problem()
        PG_PROBLEM[0] = problem
        settings.configure(**test_settings.build(postgres=problem is None))
    elif "postgres" not in settings.DATABASES:
        PG_PROBLEM[0] = "Django was configured elsewhere without a 'postgres' database"
    django.setup()


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    from tests.django import settings as test_settings

    shutil.rmtree(test_settings.SQLITE_DIR, ignore_errors=True)


def require_postgres() -> None:
    """Fail under CI (PostgreSQL must be up there), skip elsewhere, when it is unreachable."""
    problem = PG_PROBLEM[0]
    if problem is None:
        return
    if IN_CI:
        pytest.fail(f"PostgreSQL is required when CI=true: {problem}")
    pytest.skip(f"PostgreSQL not available: {problem}")


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    """A private nats-server with JetStream on a free port."""
    with NatsServer() as server:
        yield server


@dataclass
class Candidates:
    """Live election candidates (one Elector, one NATS connection each) in this process."""

    url: str
    bucket: str
    ttl: float
    electors: dict[str, Elector] = field(default_factory=dict)

    def start(
        self, instance_id: str, *, roles: tuple[str, ...] = ("default",), priority: int = 0
    ) -> Elector:
        """Start one candidate campaigning for ``roles``; returns once each role decided."""
        elector = Elector(self.url, name=f"test-{instance_id}")
        for role in roles:
            elector.add_role(
                ElectionConfig(
                    role=role,
                    bucket=self.bucket,
                    ttl=self.ttl,
                    instance_id=instance_id,
                    priority=priority,
                    create_bucket=True,
                )
            )
        elector.start(timeout=10)
        self.electors[instance_id] = elector
        return elector

    def handle(self, instance_id: str, role: str = "default") -> RoleHandle:
        """The role handle of one candidate."""
        return self.electors[instance_id].role(role)

    def stop(self) -> None:
        """Stop every candidate (leaders release their keys)."""
        for elector in self.electors.values():
            elector.stop()
        self.electors.clear()


@pytest.fixture
def bucket() -> str:
    """A bucket name no other test uses."""
    return f"dj_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def candidates(nats_server: NatsServer, bucket: str) -> Iterator[Candidates]:
    """A factory of live candidates on the module's server and this test's bucket."""
    made = Candidates(url=nats_server.url, bucket=bucket, ttl=2.0)
    yield made
    made.stop()


@pytest.fixture
def nats_leader(
    settings: Any, nats_server: NatsServer, bucket: str
) -> Callable[..., dict[str, Any]]:
    """Point ``NATS_LEADER`` at this test's server and bucket; extra keys as arguments."""

    def apply(**extra: Any) -> dict[str, Any]:
        value = {"SERVERS": [nats_server.url], "BUCKET": bucket, "TTL": 2, **extra}
        settings.NATS_LEADER = value
        return value

    apply()
    return apply


@pytest.fixture
def alias(request: pytest.FixtureRequest) -> str:
    """The database alias of the test's parameter (PostgreSQL must be up for ``postgres``)."""
    name: str = request.param
    if name == "postgres":
        require_postgres()
    return name
