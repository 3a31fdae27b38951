"""The built-in broker health check against the machine's real brokers."""

from __future__ import annotations

import time

import pytest
from celery import Celery

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.testing import free_port
from celery_nats_leader.worker.health import broker_check, broker_reachable
from tests.support.brokers import AMQP_URL, REDIS_URL
from tests.support.services import require_service

pytestmark = [pytest.mark.celery, pytest.mark.integration]


@pytest.mark.parametrize(("kind", "url"), [("redis", REDIS_URL), ("rabbitmq", AMQP_URL)])
def test_a_reachable_broker_passes(kind: str, url: str) -> None:
    require_service(f"{kind} broker", url)
    app = Celery("health", broker=url, set_as_current=False)
    assert broker_check(app)() is True


@pytest.mark.parametrize("scheme", ["redis", "amqp"])
def test_an_unreachable_broker_fails_within_the_timeout(scheme: str) -> None:
    app = Celery(
        "health", broker=f"{scheme}://127.0.0.1:{free_port('127.0.0.1')}//", set_as_current=False
    )
    started = time.monotonic()
    assert broker_check(app, timeout=1.0)() is False
    assert time.monotonic() - started < 5.0


def test_the_dotted_path_checks_the_current_app() -> None:
    require_service("redis broker", REDIS_URL)
    settings = LeaderSettings.from_celery(
        {"nats_leader_health_check": "celery_nats_leader.worker.health:broker_reachable"}
    )
    assert settings.election_config("default").health_check is broker_reachable
    app = Celery("health", broker=REDIS_URL)
    app.set_current()
    assert broker_reachable() is True
