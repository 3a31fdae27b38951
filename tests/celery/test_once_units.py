"""Fast tests of the once-guard's Celery wiring (no worker, broker or NATS server).

Outside a worker execution (direct calls, eager tasks) the guard stays out of
the way; under ``@leader_only`` the guard still recognises the task it guards.
The guard's behaviour on real workers is in ``tests/beat/test_once_worker.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer

from celery_nats_leader import install, leader_only
from celery_nats_leader.recipes.once_guard import Claim, Verdict
from celery_nats_leader.worker.once_tasks import OnceService, OnceTask, run_once
from celery_nats_leader.worker.tasks import leader_options


@pytest.fixture
def app() -> Iterator[Celery]:
    # NATS at a port nobody listens on: any attempt to claim would fail.
    app = Celery("once-units", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        nats_leader_servers="nats://127.0.0.1:1",
        nats_leader_roles=["alpha"],
    )
    install(app)
    yield app
    app.close()


def test_run_once_under_leader_only_keeps_both_marks(app: Celery) -> None:
    calls: list[int] = []

    def double(x: int) -> int:
        calls.append(x)
        return 2 * x

    task: Any = app.task(name="units.double")(leader_only(role="alpha")(run_once(double)))
    # The leader-only machinery still sees its task, and the guard its body.
    options = leader_options(task)
    assert options is not None and options.role == "alpha"
    assert task.run.__nats_leader_once__ is double
    # Direct calls run unguarded (and unchecked): no NATS needed.
    assert task(3) == 6 and calls == [3]


def test_eager_and_direct_calls_of_a_once_task_run_unguarded(app: Celery) -> None:
    runs: list[str] = []

    @app.task(base=OnceTask, bind=True, name="units.once")
    def once(self: Any, label: str) -> str:
        runs.append(label)
        return label

    app.conf.task_always_eager = True
    assert once.delay("eager").get() == "eager"
    assert once("direct") == "direct"
    assert runs == ["eager", "direct"]


def test_run_once_over_the_task_is_refused(app: Celery) -> None:
    @app.task(name="units.plain")
    def plain() -> None:
        return None

    with pytest.raises(TypeError, match=r"under @app\.task"):
        run_once(plain)


def test_a_client_closed_before_the_body_runs_releases_the_claim_and_retries(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process's client closed between the claim and the renewal (at
    # exit): the body did not run, so the claim is released and the message
    # retried (not failed with the claim left to expire).
    steps: list[str] = []

    class ClosedClientService:
        lease = 30.0

        def run(self, step: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
            return asyncio.run(step(guard))

        @contextlib.contextmanager
        def renewing(self, claim: Claim) -> Iterator[list[Claim]]:
            raise RuntimeError("this NATS client was closed; get the process's current one")
            yield [claim]  # pragma: no cover - never reached

    class Guard:
        async def claim(self, key: str) -> Claim:
            steps.append(f"claim {key}")
            return Claim(key, Verdict.RUN, revision=1, nonce="n")

        async def release(self, claim: Claim) -> None:
            steps.append(f"release {claim.key}")

        async def complete(self, claim: Claim, outcome: str = "success") -> bool:
            steps.append(f"complete {claim.key} {outcome}")
            return True

    guard = Guard()
    monkeypatch.setattr(
        OnceService, "for_settings", classmethod(lambda cls, s: ClosedClientService())
    )
    runs: list[str] = []

    @app.task(base=OnceTask, bind=True, name="units.once_closed")
    def once(self: Any) -> None:
        runs.append(self.request.id)

    task = app.tasks[once.name]
    trace = build_tracer(task.name, task, app=app, eager=False, propagate=False)
    sent: list[Any] = []  # the retry's message (no broker here)
    monkeypatch.setattr(type(task), "apply_async", lambda self, *a, **kw: sent.append(kw))
    result = trace("t-1", (), {}, request={"id": "t-1", "delivery_info": {}})
    assert (result.info.state, runs) == ("RETRY", [])
    assert steps == ["claim t-1", "release t-1"]
    assert len(sent) == 1 and sent[0]["task_id"] == "t-1"
