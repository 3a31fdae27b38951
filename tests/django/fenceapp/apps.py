from __future__ import annotations

from django.apps import AppConfig


class FenceAppConfig(AppConfig):
    name = "tests.django.fenceapp"
    label = "fenceapp"
    default_auto_field = "django.db.models.BigAutoField"
