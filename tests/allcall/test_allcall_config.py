"""ALLCALL settings: the seed's defaults, validation, and the KV defaults left alone."""

from __future__ import annotations

import pytest

from celery_nats_leader import ConfigError, ElectionConfig
from celery_nats_leader.config.settings import LeaderSettings


def test_seed_defaults() -> None:
    cfg = ElectionConfig(strategy="allcall")
    assert cfg.ttl == 10.0  # the seed's leaseTime
    assert cfg.heartbeat_interval == 1.0  # heartBeat
    assert cfg.max_clock_skew == 1.0  # maxClockSkew
    assert cfg.request_timeout == 0.5
    assert cfg.disconnect_grace == 2.0


def test_short_leases_get_a_quarter_lease_heartbeat() -> None:
    cfg = ElectionConfig(strategy="allcall", ttl=2, max_clock_skew=0.2)
    assert cfg.heartbeat_interval == 0.5


def test_kv_defaults_are_unchanged() -> None:
    cfg = ElectionConfig(ttl=10)
    assert cfg.strategy == "kv"
    assert cfg.heartbeat_interval == 2.5  # ttl / 4, as before
    assert cfg.lease_margin == pytest.approx(1.0)
    # Ignored by KV, so not limited by its ttl either.
    assert ElectionConfig(ttl=1, max_clock_skew=30).max_clock_skew == 30


def test_everything_is_configurable() -> None:
    cfg = ElectionConfig(strategy="allcall", ttl=30, heartbeat_interval=2, max_clock_skew=0)
    assert (cfg.ttl, cfg.heartbeat_interval, cfg.max_clock_skew) == (30, 2, 0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_clock_skew": -1}, "max_clock_skew=-1 must be a non-negative number of seconds"),
        ({"max_clock_skew": "1s"}, "max_clock_skew='1s' must be a number of seconds"),
        (
            {"max_clock_skew": 6},
            "max_clock_skew=6.0 is out of range: it must be between 0 and ttl * 0.5 = 5 seconds",
        ),
        ({"heartbeat_interval": 4}, "heartbeat_interval=4.0 is too long for ttl=10.0"),
        ({"ttl": 0.1}, "ttl=0.1 is out of range"),
    ],
)
def test_bad_values_name_the_field_value_and_range(
    kwargs: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        ElectionConfig(strategy="allcall", **kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_settings_select_the_strategy_and_pass_the_skew_per_role() -> None:
    settings = LeaderSettings.from_mapping(
        {
            "STRATEGY": "allcall",
            "ROLES": "beat",
            "ROLE_OPTIONS": {"beat": {"max_clock_skew": 0.5}},
        }
    )
    cfg = settings.election_config("beat")
    assert cfg.strategy == "allcall" and cfg.max_clock_skew == 0.5
    assert cfg.heartbeat_interval == 1.0
    assert ElectionConfig.from_mapping({"strategy": "allcall", "max_clock_skew": 0.25})
