"""Settings of the example project: runs with nothing but nats-server installed.

Embedded defaults, each overridable from the environment:

* database: SQLite in ``$EXAMPLE_DATA_DIR`` (default: a directory in the
  system's temp dir);
* broker: kombu's filesystem transport (written atomically, see
  ``celery_nats_leader/testing/kombu_fs.py``), unless
  ``BROKER_URL`` or ``REDIS_URL`` names a real broker;
* NATS: ``$NATS_URL`` (default ``nats://127.0.0.1:4222``), bucket
  ``$EXAMPLE_NATS_BUCKET``, TTL ``$EXAMPLE_TTL`` seconds;
* the singleton job runs every ``$EXAMPLE_TICK_SECONDS`` seconds.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import django

BASE_DIR = Path(__file__).resolve().parent.parent

#: Where the SQLite database, the filesystem broker and the beat files live.
DATA_DIR = Path(
    os.environ.get("EXAMPLE_DATA_DIR") or Path(tempfile.gettempdir()) / "celery-nats-leader-example"
)

DATA_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_nats_leader",
    "ticks",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "exampleproj.urls"
WSGI_APPLICATION = "exampleproj.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

_sqlite_options: dict[str, Any] = {"timeout": 30}
if django.VERSION >= (5, 1):
    # Several worker processes write: take the write lock at BEGIN (no
    # lock-upgrade deadlocks) and let readers run beside the writer (WAL).
    _sqlite_options.update(transaction_mode="IMMEDIATE", init_command="PRAGMA journal_mode=WAL;")

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(DATA_DIR / "example.sqlite3"),
        "OPTIONS": _sqlite_options,
    }
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "/static/"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "celery_nats_leader": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "django_nats_leader": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "ticks": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}

# --------------------------------------------------------------- elections

#: One dict for the Django app and (through configure_celery) the Celery app.
NATS_LEADER = {
    "SERVERS": os.environ.get("NATS_URL", "nats://127.0.0.1:4222"),
    "BUCKET": os.environ.get("EXAMPLE_NATS_BUCKET", "example_leaders"),
    # Workers campaign for "default": its leader consumes the leader queue
    # of the @leader_only tasks. Embedded beats campaign for "beat".
    "ROLES": ["default"],
    "TTL": float(os.environ.get("EXAMPLE_TTL", "3")),
    # Convenient for an example; production creates it once with
    # `manage.py election_bucket --create`.
    "CREATE_BUCKET": True,
}

# ------------------------------------------------------------------ Celery

TICK_SECONDS = float(os.environ.get("EXAMPLE_TICK_SECONDS", "1"))

# No broker server needed: kombu's filesystem transport, with atomic writes
# (celery_nats_leader/testing/kombu_fs.py), unless BROKER_URL or REDIS_URL names a real one.
CELERY_BROKER_URL = os.environ.get("BROKER_URL") or os.environ.get("REDIS_URL") or "atomicfs://"
if CELERY_BROKER_URL.startswith(("atomicfs", "filesystem")):
    _broker_dir = DATA_DIR / "broker"
    for _folder in (_broker_dir, DATA_DIR / "broker-processed", DATA_DIR / "broker-control"):
        _folder.mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(DATA_DIR / "broker-processed"),
        # Exchange bindings; kombu's default is ./control, inside the project.
        "control_folder": str(DATA_DIR / "broker-control"),
        "store_processed": False,
        "polling_interval": 0.05,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_WORKER_SEND_TASK_EVENTS = False
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"

# Beat on every replica; only the leader of the "beat" role dispatches.
CELERY_BEAT_SCHEDULER = "celery_nats_leader.beat:LeaderScheduler"
CELERY_BEAT_SCHEDULE = {
    "tick": {"task": "ticks.tasks.tick", "schedule": TICK_SECONDS},
}
