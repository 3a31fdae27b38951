"""The health-check settings: a callable or its dotted path, per role too."""

from __future__ import annotations

import pytest

from celery_nats_leader.config import resolve_health_check
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError

#: Module-level checks for the dotted paths below.
CALLS: list[str] = []


def healthy() -> bool:
    CALLS.append("healthy")
    return True


def reports_ok() -> bool:
    CALLS.append("reports")
    return False


class Checks:
    """A namespace: ``module:Checks.nested`` resolves attribute by attribute."""

    @staticmethod
    def nested() -> bool:
        return True


def test_dotted_paths_resolve_to_the_callables() -> None:
    assert resolve_health_check(f"{__name__}:healthy") is healthy
    assert resolve_health_check(f"{__name__}.healthy") is healthy
    assert resolve_health_check(f"{__name__}:Checks.nested") is Checks.nested
    assert resolve_health_check(healthy) is healthy
    assert resolve_health_check(None) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no.such.module:check", "health_check='no.such.module:check': cannot import it"),
        (f"{__name__}:missing", "cannot import it"),
        (f"{__name__}:CALLS", "is not callable"),
        (42, "must be a callable or a dotted path to one"),
    ],
)
def test_bad_values_fail_at_start_up_naming_the_setting(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LeaderSettings.from_mapping({"HEALTH_CHECK": value, "ROLES": ["default"]})


def test_django_style_settings_and_per_role_overrides() -> None:
    settings = LeaderSettings.from_mapping(
        {
            "ROLES": ["default", "reports"],
            "HEALTH_CHECK": f"{__name__}:healthy",
            "HEALTH_CHECK_INTERVAL": 5,
            "HEALTH_CHECK_FAILURES": 2,
            "ROLE_OPTIONS": {"reports": {"health_check": f"{__name__}:reports_ok"}},
        }
    )
    default, reports = settings.election_config("default"), settings.election_config("reports")
    assert default.health_check is healthy and reports.health_check is reports_ok
    assert (default.health_check_interval, default.health_check_failures) == (5.0, 2)
    assert settings.election_config("beat").health_check is healthy


def test_celery_settings() -> None:
    conf = {
        "nats_leader_roles": ["jobs"],
        "nats_leader_health_check": f"{__name__}:healthy",
        "nats_leader_health_check_failures": 1,
    }
    settings = LeaderSettings.from_celery(conf)
    config = settings.election_config("jobs")
    assert config.health_check is healthy and config.health_check_failures == 1
    # No health check unless configured.
    assert LeaderSettings.from_celery({}).election_config("default").health_check is None
