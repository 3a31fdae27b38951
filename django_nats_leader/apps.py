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
        """Register the system checks (lazily: only once the app registry is ready)."""
        from django_nats_leader import checks

        checks.register_checks()
