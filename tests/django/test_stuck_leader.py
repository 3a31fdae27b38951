"""A stuck leader, as the Django operator commands see it and end it.

The leader is a child process frozen with SIGSTOP (it cannot renew nor
answer); its key still names it until it expires. ``election_status`` must
say it is not answering (``--strict``: exit 1), and ``election_fence`` must
end its term: the follower leads at once, the frozen leader's fenced check
fails when it runs again, and the database fence refuses its epoch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_nats_leader.ops.fence_leader import FenceOutcome
from celery_nats_leader.term.token import ALLCALL_EPOCH_FLOOR
from celery_nats_leader.testing import NatsServer
from django_nats_leader.fencing import StaleLeaderError, current_epoch, fenced
from django_nats_leader.management.commands import election_fence
from tests.django.conftest import Candidates, require_postgres
from tests.django.test_admin_operations import URL, operator
from tests.harness.candidate_control import CandidateGroup

pytestmark = pytest.mark.integration

#: Long enough that nothing in these tests is explained by the key's expiry.
TTL = 30.0
ROLE = "default"


@pytest.fixture
def frozen(
    nats_server: NatsServer, bucket: str, nats_leader: Any
) -> Iterator[tuple[CandidateGroup, str, int]]:
    """Two candidate processes; the leader ("a") is frozen. Yields (group, follower, epoch)."""
    nats_leader(TTL=TTL)
    with CandidateGroup(nats_server.url, role=ROLE, bucket=bucket, ttl=TTL) as group:
        group.spawn("a", create_bucket=True)
        first = group.wait_for("promoted", {"a"}, timeout=30)
        group.spawn("b")
        group.wait_for("ready", {"b"}, timeout=30)
        group.wait_for("leader", {"b"}, timeout=5, where=lambda e: e["leader_id"] == "a")
        group["a"].pause()
        yield group, "b", first["epoch"]
        group["a"].resume()


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_status_says_a_frozen_leader_is_not_answering(
    frozen: tuple[CandidateGroup, str, int],
) -> None:
    _, follower, _ = frozen
    leader = "a"
    doc = json.loads(run("election_status", "--json"))
    (role,) = doc["roles"]
    assert (role["leader_id"], role["has_leader"], role["answering"]) == (leader, True, False)
    assert doc["leaderless"] == [] and doc["silent"] == [ROLE]
    # Upper bound from the follower's own view: at most one TTL from when it saw
    # the last renewal, which was before the freeze.
    assert 0 < role["expires_within"] <= TTL
    assert role["note"] == f"not answering; its key expires within {role['expires_within']:.1f} s"
    assert [c["id"] for c in role["candidates"]] == [follower]

    text = run("election_status")
    assert "1 leader not answering" in text
    assert f"{ROLE}: {leader}: not answering; its key expires within" in text

    with pytest.raises(CommandError, match="leader not answering for role") as info:
        run("election_status", "--strict")
    assert info.value.returncode == 1


@pytest.mark.django_db
def test_fence_ends_the_frozen_term_and_raises_the_database_fence(
    frozen: tuple[CandidateGroup, str, int],
) -> None:
    group, follower, epoch = frozen
    leader = "a"
    doc = json.loads(run("election_fence", ROLE, "--json"))
    # Asked first: a frozen leader cannot answer, so it was fenced, and the output says so.
    assert (doc["action"], doc["reason"]) == (
        "fenced",
        "it did not answer a request to hand over within 1s",
    )
    assert doc["fenced"] == {"id": leader, "epoch": epoch}
    assert doc["new_leader"]["id"] == follower
    assert doc["revision"] > epoch
    assert doc["new_leader"]["epoch"] > doc["revision"]
    # Promoted on the fence's write, not when a lease ran out (TTL 30 s); how
    # fast is benchmarks/fence.py's measure (tens of ms), not this test's.
    assert doc["promoted_after"] < 2.0
    # The database refuses the frozen term now, before the successor wrote anything.
    assert doc["database_epoch"] == doc["revision"] == current_epoch(ROLE)
    with pytest.raises(StaleLeaderError), fenced(ROLE, f"{epoch}:old-term"):
        pass

    group["a"].resume()
    assert not group.validate(leader)
    assert group.wait_for("demoted", {leader}, timeout=5)["reason"] == "fenced"
    assert group.validate(follower)
    # Status now: the follower leads and answers.
    (role,) = json.loads(run("election_status", "--json", "--strict"))["roles"]
    assert (role["leader_id"], role["answering"], role["note"]) == (follower, True, None)


@pytest.mark.django_db
def test_a_fence_whose_wait_for_the_successor_fails_still_reports_the_ended_term(
    frozen: tuple[CandidateGroup, str, int],
    nats_server: NatsServer,
    monkeypatch: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # NATS goes away right after the term ended (and before the wait
    # for the successor, on a connection of its own): the term has ended and
    # the database fence is raised, so the command succeeds (exit 0) and says
    # so, without a successor; a script retrying on an error would otherwise
    # end the successor's term.
    _, _, epoch = frozen
    original = election_fence.fence_role

    def fence_then_nats_goes_away(*args: Any, **kwargs: Any) -> FenceOutcome:
        outcome = original(*args, **kwargs)
        nats_server.stop()
        # The follower campaigns as soon as it sees the marker: its record can
        # reach the fence's watch before the fence returns, and is then
        # reported at once. This test is of a successor not seen by then.
        return dataclasses.replace(outcome, successor=None, promoted_after=None)

    monkeypatch.setattr(election_fence, "fence_role", fence_then_nats_goes_away)
    try:
        doc = json.loads(run("election_fence", ROLE, "--json", "--timeout", "1", "--wait", "5"))
    finally:
        nats_server.start()  # same port and store, for the fixture's teardown
    assert (doc["action"], doc["fenced"]) == ("fenced", {"id": "a", "epoch": epoch})
    assert doc["new_leader"] is None
    assert doc["database_epoch"] == doc["revision"] == current_epoch(ROLE)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        m.startswith(f"the term of {ROLE!r} ended; could not wait for its successor: ")
        for m in warned
    ), warned


@pytest.mark.django_db
def test_a_database_fence_of_the_other_strategy_is_reported_beside_the_ended_term(
    frozen: tuple[CandidateGroup, str, int],
) -> None:
    # The role ran on ALLCALL before (its fence holds a millisecond epoch):
    # that is not a successor's higher epoch but a fence the KV term cannot be
    # ordered against. The term has ended all the same: the command says so
    # (exit 0, the outcome printed) and tells the operator what to run for the
    # database fence. Exiting 2 without the outcome invited a retry, which
    # would have ended the successor's term.
    _, _, epoch = frozen
    allcall_epoch = ALLCALL_EPOCH_FLOOR + 5
    with fenced(ROLE, f"{allcall_epoch}:allcall-term"):
        pass
    out, err = StringIO(), StringIO()
    call_command("election_fence", ROLE, "--json", "--wait", "0", stdout=out, stderr=err)
    doc = json.loads(out.getvalue())
    assert (doc["action"], doc["fenced"]) == ("fenced", {"id": "a", "epoch": epoch})
    assert doc["database_epoch"] is None
    assert "manage.py election_fence_reset" in doc["database_problem"]
    warning = err.getvalue()
    assert f"database fence of {ROLE!r} not raised" in warning
    assert f"holds epoch {allcall_epoch}, a term of the 'allcall' strategy" in warning
    assert f"manage.py election_fence_reset {ROLE}" in warning
    assert current_epoch(ROLE) == allcall_epoch


def test_fence_without_a_leader_exits_1(nats_leader: Any, bucket: str) -> None:
    from celery_nats_leader import ElectionConfig, Elector

    # The bucket exists (a candidate made it) but nobody holds the role any more.
    with Elector(nats_leader()["SERVERS"][0]) as elector:
        elector.add_role(ElectionConfig(role="other", bucket=bucket, ttl=2, create_bucket=True))
    with pytest.raises(CommandError, match="nobody leads") as info:
        run("election_fence", ROLE, "--no-database")
    assert info.value.returncode == 1


@pytest.mark.django_db
def test_a_fenced_role_without_candidates_has_no_leader(
    nats_server: NatsServer, bucket: str, nats_leader: Any
) -> None:
    nats_leader(TTL=TTL)
    with CandidateGroup(nats_server.url, role=ROLE, bucket=bucket, ttl=TTL) as group:
        group.spawn("a", create_bucket=True)
        group.wait_for("promoted", {"a"}, timeout=30)
        group["a"].pause()
        try:
            doc = json.loads(run("election_fence", ROLE, "--json", "--wait", "0.2"))
            assert doc["new_leader"] is None
            status = json.loads(_status_json())["roles"]
            (fenced,) = [r for r in status if r["role"] == ROLE]
            assert (fenced["has_leader"], fenced["fenced"]["id"]) == (False, "a")
            assert fenced["note"].startswith("fenced: the term of a (epoch ")
            with pytest.raises(CommandError, match="nobody leads") as info:
                run("election_resign", ROLE)
            assert info.value.returncode == 1
        finally:
            group["a"].resume()
        # The fenced process sits out one TTL: it does not take its role back at once.
        assert group.validate("a") is False


def _status_json() -> str:
    out = StringIO()
    with pytest.raises(CommandError):  # nobody leads a configured role: exit 1
        call_command("election_status", "--json", stdout=out, stderr=StringIO())
    return out.getvalue()


class FenceRowsToPostgres:
    """A database router: the fence's rows live in PostgreSQL (as a project would route them)."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "postgres" if model._meta.app_label == "django_nats_leader" else None

    db_for_write = db_for_read


@pytest.fixture
def successor_writes_first(
    nats_server: NatsServer, bucket: str, nats_leader: Any, settings: Any, monkeypatch: Any
) -> Iterator[tuple[int, list[int]]]:
    """A frozen leader "a" and a live follower "b" in this process whose first fenced
    write lands right after the term ends and before the command raises the database fence
    (``fence_role`` returns to the command only after it). Yields (a's epoch, b's writes).
    """
    require_postgres()
    settings.DATABASE_ROUTERS = [FenceRowsToPostgres()]
    nats_leader(TTL=TTL)
    successors = Candidates(nats_server.url, bucket, TTL)
    writes: list[int] = []
    original = election_fence.fence_role

    def fence_then_the_successor_writes(*args: Any, **kwargs: Any) -> FenceOutcome:
        outcome = original(*args, **kwargs)
        handle = successors.handle("b")
        assert handle.wait_for_leadership(5)
        token = handle.token
        assert token is not None
        with fenced(ROLE, token, holder="b"):
            writes.append(token.epoch)
        return outcome

    monkeypatch.setattr(election_fence, "fence_role", fence_then_the_successor_writes)
    with CandidateGroup(nats_server.url, role=ROLE, bucket=bucket, ttl=TTL) as group:
        group.spawn("a", create_bucket=True)
        first = group.wait_for("promoted", {"a"}, timeout=30)
        group["a"].pause()
        try:
            successors.start("b")  # follows the frozen "a": its key lasts 30 s
            yield first["epoch"], writes
        finally:
            group["a"].resume()
            successors.stop()


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_a_successor_that_writes_before_the_database_fence_is_success(
    successor_writes_first: tuple[int, list[int]],
) -> None:
    epoch, writes = successor_writes_first
    doc = json.loads(run("election_fence", ROLE, "--json"))
    assert (doc["action"], doc["fenced"]) == ("fenced", {"id": "a", "epoch": epoch})
    assert doc["new_leader"]["id"] == "b"
    assert writes == [doc["new_leader"]["epoch"]]
    # The successor's write raised the fence above the marker: the command reports it.
    assert doc["database_epoch"] == writes[0] == current_epoch(ROLE) > doc["revision"] > epoch
    with pytest.raises(StaleLeaderError), fenced(ROLE, f"{epoch}:old-term"):
        pass


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_the_admin_says_fenced_when_the_successor_wrote_first(
    successor_writes_first: tuple[int, list[int]], client: Any
) -> None:
    epoch, writes = successor_writes_first
    operator(client, allowed=True)
    response = client.post(URL + f"fence/{ROLE}/", follow=True)
    text = response.content.decode()
    assert "Could not fence" not in text
    assert (
        f"Fenced a (epoch {epoch}) from {ROLE}: it did not answer a request to hand over "
        f"within 1s; new leader b (epoch {writes[0]})." in text
    ), text
    assert current_epoch(ROLE) == writes[0]
