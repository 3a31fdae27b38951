"""The Django app of celery-nats-leader: settings, checks, commands, the DB fence, the admin page.

Add ``"django_nats_leader"`` to ``INSTALLED_APPS`` and configure one dict::

    NATS_LEADER = {
        "SERVERS": ["nats://127.0.0.1:4222"],
        "BUCKET": "leaders",
        "ROLES": ["default"],
        "TTL": 10,
    }

Then ``manage.py election_status`` shows who leads, ``election_resign`` asks
a leader to hand over, ``election_bucket`` creates the KV bucket, and
:func:`django_nats_leader.fencing.fenced` rejects database writes of a stale
leader. See docs/django.md.

This module stays import-light: it imports neither Django models nor NATS.
"""

from __future__ import annotations
