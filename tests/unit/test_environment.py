"""Settings from the environment (config/environment.py): names, parsing, precedence."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from celery_nats_leader.config import environment
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in list(os.environ):
        if variable.startswith("NATS_LEADER_") or variable in ("NATS_URL", *environment.NATS_TOOLS):
            monkeypatch.delenv(variable)
    monkeypatch.setattr(environment, "_reported", set())


def test_every_kind_of_setting_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_LEADER_SERVERS", "nats://a:4222, nats://b:4222")
    monkeypatch.setenv("NATS_LEADER_METRICS_PORT", "9808")
    monkeypatch.setenv("NATS_LEADER_REQUIRED", "true")
    monkeypatch.setenv("NATS_LEADER_TTL", "30")
    monkeypatch.setenv("NATS_LEADER_ROLES", "reports,cleanup")
    monkeypatch.setenv("NATS_LEADER_CONNECT_OPTIONS", '{"user_credentials": "/etc/w.creds"}')
    monkeypatch.setenv("NATS_LEADER_BEAT_CATCH_UP_WINDOW", "")
    for settings in (LeaderSettings.from_celery({}), LeaderSettings.from_mapping({})):
        assert settings.servers == ("nats://a:4222", "nats://b:4222")
        assert settings.metrics_port == 9808
        assert settings.required is True
        assert settings.ttl == 30.0
        assert settings.roles == ("reports", "cleanup")
        assert settings.connect_options == {"user_credentials": "/etc/w.creds"}
        assert settings.beat_catch_up_window is None


def test_nats_url_gives_the_servers_unless_nats_leader_servers_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NATS_URL", "nats://nats.svc:4222")
    assert LeaderSettings.from_celery({}).servers == ("nats://nats.svc:4222",)
    monkeypatch.setenv("NATS_LEADER_SERVERS", "nats://other:4222")
    assert LeaderSettings.from_celery({}).servers == ("nats://other:4222",)


def test_the_nats_tools_credentials_give_the_connect_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NATS_USER", "worker")
    monkeypatch.setenv("NATS_PASSWORD", "s3cret")
    assert LeaderSettings.from_mapping({}).connect_options == {
        "user": "worker",
        "password": "s3cret",
    }
    monkeypatch.setenv("NATS_LEADER_CONNECT_OPTIONS", '{"user_credentials": "/w.creds"}')
    assert LeaderSettings.from_mapping({}).connect_options == {"user_credentials": "/w.creds"}
    configured = {"connect_options": {"token": "t"}}
    assert LeaderSettings.from_mapping(configured).connect_options == {"token": "t"}


def test_the_configuration_wins_and_an_overridden_variable_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NATS_LEADER_METRICS_PORT", "9100")
    monkeypatch.setenv("NATS_LEADER_TTL", "10")
    settings = LeaderSettings.from_celery({"nats_leader_metrics_port": 9808, "nats_leader_ttl": 10})
    assert settings.metrics_port == 9808
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # The same value set twice is no conflict; another one is said, once.
    assert warnings == [
        "nats-leader: NATS_LEADER_METRICS_PORT='9100' in the environment is ignored: "
        "nats_leader_metrics_port in the configuration sets it"
    ]
    LeaderSettings.from_celery({"nats_leader_metrics_port": 9808})
    assert len([r for r in caplog.records if "is ignored" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("NATS_LEADER_TTL", "ten", "NATS_LEADER_TTL='ten' in the environment is not a valid float"),
        ("NATS_LEADER_REQUIRED", "maybe", "NATS_LEADER_REQUIRED='maybe' in the environment"),
        ("NATS_LEADER_CONNECT_OPTIONS", "[1]", "is not a valid Mapping"),
        ("NATS_LEADER_TTL", "-1", "NATS_LEADER_TTL=-1"),
    ],
)
def test_a_bad_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, said: str
) -> None:
    monkeypatch.setenv(variable, value)
    for build in (lambda: LeaderSettings.from_celery({}), lambda: LeaderSettings.from_mapping({})):
        with pytest.raises(ConfigError) as raised:
            build()
        assert said in str(raised.value)


def test_an_unknown_variable_is_said_with_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NATS_LEADER_TLL", "5")
    assert LeaderSettings.from_celery({}).ttl == 10.0
    assert (
        "nats-leader: NATS_LEADER_TLL in the environment is not a setting; "
        "did you mean NATS_LEADER_TTL?"
    ) in caplog.text


def test_every_setting_has_a_variable() -> None:
    names = {environment.variable_for(f.name) for f in dataclasses.fields(LeaderSettings)}
    assert {"NATS_LEADER_SERVERS", "NATS_LEADER_METRICS_PORT", "NATS_LEADER_REQUIRED"} <= names
