"""NATS_LEADER is read when used, merged with CELERY_NATS_LEADER_*, and reaches a Celery app."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from django.test import override_settings

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError
from django_nats_leader import conf


def test_keys_are_case_insensitive(settings: Any) -> None:
    settings.NATS_LEADER = {"servers": "nats://a:4222,nats://b:4222", "Ttl": 6, "ROLES": "x,y"}
    result = conf.leader_settings()
    assert result.servers == ("nats://a:4222", "nats://b:4222")
    assert result.ttl == 6
    assert result.roles == ("x", "y")


def test_read_when_used_not_at_import() -> None:
    with override_settings(NATS_LEADER={"BUCKET": "first"}):
        assert conf.leader_settings().bucket == "first"
    with override_settings(NATS_LEADER={"BUCKET": "second"}):
        assert conf.leader_settings().bucket == "second"


def test_unset_means_defaults(settings: Any) -> None:
    del settings.NATS_LEADER
    result = conf.leader_settings()
    assert (result.bucket, result.roles, result.ttl) == ("leaders", ("default",), 10.0)


def test_celery_settings_override_the_dict(settings: Any) -> None:
    settings.NATS_LEADER = {"TTL": 6, "PRIORITY": 1, "ROLES": ["default"]}
    settings.CELERY_NATS_LEADER_PRIORITY = 7
    result = conf.leader_settings()
    assert (result.ttl, result.priority) == (6, 7)


def test_twice_the_same_key(settings: Any) -> None:
    settings.NATS_LEADER = {"TTL": 6, "ttl": 7}
    with pytest.raises(ConfigError, match="twice"):
        conf.leader_settings()


def test_expected_roles_include_beat_only_with_the_leader_scheduler(settings: Any) -> None:
    settings.NATS_LEADER = {"ROLES": ["default"], "BEAT_ROLE": "scheduler"}
    assert conf.expected_roles(conf.leader_settings()) == ("default",)
    settings.CELERY_BEAT_SCHEDULER = "celery_nats_leader.beat:LeaderScheduler"
    assert conf.expected_roles(conf.leader_settings()) == ("default", "scheduler")


def test_configure_celery_feeds_nats_leader_to_celery(settings: Any) -> None:
    settings.NATS_LEADER = {
        "SERVERS": ["nats://n1:4222"],
        "ROLES": ["default", "reports"],
        "TTL": 6,
        "PRIORITY": 2,
    }
    settings.CELERY_NATS_LEADER_PRIORITY = 9  # the Celery-side refinement wins
    app = Celery("proj", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    conf.configure_celery(app)
    from_celery = LeaderSettings.from_celery(app.conf)
    assert from_celery.servers == ("nats://n1:4222",)
    assert from_celery.roles == ("default", "reports")
    assert from_celery.ttl == 6
    assert from_celery.priority == 9
    # The same values the Django side computes from the same settings.
    merged = conf.leader_settings(app.conf)
    assert (merged.servers, merged.roles, merged.ttl, merged.priority) == (
        from_celery.servers,
        from_celery.roles,
        from_celery.ttl,
        from_celery.priority,
    )


def test_a_worker_of_an_app_not_given_nats_leader_gets_it_with_a_warning(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from celery import signals

    class Started:  # the sender: a worker or a beat service, with its app
        def __init__(self, app: Celery) -> None:
            self.app = app

    settings.NATS_LEADER = {"ROLES": ["reports"], "TTL": 6}
    app = Celery("proj", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")  # no configure_celery
    # What `celery worker` and `celery beat` send as they start (the Django
    # app connected its receiver in ready()).
    signals.worker_init.send(sender=Started(app))
    settings_seen = LeaderSettings.from_celery(app.conf)
    assert (settings_seen.roles, settings_seen.ttl) == (("reports",), 6)
    assert "was not given NATS_LEADER (configure_celery(app) is not called" in caplog.text
    # Said once: the app is configured now; an app given it says nothing.
    caplog.clear()
    signals.beat_init.send(sender=Started(app))
    given = Celery("proj2", set_as_current=False)
    conf.configure_celery(given)
    signals.worker_init.send(sender=Started(given))
    assert "was not given NATS_LEADER" not in caplog.text
