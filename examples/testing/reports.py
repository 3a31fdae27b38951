"""A Celery app with leader-only tasks: the code under test of ``test_reports.py``."""

from __future__ import annotations

from celery import Celery

from celery_nats_leader import FencingToken, install, leader_only

app = Celery("reports")
app.conf.nats_leader_roles = ["reports"]
install(app)


@app.task
@leader_only(role="reports", on_follower="skip")
def nightly_report(day: str, leader_token: FencingToken) -> str:
    """Only the leader of "reports" writes the report, stamped with its term."""
    return f"report of {day}, term {leader_token.epoch}"


@app.task
@leader_only(role="reports", validate=True, on_follower="raise")
def close_books(day: str) -> str:
    """Confirms the term against NATS first: a deposed leader must not close the books."""
    return f"books of {day} closed"
