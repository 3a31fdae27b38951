"""Configuration validation: every bad value names the field and what to change."""

from __future__ import annotations

import re

import pytest

from celery_nats_leader import ConfigError, ElectionConfig, FencingToken
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import RecordFormatError
from celery_nats_leader.term.record import decode_record, encode_record


def test_defaults_are_derived_from_ttl() -> None:
    cfg = ElectionConfig(ttl=8)
    assert cfg.heartbeat_interval == 2.0
    assert cfg.request_timeout == 1.0
    assert cfg.lease_margin == pytest.approx(0.8)
    assert cfg.disconnect_grace == 4.0
    assert cfg.resync_interval == 2.0
    assert cfg.lease_seconds == pytest.approx(7.2)
    assert cfg.bucket == "leaders" and cfg.role == "default"
    assert cfg.instance_id.count(":") == 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"ttl": 0.1}, "ttl=0.1 is out of range"),
        ({"ttl": 10, "heartbeat_interval": 4}, "at least 3 x heartbeat_interval"),
        ({"ttl": 10, "request_timeout": 2.5}, "request_timeout=2.5 must be shorter"),
        ({"ttl": 10, "lease_margin": 7}, "lease_margin=7.0 leaves no room"),
        ({"ttl": 10, "disconnect_grace": 9.5}, "disconnect_grace=9.5 is longer than the lease"),
        (
            {"ttl": 10, "disconnect_grace": 0.1},
            "disconnect_grace=0.1 is shorter than 2 x heartbeat_interval (5): a leader would "
            "step down on a reconnect that costs one renewal; set disconnect_grace >= 5",
        ),
        (
            {"ttl": 10, "heartbeat_interval": 2, "disconnect_grace": 3.99},
            "disconnect_grace=3.99 is shorter than 2 x heartbeat_interval (4)",
        ),
        (
            {"ttl": 1, "heartbeat_interval": 0.3, "lease_margin": 0.45},
            "disconnect_grace=0.6 is longer than the lease (ttl - lease_margin = 0.55)",
        ),
        ({"role": "bad role"}, "role='bad role' is not a valid role name"),
        ({"role": ".beat"}, "not a valid role name"),
        ({"bucket": "a.b"}, "bucket='a.b' is not a valid KV bucket name"),
        ({"ttl": "10"}, "ttl='10' must be a number of seconds"),
        ({"ttl": -1}, "must be a non-negative number"),
        ({"priority": 1.5}, "priority=1.5 must be an integer"),
        ({"validation_interval": 0.1}, "validation_interval=0.1 is shorter than heartbeat"),
        ({"health_check_failures": 0}, "health_check_failures=0"),
        ({"bucket_replicas": 7}, "bucket_replicas=7"),
        ({"instance_id": " "}, "instance_id must be a non-empty string"),
        ({"strategy": "raft"}, "strategy='raft' is unknown"),
        ({"demote_timeout": 0}, "demote_timeout=0.0 must be positive"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        ElectionConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["kv", "allcall"])
def test_disconnect_grace_of_exactly_two_heartbeats_is_the_default_and_accepted(
    strategy: str,
) -> None:
    default = ElectionConfig(ttl=10, strategy=strategy)  # type: ignore[arg-type]
    assert default.disconnect_grace == 2 * default.heartbeat_interval
    explicit = ElectionConfig(
        ttl=10,
        strategy=strategy,  # type: ignore[arg-type]
        disconnect_grace=2 * default.heartbeat_interval,
    )
    assert explicit.disconnect_grace == default.disconnect_grace


def test_from_mapping_rejects_unknown_names() -> None:
    with pytest.raises(ConfigError, match="unknown election setting\\(s\\) tll"):
        ElectionConfig.from_mapping({"tll": 5})


def test_metrics_namespace_from_celery_and_django_settings() -> None:
    assert LeaderSettings().metrics_namespace == "nats_leader"
    django = LeaderSettings.from_mapping({"METRICS_NAMESPACE": "billing_leader"})
    assert django.metrics_namespace == "billing_leader"
    celery = LeaderSettings.from_celery({"nats_leader_metrics_namespace": "billing_leader"})
    assert celery.metrics_namespace == "billing_leader"
    for bad in ("", "9lives", "nats-leader", "a:b"):
        with pytest.raises(ConfigError, match="metrics_namespace"):
            LeaderSettings(metrics_namespace=bad)


def test_fast_failover_from_celery_django_and_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NATS_LEADER_FAST_FAILOVER", raising=False)
    assert LeaderSettings().election_config("beat").fast_failover is False
    celery = LeaderSettings.from_celery({"nats_leader_fast_failover": True})
    django = LeaderSettings.from_mapping({"FAST_FAILOVER": True})
    monkeypatch.setenv("NATS_LEADER_FAST_FAILOVER", "true")
    environment = LeaderSettings.from_mapping({})
    for settings in (celery, django, environment):
        assert settings.election_config("beat").fast_failover is True
        assert settings.election_config("default").fast_failover is True
    # ALLCALL has no use for it: refused, under the name the user wrote.
    monkeypatch.delenv("NATS_LEADER_FAST_FAILOVER")
    with pytest.raises(ConfigError, match=r"nats_leader_fast_failover is for the KV strategy"):
        LeaderSettings.from_celery(
            {"nats_leader_fast_failover": True, "nats_leader_strategy": "allcall"}
        )


def test_beat_metrics_port_is_a_port_of_its_own() -> None:
    settings = LeaderSettings.from_celery(
        {"nats_leader_metrics_port": 9808, "nats_leader_beat_metrics_port": 9809}
    )
    assert (settings.metrics_port, settings.beat_metrics_port) == (9808, 9809)
    assert LeaderSettings.from_mapping({"BEAT_METRICS_PORT": 0}).beat_metrics_port == 0
    with pytest.raises(ConfigError, match=r"beat_metrics_port=9808 is metrics_port too"):
        LeaderSettings(metrics_port=9808, beat_metrics_port=9808)
    with pytest.raises(ConfigError, match=r"beat_metrics_port=70000 must be a TCP port"):
        LeaderSettings(beat_metrics_port=70000)


def test_settings_per_role_options_and_errors() -> None:
    settings = LeaderSettings.from_mapping(
        {"TTL": 6, "ROLES": "default,reports", "ROLE_OPTIONS": {"reports": {"priority": 5}}}
    )
    assert settings.roles == ("default", "reports")
    assert settings.election_config("reports").priority == 5
    assert settings.election_config("default").priority == 0
    assert settings.queue_for("reports") == "nats_leader.reports"
    assert settings.election_config("default").demote_timeout == 5.0
    assert LeaderSettings(demote_timeout=1.5).election_config("default").demote_timeout == 1.5
    with pytest.raises(ConfigError, match=r"for role 'default': heartbeat_interval=3\.0"):
        LeaderSettings(ttl=6, heartbeat_interval=3)
    with pytest.raises(ConfigError, match="unknown nats_leader setting 'TLL'"):
        LeaderSettings.from_mapping({"TLL": 1})


def test_record_round_trip_and_first_write_epoch() -> None:
    raw = encode_record(instance_id="a:1:x", token="t-1", epoch=None, priority=3, meta={"h": 1})
    record = decode_record(raw, revision=41)
    assert (record.id, record.token, record.epoch, record.priority) == ("a:1:x", "t-1", 41, 3)
    renewed = decode_record(
        encode_record(instance_id="a:1:x", token="t-1", epoch=41, priority=3, meta={}), 57
    )
    assert renewed.epoch == 41 and renewed.revision == 57


@pytest.mark.parametrize(
    "raw", [b"", b"not json", b"[]", b'{"id": "x"}', b'{"id":"x","token":"t","epoch":-3}']
)
def test_foreign_values_are_rejected(raw: bytes) -> None:
    with pytest.raises(RecordFormatError):
        decode_record(raw, revision=5)


def test_token_header_round_trip_and_ordering() -> None:
    token = FencingToken(412, "9f2c0000-aaaa-bbbb-cccc-000000000000")
    assert FencingToken.from_header(token.to_header()) == token
    assert FencingToken(413, "a") > token
    assert "9f2c0000…" in repr(token) and "cccc" not in repr(token)
    with pytest.raises(RecordFormatError):
        FencingToken.from_header("abc")


#: ElectionConfig fields that are per role only (``role_options``), not process settings.
PER_ROLE_ONLY = {
    "role",
    "lease_margin",
    "resync_interval",
    "campaign_jitter",
    "priority_step",
    "release_on_stop",
    "meta",
}


def test_settings_election_fields_are_election_config_fields_with_its_defaults() -> None:
    import dataclasses

    config_fields = {f.name: f for f in dataclasses.fields(ElectionConfig)}
    shared = {
        f.name: f for f in dataclasses.fields(LeaderSettings) if "election_config" in f.metadata
    }
    # A new ElectionConfig field is either a process setting (one election_field line
    # in LeaderSettings) or deliberately per role only: this test makes someone decide.
    assert sorted(set(config_fields) - set(shared) - PER_ROLE_ONLY) == []
    assert set(shared) <= set(config_fields)
    for name, f in shared.items():
        source = config_fields[name]
        assert (f.default, f.default_factory) == (source.default, source.default_factory), name


def test_every_election_setting_reaches_every_role_config() -> None:
    values = {
        "bucket": "b2",
        "ttl": 12.0,
        "heartbeat_interval": 2.0,
        "request_timeout": 0.5,
        "disconnect_grace": 5.0,
        "validation_interval": 4.0,
        "priority": 7,
        "allow_takeover": True,
        "instance_id": "me",
        "create_bucket": True,
        "bucket_replicas": 3,
        "strategy": "allcall",
        "max_clock_skew": 0.25,
        "health_check": "celery_nats_leader.worker.health:broker_reachable",
        "health_check_interval": 3.0,
        "health_check_failures": 5,
    }
    settings = LeaderSettings(roles=("a", "b"), **values)  # type: ignore[arg-type]
    for role in ("a", "b", "beat"):
        config = settings.election_config(role)
        assert config.role == role
        seen = {name: getattr(config, name) for name in values}
        assert callable(seen.pop("health_check"))
        values_without_check = {k: v for k, v in values.items() if k != "health_check"}
        assert seen == values_without_check
    # Defaults: an empty settings object gives ElectionConfig's own defaults.
    default = LeaderSettings().election_config("default")
    reference = ElectionConfig(role="default", instance_id=default.instance_id)
    assert default == reference
