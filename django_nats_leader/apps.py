"""The Django app configuration of :mod:`django_nats_leader`."""

from __future__ import annotations

from django.apps import AppConfig


class DjangoNatsLeaderConfig(AppConfig):
    """Registers the system checks; imports nothing heavy until Django is ready."""

    name = "django_nats_leader"
    label = "django_nats_leader"
    verbose_name = "NATS leader election"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks, and give ``NATS_LEADER`` to Celery's processes.

        A worker or beat whose app was not passed to ``configure_celery``
        would otherwise run with the defaults while ``manage.py`` uses
        ``NATS_LEADER`` (:func:`~django_nats_leader.conf.configure_forgotten`).
        """
        from django_nats_leader import checks

        checks.register_checks()
        try:
            from celery import signals
        except ImportError:  # pragma: no cover - Celery is an optional extra
            return
        signals.worker_init.connect(_configure_forgotten, weak=False)
        signals.beat_init.connect(_configure_forgotten, weak=False)


def _configure_forgotten(sender: object = None, **_: object) -> None:
    from django_nats_leader.conf import configure_forgotten

    app = getattr(sender, "app", None)
    if app is not None:
        configure_forgotten(app)
