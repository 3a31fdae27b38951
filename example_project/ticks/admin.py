"""The ledger in the admin, read-only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from ticks.models import Tick


@admin.register(Tick)
class TickAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("id", "entry", "slot", "run", "worker", "leader_epoch", "dispatch_epoch")
    list_filter = ("worker",)

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False
