"""App configuration of ``ticks``."""

from __future__ import annotations

from django.apps import AppConfig


class TicksConfig(AppConfig):
    """The ledger of the singleton job."""

    name = "ticks"
    verbose_name = "Singleton job ledger"
    default_auto_field = "django.db.models.BigAutoField"
