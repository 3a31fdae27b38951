"""The built-in database health check on the test databases."""

from __future__ import annotations

from typing import Any

import pytest

from celery_nats_leader.config.settings import LeaderSettings
from django_nats_leader.health import database_check, database_reachable
from tests.django.conftest import PG_PROBLEM, require_postgres


@pytest.mark.django_db
def test_the_default_database_passes() -> None:
    assert database_reachable() is True


@pytest.mark.django_db(databases=["postgres"] if PG_PROBLEM[0] is None else [])
def test_postgres_passes() -> None:
    require_postgres()
    assert database_check("postgres")() is True


def test_an_unreachable_database_fails(settings: Any, django_db_blocker: Any) -> None:
    require_postgres()
    from django.db import connections

    # A second connection to PostgreSQL on a port nobody listens on.
    broken = {**settings.DATABASES["postgres"], "PORT": "1", "TEST": {}}
    configured = connections.configure_settings({"default": broken, "broken": broken})
    connections.settings["broken"] = configured["broken"]
    try:
        with django_db_blocker.unblock():  # a database outside the test set-up
            assert database_check("broken")() is False
    finally:
        del connections.settings["broken"]
        if hasattr(connections._connections, "broken"):
            delattr(connections._connections, "broken")


def test_the_setting_names_it(settings: Any) -> None:
    values = {"HEALTH_CHECK": "django_nats_leader.health:database_reachable"}
    config = LeaderSettings.from_mapping(values).election_config("default")
    assert config.health_check is database_reachable
