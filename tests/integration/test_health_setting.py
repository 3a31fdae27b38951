"""The health-check setting end to end: a dotted path in the settings, a real server.

The leader's check starts failing; after ``HEALTH_CHECK_FAILURES`` failures
in a row it resigns (reason ``health_check_failed``, a ``released`` event)
and the healthy replica leads.
"""

from __future__ import annotations

import threading

import pytest

from celery_nats_leader import DemoteReason, Elector
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.testing import NatsServer
from tests.integration.helpers import ROLE, TTL

pytestmark = pytest.mark.integration

#: Which replicas are healthy (read by the checks, on worker threads).
HEALTHY = {"one": True, "two": True}


def one_ok() -> bool:
    return HEALTHY["one"]


def two_ok() -> bool:
    return HEALTHY["two"]


def replica(url: str, name: str) -> tuple[Elector, LeaderSettings]:
    settings = LeaderSettings.from_mapping(
        {
            "SERVERS": [url],
            "ROLES": [ROLE],
            "TTL": TTL,
            "CREATE_BUCKET": True,
            "INSTANCE_ID": name,
            "HEALTH_CHECK": f"{__name__}:{name}_ok",
            "HEALTH_CHECK_FAILURES": 2,
        }
    )
    elector = Elector(settings.servers)
    elector.add_role(settings.election_config(ROLE))
    return elector, settings


def test_a_leader_failing_its_configured_check_hands_over(nats_server: NatsServer) -> None:
    first, _ = replica(nats_server.url, "one")
    second, _ = replica(nats_server.url, "two")
    reasons: list[DemoteReason] = []
    demoted = threading.Event()

    def on_demote(reason: DemoteReason) -> None:
        reasons.append(reason)
        demoted.set()

    first.role(ROLE).on_demote(on_demote)
    try:
        first.start(timeout=10)
        assert first.role(ROLE).wait_for_leadership(TTL + 1)
        second.start(timeout=10)
        assert second.role(ROLE).leader_id == "one"

        HEALTHY["one"] = False
        assert demoted.wait(5 * TTL)
        assert reasons == [DemoteReason.HEALTH_CHECK_FAILED]
        assert second.role(ROLE).wait_for_leadership(TTL + 1)
        assert not first.role(ROLE).is_leader
    finally:
        HEALTHY["one"] = True
        second.stop()
        first.stop()
