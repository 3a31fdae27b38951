"""Sending a message again later without spending the task's retries.

The package's own checks sometimes cannot decide yet: the beat fence cannot
read the current term while NATS is unreachable, the once-guard sees another
run's lease. The message must come back later, as often as it takes. Celery's
``Task.retry`` is the wrong tool for that wait:

* ``retry(max_retries=None)`` means "the task's own limit" (3 by default):
  about three rechecks into an outage the tick ended as FAILURE
  (``MaxRetriesExceededError``), and was lost;
* every retry counts in ``request.retries``: a task whose body later retries
  for its own reasons found its budget already spent by our waits;
* ``retry(max_retries=n)`` stores ``n`` on the task instance
  (``override_max_retries``), which every later message of that task in the
  process then obeys (``autoretry_for`` with a wrong limit).

:func:`recheck_later` sends the same message (same id, arguments, headers
and routing) with a countdown and the *same* retry count, touches nothing on
the task instance, and returns the :class:`~celery.exceptions.Retry` for the
caller to raise, so that the worker records the message as retried.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import Reject, Retry

__all__ = ["recheck_later"]


def recheck_later(task: Any, countdown: float, *, exc: BaseException | None = None) -> Exception:
    """Send the current message of ``task`` again in ``countdown`` seconds, spending no retry.

    Args:
        task: The bound task whose message is being run.
        countdown: Seconds before the copy is delivered.
        exc: The reason, kept on the returned ``Retry`` (logged by the worker).

    Returns:
        The exception to raise: :class:`~celery.exceptions.Retry` once the copy
        is sent. Where there is no message to send again (the task was called
        directly or eagerly), Celery's own ``Task.retry`` decides, as for any
        retry there.

    Raises:
        Reject: The copy could not be sent: the message is rejected *with*
            requeue (Celery's own retry drops it here). The broker delivers
            it again only for a task with ``acks_late`` (leader-only tasks
            always are); a task acknowledged on receipt is lost here, as with
            Celery's retry.

    """
    request = task.request
    if request.called_directly or request.is_eager:
        try:
            return task.retry(exc=exc, countdown=countdown)  # type: ignore[no-any-return]
        except Exception as raised:  # Celery raises instead of returning here
            return raised
    copy = task.signature_from_request(request, countdown=countdown, retries=request.retries)
    try:
        copy.apply_async()
    except Exception as failed:
        raise Reject(failed, requeue=True) from failed
    return Retry(exc=exc, when=countdown, sig=copy)  # type: ignore[no-any-return]
