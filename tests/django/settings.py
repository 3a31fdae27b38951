"""Django settings of the tests in tests/django (applied by conftest.py with settings.configure).

Two databases: ``default`` is SQLite (always there), ``postgres`` is the local
PostgreSQL (127.0.0.1:5432, user ``postgres``, database ``test``; override with
``CNL_PG_HOST``/``CNL_PG_PORT``/``CNL_PG_USER``/``CNL_PG_PASSWORD``/``CNL_PG_DB``),
defined only when reachable. The test databases get per-process names, so
concurrent test runs on one machine never share one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

#: A private directory for this test process's SQLite files.
SQLITE_DIR = Path(tempfile.mkdtemp(prefix="cnl-django-tests-"))

PG = {
    "ENGINE": "django.db.backends.postgresql",
    "HOST": os.environ.get("CNL_PG_HOST", "127.0.0.1"),
    "PORT": int(os.environ.get("CNL_PG_PORT", "5432")),
    "USER": os.environ.get("CNL_PG_USER", "postgres"),
    "PASSWORD": os.environ.get("CNL_PG_PASSWORD", ""),
    "NAME": os.environ.get("CNL_PG_DB", "test"),
    "TEST": {"NAME": f"test_cnl_django_{os.getpid()}"},
}


def postgres_problem() -> str | None:
    """Why PostgreSQL cannot be used (``None`` when it can)."""
    try:
        import psycopg2
    except ImportError as exc:  # pragma: no cover - psycopg2-binary is in the dev extra
        return f"psycopg2 is not installed: {exc}"
    try:
        psycopg2.connect(
            host=PG["HOST"],
            port=PG["PORT"],
            user=PG["USER"],
            password=PG["PASSWORD"],
            dbname=PG["NAME"],
            connect_timeout=3,
        ).close()
    except psycopg2.Error as exc:
        return f"PostgreSQL at {PG['HOST']}:{PG['PORT']} (db {PG['NAME']!r}): {exc}".strip()
    return None


def build(postgres: bool) -> dict[str, Any]:
    """The settings, with the ``postgres`` database alias when ``postgres`` is true."""
    databases: dict[str, Any] = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(SQLITE_DIR / "db.sqlite3"),
            # A file, not memory: the fence races use several threads, each
            # with its own connection, and the browser test a server thread.
            "TEST": {"NAME": str(SQLITE_DIR / "test.sqlite3")},
            "OPTIONS": {"timeout": 30},
        }
    }
    if postgres:
        databases["postgres"] = PG
    return {
        "SECRET_KEY": "tests-only-not-secret",
        "DEBUG": False,
        "ALLOWED_HOSTS": ["*"],
        "USE_TZ": True,
        "INSTALLED_APPS": [
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django.contrib.staticfiles",
            "django_celery_beat",
            "django_nats_leader",
            "tests.django.fenceapp",
        ],
        "MIDDLEWARE": [
            "django.middleware.security.SecurityMiddleware",
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.common.CommonMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        "ROOT_URLCONF": "tests.django.urls",
        "TEMPLATES": [
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
        ],
        "DATABASES": databases,
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
        "STATIC_URL": "/static/",
        "PASSWORD_HASHERS": ["django.contrib.auth.hashers.MD5PasswordHasher"],
        # Points at nothing on purpose: every test that talks to NATS sets
        # NATS_LEADER to its own nats-server (never the system one on 4222).
        "NATS_LEADER": {"SERVERS": ["nats://127.0.0.1:1"], "ROLES": ["default"]},
        "TIME_ZONE": "UTC",
    }
