"""The :class:`~celery.exceptions.Ignore` this package raises for a message it did not run."""

from __future__ import annotations

from celery.exceptions import Ignore

__all__ = ["NotRun"]


class NotRun(Ignore):  # type: ignore[misc]  # Celery is untyped
    """The body of this message was not run here: it was refused or handed on.

    Raised by this package's own checks (a dispatch under an ended beat term,
    a leader-only task on a follower skipped or forwarded under the same id).
    The once-guard releases its claim on it, so that a later copy of the
    message can run; any other ``Ignore`` (``Task.replace``, a body that
    stores its state and raises ``Ignore``) is a finished run, recorded done.
    """
