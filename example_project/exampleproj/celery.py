"""The Celery app, configured from Django settings (``CELERY_*``) and ``NATS_LEADER``.

Run three replicas, each with its embedded leader-elected beat::

    celery -A exampleproj worker -B -n replica1@%h
    celery -A exampleproj worker -B -n replica2@%h
    celery -A exampleproj worker -B -n replica3@%h
"""

from __future__ import annotations

import os

from celery import Celery

from celery_nats_leader import install
from celery_nats_leader.testing import kombu_fs
from django_nats_leader.conf import configure_celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "exampleproj.settings")
# The default broker, atomicfs://: kombu's filesystem transport, written atomically.
kombu_fs.register()

app = Celery("exampleproj")
# CELERY_* Django settings, including CELERY_NATS_LEADER_* refinements.
app.config_from_object("django.conf:settings", namespace="CELERY")
# NATS_LEADER = {...} becomes the app's nats_leader_* defaults (read lazily).
configure_celery(app)
# The worker bootstep (one election per worker) and leader-queue routing.
install(app)
app.autodiscover_tasks()
