"""``celery nats-leader``: the CLI against a real nats-server and live candidates.

The candidates are Electors in this process; the command runs through
click's test runner with a Celery app (no worker, no broker needed): what an
operator sees is its output and exit status.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.cli import nats_leader
from celery_nats_leader.testing import NatsServer

TTL = 2.0


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture
def bucket() -> str:
    return f"cli_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def app(nats_server: NatsServer, bucket: str) -> Celery:
    app = Celery("cli", set_as_current=False)
    app.conf.update(
        nats_leader_servers=[nats_server.url],
        nats_leader_bucket=bucket,
        nats_leader_ttl=TTL,
        nats_leader_roles=["default"],
    )
    return app


@pytest.fixture
def two(nats_server: NatsServer, bucket: str) -> Iterator[dict[str, Elector]]:
    """cand-a leads ``default`` (started first, preferred), cand-b follows."""
    electors: dict[str, Elector] = {}
    try:
        for name, priority in (("cand-a", 10), ("cand-b", 0)):
            elector = Elector(nats_server.url, name=f"test-{name}")
            elector.add_role(
                ElectionConfig(
                    role="default",
                    bucket=bucket,
                    ttl=TTL,
                    instance_id=name,
                    priority=priority,
                    create_bucket=True,
                )
            )
            elector.start(timeout=10)
            electors[name] = elector
        assert electors["cand-a"].role("default").is_leader
        yield electors
    finally:
        for elector in electors.values():
            elector.stop()


def cli(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(nats_leader, list(args), obj=SimpleNamespace(app=app))


def test_resign_reports_the_successor(app: Celery, two: dict[str, Elector]) -> None:
    old = two["cand-a"].role("default").token
    assert old is not None
    result = cli(app, "resign", "default")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"cand-a stepped down from role 'default' (epoch {old.epoch})"
    # The command saw cand-b's record; cand-b learns it won when its write is acked.
    successor = two["cand-b"].role("default")
    assert successor.wait_for_leadership(2)
    new = successor.token
    assert new is not None and new.epoch > old.epoch
    assert lines[1].startswith(f"new leader of 'default': cand-b (epoch {new.epoch}) after ")
    assert not two["cand-a"].role("default").is_leader


def test_resign_json(app: Celery, two: dict[str, Elector]) -> None:
    old = two["cand-a"].role("default").token
    assert old is not None
    result = cli(app, "resign", "default", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["role"] == "default"
    assert doc["accepted"] is True
    assert doc["answered_by"] == "cand-a"
    assert doc["stepped_down"]["id"] == "cand-a"
    assert doc["stepped_down"]["epoch"] == old.epoch
    assert doc["new_leader"]["id"] == "cand-b"
    assert doc["new_leader"]["epoch"] > old.epoch
    assert 0 < doc["handover_seconds"] < TTL


def test_resign_without_leader_exits_1(app: Celery, two: dict[str, Elector]) -> None:
    result = cli(app, "resign", "reports")
    assert result.exit_code == 1
    assert "nobody leads role 'reports'" in result.stderr


def test_resign_invalid_role_exits_2(app: Celery) -> None:
    result = cli(app, "resign", "not a role")
    assert result.exit_code == 2
