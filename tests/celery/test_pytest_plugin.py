"""The pytest plugin's leadership fixture, beyond what examples/testing shows.

The plugin is loaded here by its pytest11 entry point (the package is installed).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_nats_leader import install, leader_only
from celery_nats_leader.testing.pytest_plugin import Leadership
from celery_nats_leader.worker import shared_leadership


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("plugin", set_as_current=False)
    app.conf.update(broker_url="memory://", nats_leader_roles=["alpha", "beta"])
    install(app)
    yield app
    app.close()


def test_a_follower_gives_the_message_back_and_never_runs_the_body(
    app: Celery, nats_leader_leadership: Leadership
) -> None:
    runs: list[int] = []

    @app.task
    @leader_only(role="alpha")
    def count() -> int:
        runs.append(1)
        return len(runs)

    nats_leader_leadership.follow("alpha")
    assert nats_leader_leadership.execute(count).state == "REJECTED"
    nats_leader_leadership.lead("alpha")
    assert nats_leader_leadership.execute(count).result == 1
    nats_leader_leadership.follow("alpha")
    assert nats_leader_leadership.execute(count).state == "REJECTED"
    assert runs == [1]


def test_each_term_has_a_higher_epoch_and_roles_are_independent(
    nats_leader_leadership: Leadership,
) -> None:
    first = nats_leader_leadership.lead("alpha")
    second = nats_leader_leadership.lead("beta")
    third = nats_leader_leadership.lead("alpha")
    assert first.epoch < second.epoch < third.epoch
    assert shared_leadership.check_leadership("alpha").token == third
    assert shared_leadership.check_leadership("alpha", validate=True).token == third
    assert shared_leadership.check_leadership("beta").token == second
    nats_leader_leadership.follow("beta")
    assert shared_leadership.check_leadership("beta").reason == "not the leader"
    assert "does not campaign for 'gamma'" in shared_leadership.check_leadership("gamma").reason
    assert nats_leader_leadership.token("alpha") == third
    assert nats_leader_leadership.token("beta") is None


def test_an_ordinary_task_is_refused(app: Celery, nats_leader_leadership: Leadership) -> None:
    @app.task
    def plain() -> None: ...

    with pytest.raises(TypeError, match="not leader-only"):
        nats_leader_leadership.execute(plain)
