"""Operator operations, shared by the Celery CLI and the Django commands.

* :mod:`.status`: who leads each role, with each leader's own view of its
  term (read from the bucket and asked of the live candidates).
* :mod:`.fence_leader`: end a leader's term now: a hand-over if it answers, else a
  fence marker written at the observed revision.
* :mod:`.events`: the event trail, kept by the optional stream and live.
* :mod:`.cli`: ``celery nats-leader``, which only parses arguments and
  prints.

No Django here, and no Celery but in :mod:`.cli` (click and the app's
configuration; this package does not import it): ``celery nats-leader``
and the ``manage.py election_*`` commands are thin layers over these
functions.
"""
