"""Sending a message again later without spending the task's retries (worker.recheck).

Celery's ``Task.retry`` counts every wait of the package's own checks in
``request.retries``, stops at the task's limit, and ``retry(max_retries=n)``
leaves ``n`` on the shared task instance for every later message of that task.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry

from celery_nats_leader.worker.recheck import recheck_later


@pytest.fixture
def app() -> Any:
    app = Celery("recheck", broker="memory://", backend="cache+memory://")
    app.conf.task_default_queue = "recheck"
    yield app
    app.close()


def _worker_request(task: Any, retries: int) -> None:
    task.push_request(
        id="task-1",
        args=(7,),
        kwargs={"day": "mon"},
        retries=retries,
        headers={"nats_leader_epoch": 4},
        delivery_info={"exchange": "", "routing_key": "recheck"},
        called_directly=False,
        is_eager=False,
    )


def test_the_copy_keeps_the_retry_count_and_the_task_keeps_its_limit(app: Any) -> None:
    sent: list[dict[str, Any]] = []

    @app.task(bind=True, max_retries=3, name="recheck.job")
    def job(self: Any, n: int, day: str) -> None:  # pragma: no cover - never run
        pass

    def capture(args: Any = None, kwargs: Any = None, **options: Any) -> None:
        sent.append({"args": args, "kwargs": kwargs, **options})

    job.apply_async = capture
    _worker_request(job, retries=5)  # more than max_retries already
    try:
        outcome = recheck_later(job, 1.5)
    finally:
        job.pop_request()
    assert isinstance(outcome, Retry)
    assert len(sent) == 1
    copy = sent[0]
    assert copy["retries"] == 5  # not 6: the wait spends no retry
    assert copy["countdown"] == 1.5
    assert copy["task_id"] == "task-1"
    assert copy["args"] == (7,) and copy["kwargs"] == {"day": "mon"}
    assert copy["headers"] == {"nats_leader_epoch": 4}
    # Task.retry(max_retries=n) would have left n on the shared instance.
    assert getattr(job, "override_max_retries", None) is None
    assert job.max_retries == 3


def test_celery_retry_is_what_recheck_avoids(app: Any) -> None:
    # The oracle: the same request through Celery's own retry counts the
    # retry and stops at the task's limit.
    @app.task(bind=True, max_retries=3, name="recheck.oracle")
    def job(self: Any, n: int, day: str) -> None:  # pragma: no cover - never run
        pass

    job.apply_async = lambda *a, **k: None
    _worker_request(job, retries=5)
    try:
        with pytest.raises(job.MaxRetriesExceededError):
            job.retry(countdown=1, max_retries=None)
        with pytest.raises(Retry):
            job.retry(countdown=1, max_retries=9)
    finally:
        job.pop_request()
    assert job.override_max_retries == 9
