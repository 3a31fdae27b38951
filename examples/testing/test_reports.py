"""Tests of an application built on celery-nats-leader, with the package's pytest plugin.

Run with ``pytest examples/testing`` (``pytest.ini`` here enables the plugin).
"""

from __future__ import annotations

from reports import close_books, nightly_report

from celery_nats_leader import ElectionConfig, Elector, NotLeaderError


def test_the_leader_writes_the_report(nats_leader_leadership):
    token = nats_leader_leadership.lead("reports")

    run = nats_leader_leadership.execute(nightly_report, "2026-11-27")

    assert run.state == "SUCCESS"
    assert run.result == f"report of 2026-11-27, term {token.epoch}"
    assert run.request.leader_token == token


def test_a_follower_skips_the_report(nats_leader_leadership):
    nats_leader_leadership.follow("reports")

    run = nats_leader_leadership.execute(nightly_report, "2026-11-27")

    assert run.state == "IGNORED"


def test_a_deposed_leader_does_not_close_the_books(nats_leader_leadership):
    # Its lease still runs, but NATS already gave the role to another process.
    nats_leader_leadership.lead("reports", valid=False)

    run = nats_leader_leadership.execute(close_books, "2026-11-27")

    assert run.state == "FAILURE"
    assert isinstance(run.result, NotLeaderError)
    nats_leader_leadership.lead("reports")
    assert nats_leader_leadership.execute(close_books, "2026-11-27").result == (
        "books of 2026-11-27 closed"
    )


def test_the_role_is_led_in_memory(nats_leader_elector):
    # The in-memory store: a real election, no server, milliseconds.
    reports = nats_leader_elector.add_role(ElectionConfig(role="reports", create_bucket=True))

    assert reports.wait_for_leadership(timeout=5)
    assert reports.leader_id == reports.config.instance_id
    assert reports.validate_token()


def test_one_leader_on_a_real_server(nats_leader_server):
    # A real nats-server (--nats-server-version picks which), two processes' electors.
    with Elector(nats_leader_server.url) as a, Elector(nats_leader_server.url) as b:
        first = a.add_role(ElectionConfig(role="reports", create_bucket=True))
        assert first.wait_for_leadership(timeout=10)

        second = b.add_role(ElectionConfig(role="reports", create_bucket=True))

        assert not second.is_leader
        assert second.leader_id == first.config.instance_id
