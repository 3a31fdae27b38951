"""The Django admin as the least-privilege ``web`` user of ``deploy/nats/permissions.conf``.

The nats-server runs with the file as shipped (passwords from its
environment); an operator creates the buckets and the events stream as
``admin``, the candidates are processes connected as ``worker``, and the
Django project's ``NATS_LEADER`` connects as ``web``. Through the Django
test client, the status page shows the leader, its candidates and its
history, Resign hands the role over, and Fence ends the term of a frozen
leader (the conditional write of the fence marker) and raises the database
fence; ``check --deploy`` passes. With the same settings, what the web
process must not do is refused: creating or deleting a bucket, writing the
beat state or the once-guard.
"""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from celery_nats_leader.core.backend import Backend
from celery_nats_leader.core.errors import PermissionDeniedError
from celery_nats_leader.ops.oneshot import with_backend
from celery_nats_leader.testing import NatsServer
from django_nats_leader import checks, conf
from django_nats_leader.fencing import current_epoch
from tests.django.test_admin_operations import URL, operator
from tests.harness.candidate_control import CandidateGroup
from tests.integration.test_security import PASSWORDS, secured  # noqa: F401 - the server fixture, shared

pytestmark = [pytest.mark.django_db, pytest.mark.integration]

#: The bucket permissions.conf is written for.
BUCKET, ROLE = "leaders", "default"
#: Long: nothing here is explained by a key's expiry.
TTL = 30.0


def connect_as(settings: Any, server: NatsServer, user: str) -> None:
    """Point ``NATS_LEADER`` at ``server``, connecting as ``user``."""
    settings.NATS_LEADER = {
        "SERVERS": [server.url],
        "BUCKET": BUCKET,
        "TTL": TTL,
        "ROLES": [ROLE],
        "CONNECT_OPTIONS": {"user": user, "password": PASSWORDS[user]},
    }


@pytest.fixture
def deployed(secured: NatsServer, settings: Any) -> Iterator[CandidateGroup]:  # noqa: F811
    """The buckets and the events stream made by ``admin``; three candidates as ``worker``.

    ``cand-a`` leads; ``cand-b`` and ``cand-c`` follow it. ``NATS_LEADER``
    connects as ``web`` when the fixture yields.
    """
    connect_as(settings, secured, "admin")
    for args in (("--events-max-age", "3600", "--beat-state"), ("--once",)):
        call_command("election_bucket", "--create", *args, stdout=StringIO())
    worker_url = secured.url.replace("nats://", f"nats://worker:{PASSWORDS['worker']}@")
    with CandidateGroup(worker_url, role=ROLE, bucket=BUCKET, ttl=TTL) as group:
        group.spawn("cand-a")
        group.wait_for("promoted", {"cand-a"}, timeout=30)
        for name in ("cand-b", "cand-c"):
            group.spawn(name)
        for name in ("cand-b", "cand-c"):
            group.wait_for("ready", {name}, timeout=30)
            group.wait_for("leader", {name}, where=lambda e: e["leader_id"] == "cand-a")
        connect_as(settings, secured, "web")
        yield group


def test_the_web_user_shows_resigns_and_fences_from_the_admin(
    client: Client, deployed: CandidateGroup
) -> None:
    group = deployed
    operator(client, allowed=True)

    # The status page: the leader, its live candidates (the roster) and the history.
    response = client.get(URL)
    assert response.context["error"] == ""
    (row,) = response.context["rows"]
    assert (row.role, row.leader) == (ROLE, "cand-a")
    assert sorted(c.id for c in row.candidates) == ["cand-a", "cand-b", "cand-c"]
    transitions = response.context["histories"][ROLE]["transitions"]
    assert [(e.id, e.event.value) for e in transitions] == [("cand-a", "promoted")]
    assert client.get(URL + f"fence/{ROLE}/").status_code == 200  # the confirmation page

    # Resign: a request on the role's control subject.
    text = client.post(URL + f"resign/{ROLE}/", follow=True).content.decode()
    assert "Could not resign" not in text, text
    assert f"Cand-a stepped down from {ROLE}; new leader cand-" in text, text
    successor = group.wait_for("promoted", {"cand-b", "cand-c"}, timeout=5).name
    (other,) = {"cand-b", "cand-c"} - {successor}

    # Fence: the successor is frozen and cannot hand over, so its term ends
    # by the fence marker's write, and the database fence is raised.
    epoch = client.get(URL).context["rows"][0].epoch
    group[successor].pause()
    try:
        text = client.post(URL + f"fence/{ROLE}/", follow=True).content.decode()
        assert "Could not fence" not in text and "not raised" not in text, text
        assert (
            f"Fenced {successor} (epoch {epoch}) from {ROLE}: it did not answer a request "
            f"to hand over within 1s; new leader {other} (epoch " in text
        ), text
        fence = current_epoch(ROLE)
        assert fence is not None and fence > int(epoch)
        (row,) = client.get(URL).context["rows"]
        assert row.leader == other
    finally:
        group[successor].resume()


def test_the_web_user_passes_the_deploy_checks(deployed: CandidateGroup, settings: Any) -> None:
    # With the leader beat scheduler, `check --deploy` also reads the
    # settings of the beat state and once-guard buckets.
    settings.CELERY_BEAT_SCHEDULER = "django_nats_leader.schedulers:LeaderDatabaseScheduler"
    assert checks.check_server() == []


async def _create_a_bucket(backend: Backend) -> None:
    # Straight to the stream API: opening it first would be refused sooner
    # (the web user may not even read an unknown bucket's settings).
    await backend.create_stream(
        "KV_web_made", subjects=("$KV.web_made.>",), max_age=TTL, replicas=1, timeout=2
    )


async def _delete_the_bucket(backend: Backend) -> None:
    await backend.delete_bucket(BUCKET, timeout=2)


async def _write_beat_state(backend: Backend) -> None:
    kv = await backend.open_bucket(
        f"{BUCKET}_beat", ttl=None, create=False, replicas=1, timeout=2, persistent=True
    )
    await kv.put("nightly", b'{"last": 1}', timeout=2)


async def _claim_a_tick(backend: Backend) -> None:
    kv = await backend.open_bucket(
        f"{BUCKET}_once_leases", ttl=None, create=False, replicas=1, timeout=2
    )
    await kv.create("tick", b"{}", timeout=2)


@pytest.mark.parametrize(
    ("operation", "subject"),
    [
        (_create_a_bucket, r"\$js\.api\.stream\.create\.kv_web_made"),
        (_delete_the_bucket, r"\$js\.api\.stream\.delete\.kv_leaders"),
        (_write_beat_state, r"\$kv\.leaders_beat\.nightly"),
        (_claim_a_tick, r"\$kv\.leaders_once_leases\.tick"),
    ],
    ids=["create-bucket", "delete-bucket", "beat-state", "once-guard"],
)
def test_the_web_user_may_not(deployed: CandidateGroup, operation: Any, subject: str) -> None:
    with pytest.raises(PermissionDeniedError, match=rf"(?i){subject}"):
        with_backend(conf.leader_settings(), operation, timeout=5, name="web user test")
    assert deployed.validate("cand-a")  # nothing it tried reached the election
