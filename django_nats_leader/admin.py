"""The admin: a read-only, staff-only election status page, and the fence's epochs.

"Election status" appears under "NATS leader election" on the admin index.
It asks NATS on every load (no data is stored) and shows the same table as
``manage.py election_status``: every role with its leader, term epoch, age
and expiry, and every live candidate. ``?refresh=5`` reloads it every 5 s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from celery_nats_leader.errors import ConfigError, ElectionError
from celery_nats_leader.ops.status import StatusReport, fetch_report
from django_nats_leader import conf
from django_nats_leader.models import ElectionStatus, FenceEpoch
from django_nats_leader.render import role_rows

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    _StatusAdminBase = admin.ModelAdmin[ElectionStatus]
    _FenceAdminBase = admin.ModelAdmin[FenceEpoch]
else:  # ModelAdmin is not subscriptable at run time
    _StatusAdminBase = _FenceAdminBase = admin.ModelAdmin

#: Seconds the page waits for NATS before showing an error.
STATUS_TIMEOUT = 3.0

#: Bounds of ``?refresh=N``, seconds.
MIN_REFRESH, MAX_REFRESH = 1, 3600


def _is_staff(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


@admin.register(ElectionStatus)
class ElectionStatusAdmin(_StatusAdminBase):
    """The status page in place of a change list: staff may look, nobody may change."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        """Every active staff user sees the app on the admin index."""
        return _is_staff(request)

    def has_view_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        """Every active staff user may look."""
        return _is_staff(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Read-only."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        """Read-only."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        """Read-only."""
        return False

    def get_urls(self) -> list[URLPattern]:
        """Only the change list URL (there are no rows to add, change or delete)."""
        info = (self.opts.app_label, self.opts.model_name)
        return [
            path(
                "",
                self.admin_site.admin_view(self.changelist_view),
                name="{}_{}_changelist".format(*info),
            )
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Ask NATS and render the status table."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        report: StatusReport | None = None
        error = ""
        try:
            settings = conf.leader_settings()
            report = fetch_report(
                settings,
                configured_roles=conf.expected_roles(settings),
                timeout=STATUS_TIMEOUT,
            )
        except ConfigError as exc:
            error = f"Invalid {conf.SETTING_NAME} settings: {exc}"
        except ElectionError as exc:
            logger.warning("election status page: %s", exc)
            error = f"Cannot read the elections: {exc}"
        refresh = _refresh_seconds(request)
        context = {
            **self.admin_site.each_context(request),
            "title": "Election status",
            "subtitle": None,
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "report": report,
            "rows": role_rows(report) if report else [],
            "error": error,
            "refresh": refresh,
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_nats_leader/election_status.html", context)


def _refresh_seconds(request: HttpRequest) -> int | None:
    try:
        value = int(request.GET.get("refresh", ""))
    except ValueError:
        return None
    return min(max(value, MIN_REFRESH), MAX_REFRESH)


@admin.register(FenceEpoch)
class FenceEpochAdmin(_FenceAdminBase):
    """The fence's high-water marks, read-only: editing them would defeat the fence."""

    list_display = ("role", "epoch", "holder", "token_prefix", "updated_at")
    search_fields = ("role", "holder")

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Only :func:`~django_nats_leader.fencing.fenced` writes epochs."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        """Read-only."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        """Read-only: deleting a row would let a stale leader write again."""
        return False
