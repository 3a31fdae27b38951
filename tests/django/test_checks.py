"""System checks: bad settings without the network, and under --deploy a real server."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from celery_nats_leader.testing import NatsServer, free_port
from tests.django.conftest import Candidates


def messages(deploy: bool = False) -> list[checks.CheckMessage]:
    return checks.run_checks(tags=["nats_leader"], include_deployment_checks=deploy)


def ids(deploy: bool = False) -> list[str]:
    return [m.id for m in messages(deploy) if m.id]


def only(message_id: str, deploy: bool = False) -> checks.CheckMessage:
    found = [m for m in messages(deploy) if m.id == message_id]
    assert len(found) == 1, [(m.id, m.msg) for m in messages(deploy)]
    return found[0]


def test_valid_settings_pass(settings: Any) -> None:
    settings.NATS_LEADER = {
        "SERVERS": ["nats://127.0.0.1:4222"],
        "ROLES": ["default", "reports.nightly"],
        "TTL": 9,
        "HEARTBEAT_INTERVAL": 3,
        "ROLE_OPTIONS": {"reports.nightly": {"priority": 3}},
    }
    assert messages() == []


def test_not_a_dict(settings: Any) -> None:
    settings.NATS_LEADER = "nats://127.0.0.1:4222"
    message = only("nats_leader.E001")
    assert isinstance(message, checks.Error)
    assert "must be a dict" in message.msg
    assert "NATS_LEADER = {" in (message.hint or "")


def test_unknown_key_suggests_the_right_one(settings: Any) -> None:
    settings.NATS_LEADER = {"TLL": 10, "ROLES": ["default"]}
    message = only("nats_leader.E002")
    assert "'TLL'" in message.msg
    assert (message.hint or "").startswith("Did you mean 'TTL'?")


def test_invalid_role_names(settings: Any) -> None:
    settings.NATS_LEADER = {"ROLES": ["default", "bad role!"], "BEAT_ROLE": ".beat"}
    found = [m for m in messages() if m.id == "nats_leader.E003"]
    assert sorted(m.msg for m in found) == [
        "NATS_LEADER['BEAT_ROLE'] names an invalid role '.beat'.",
        "NATS_LEADER['ROLES'] names an invalid role 'bad role!'.",
    ]
    assert all("letters, digits" in (m.hint or "") for m in found)


def test_ttl_shorter_than_three_heartbeats(settings: Any) -> None:
    settings.NATS_LEADER = {"TTL": 5, "HEARTBEAT_INTERVAL": 2}
    message = only("nats_leader.E004")
    assert "TTL=5s is shorter than 3 heartbeats of HEARTBEAT_INTERVAL=2s" in message.msg
    assert "Set HEARTBEAT_INTERVAL to at most 1.67" in (message.hint or "")
    assert "raise TTL to at least 6" in (message.hint or "")


def test_ttl_ratio_per_role(settings: Any) -> None:
    settings.NATS_LEADER = {
        "ROLES": ["default"],
        "ROLE_OPTIONS": {"default": {"ttl": 10, "heartbeat_interval": 4}},
    }
    message = only("nats_leader.E004")
    assert "ROLE_OPTIONS['default']" in message.msg


def test_celery_setting_is_checked_too(settings: Any) -> None:
    # CELERY_NATS_LEADER_* overrides NATS_LEADER: the merged values are checked.
    settings.NATS_LEADER = {"HEARTBEAT_INTERVAL": 3}
    settings.CELERY_NATS_LEADER_TTL = 6
    assert "TTL=6s" in only("nats_leader.E004").msg


def test_other_invalid_value(settings: Any) -> None:
    settings.NATS_LEADER = {"PRIORITY": "high"}
    message = only("nats_leader.E005")
    assert "priority='high' must be an integer" in message.msg


def test_roles_of_one_bucket_with_different_ttls(settings: Any) -> None:
    settings.NATS_LEADER = {"ROLES": ["default"], "TTL": 10, "ROLE_OPTIONS": {"beat": {"ttl": 5}}}
    message = only("nats_leader.E006")
    assert "(5s, 10s)" in message.msg
    assert "own BUCKET" in (message.hint or "")


def test_manage_py_check_fails_on_bad_settings(settings: Any) -> None:
    settings.NATS_LEADER = {"TTL": 5, "HEARTBEAT_INTERVAL": 2}
    with pytest.raises(SystemCheckError, match=r"nats_leader\.E004"):
        call_command("check", stdout=StringIO(), stderr=StringIO())


def test_plain_check_never_touches_the_network(settings: Any) -> None:
    settings.NATS_LEADER = {"SERVERS": [f"nats://127.0.0.1:{free_port()}"]}
    assert messages(deploy=False) == []


# ------------------------------------------------------------------ --deploy


@pytest.mark.integration
def test_deploy_unreachable_server(settings: Any) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    settings.NATS_LEADER = {"SERVERS": [url]}
    message = only("nats_leader.W010", deploy=True)
    assert isinstance(message, checks.Warning)
    assert url in message.msg
    assert "nats-server -js" in (message.hint or "")
    settings.NATS_LEADER = {"SERVERS": [url], "REQUIRED": True}
    assert isinstance(only("nats_leader.E010", deploy=True), checks.Error)


@pytest.mark.integration
def test_deploy_missing_bucket(nats_leader: Any, bucket: str) -> None:
    message = only("nats_leader.E011", deploy=True)
    assert f"KV bucket {bucket!r} does not exist" in message.msg
    assert "manage.py election_bucket --create" in (message.hint or "")
    assert f"nats kv add {bucket} --ttl 2s --history 1" in (message.hint or "")
    nats_leader(CREATE_BUCKET=True)
    assert ids(deploy=True) == []


@pytest.mark.integration
def test_deploy_bucket_ttl_mismatch(candidates: Candidates, nats_leader: Any) -> None:
    candidates.start("cand-a")  # creates the bucket with max_age 2s
    assert ids(deploy=True) == []
    nats_leader(TTL=4)
    message = only("nats_leader.E012", deploy=True)
    assert "max_age=2s but the election TTL is 4s" in message.msg
    assert "NATS_LEADER['TTL'] = 2" in (message.hint or "")


@pytest.mark.integration
def test_deploy_no_jetstream(settings: Any) -> None:
    with NatsServer(jetstream=False) as plain:
        settings.NATS_LEADER = {"SERVERS": [plain.url]}
        message = only("nats_leader.E013", deploy=True)
    assert "JetStream" in message.msg


@pytest.mark.integration
def test_deploy_beat_state_bucket(candidates: Candidates, nats_leader: Any, settings: Any) -> None:
    candidates.start("cand-a")  # the election bucket exists, the state bucket not
    settings.CELERY_BEAT_SCHEDULER = "celery_nats_leader.beat:LeaderScheduler"
    assert sorted(ids(deploy=True)) == ["nats_leader.E011", "nats_leader.W015", "nats_leader.W015"]
    message = only("nats_leader.E011", deploy=True)
    assert "the beat schedule's state" in message.msg
    assert "--history 1`, no TTL" in (message.hint or "")
    once = [m for m in messages(True) if m.id == "nats_leader.W015"]
    assert "the once-guard's, which ticks are claimed in" in once[0].msg
    assert "`manage.py election_bucket --create`" in (once[0].hint or "")
    call_command("election_bucket", "--create", stdout=StringIO())
    assert ids(deploy=True) == []


@pytest.mark.integration
def test_check_deploy_command(nats_leader: Any) -> None:
    with pytest.raises(SystemCheckError, match=r"nats_leader\.E011"):
        call_command(
            "check", "--deploy", "--tag", "nats_leader", stdout=StringIO(), stderr=StringIO()
        )
