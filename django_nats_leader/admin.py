"""The admin: a read-only, staff-only election status page, and the fence's epochs.

"Election status" appears under "NATS leader election" on the admin index.
It asks NATS on every load (no data is stored) and shows the same table as
``manage.py election_status``: every role with its leader, term epoch, age
and expiry, and every live candidate. ``?refresh=5`` reloads it every 5 s
(the page says it is live, and "as of" when the data was read).

When the events stream keeps the event trail, each role also gets a timeline
(who led when, an SVG drawn on the server) and its last transitions with
their reasons. Users with the ``django_nats_leader.operate_election``
permission get "Resign" and "Fence" buttons, each behind a confirmation page.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import connections, transaction
from django.db.models import Model
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.safestring import mark_safe

from celery_nats_leader.config import validate_key
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError, ElectionError
from celery_nats_leader.election.events import TransitionEvent
from celery_nats_leader.election.status import StatusReport
from celery_nats_leader.ops.events import read_events
from celery_nats_leader.ops.oneshot import operator_name, with_backend
from celery_nats_leader.ops.output import role_rows
from celery_nats_leader.ops.status import fetch_report
from django_nats_leader import conf
from django_nats_leader.models import ElectionStatus, FenceEpoch
from django_nats_leader.timeline import stored_time, terms, timeline_svg

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

#: Kept events read for the timelines, and transitions listed per role.
HISTORY_EVENTS, LAST_TRANSITIONS = 500, 8

#: The permission behind the Resign and Fence buttons.
OPERATE_PERMISSION = "django_nats_leader.operate_election"

#: What the buttons do, for the confirmation page.
ACTIONS = {
    "resign": (
        "Resign",
        "The leader runs its demote callbacks, releases the role and sits out one TTL; "
        "another live candidate takes over within milliseconds. The leader must answer.",
    ),
    "fence": (
        "Fence",
        "The current term ends now. The leader is first asked to hand over (a live leader "
        "steps down before anyone else leads: no overlap); a leader that does not answer "
        "within a second is fenced: its fenced checks fail from now on and a live candidate "
        "takes over at once. The database fence is raised either way.",
    ),
}


def _outside_request_transactions(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """``view`` exempt from ``ATOMIC_REQUESTS`` on every database.

    The Fence button raises the role's database fence and then waits for a
    successor: inside the request's transaction the fence would not be
    visible to other connections until the response, and its row lock would
    be held through the wait, blocking the successor's first fenced write.
    """

    @functools.wraps(view)
    def action(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return view(request, *args, **kwargs)

    for alias in connections:
        action = transaction.non_atomic_requests(using=alias)(action)
    return action


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
        """The status page, and the confirmation pages of the two actions."""
        info = (self.opts.app_label, self.opts.model_name)
        return [
            path(
                "",
                self.admin_site.admin_view(self.changelist_view),
                name="{}_{}_changelist".format(*info),
            ),
            path(
                "<str:action>/<path:role>/",
                self.admin_site.admin_view(_outside_request_transactions(self.action_view)),
                name="{}_{}_action".format(*info),
            ),
        ]

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Whether the user may resign and fence leaders (a dedicated permission)."""
        user = getattr(request, "user", None)
        return bool(_is_staff(request) and user is not None and user.has_perm(OPERATE_PERMISSION))

    def action_view(self, request: HttpRequest, action: str, role: str) -> HttpResponse:
        """Confirm (GET) and carry out (POST) a resignation or a fence of ``role``'s leader."""
        if action not in ACTIONS:
            raise Http404(f"no action {action!r}")  # the page has no change/delete URLs
        if not self.has_operate_permission(request):
            raise PermissionDenied
        try:
            validate_key(role, "role")
            settings = conf.leader_settings()
        except ConfigError as exc:
            messages.error(request, str(exc))
            return HttpResponseRedirect(self._status_url())
        if request.method == "POST":
            self._carry_out(request, settings, action, role)
            return HttpResponseRedirect(self._status_url())
        report: StatusReport | None = None
        error = ""
        try:
            report = fetch_report(
                settings, configured_roles=(), only=(role,), timeout=STATUS_TIMEOUT
            )
        except ElectionError as exc:
            error = f"Cannot read the elections: {exc}"
        status = report.roles[0] if report and report.roles else None
        title, explanation = ACTIONS[action]
        context = {
            **self.admin_site.each_context(request),
            "title": f"{title} the leader of {role}?",
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "action": action,
            "action_title": title,
            "explanation": explanation,
            "role": role,
            "status": status,
            "error": error,
            "status_url": self._status_url(),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_nats_leader/election_action.html", context)

    def _status_url(self) -> str:
        return reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_changelist"
        )

    def _carry_out(
        self, request: HttpRequest, settings: LeaderSettings, action: str, role: str
    ) -> None:
        # The commands' own functions: the page does exactly what they do.
        from celery_nats_leader.ops.resign import request_resignation
        from django_nats_leader.management.commands.election_fence import (
            fence_role_and_database,
        )

        who = getattr(request.user, "get_username", lambda: "?")()
        try:
            if action == "resign":
                outcome = request_resignation(
                    settings,
                    role,
                    timeout=STATUS_TIMEOUT,
                    wait=2.0,
                    requester=operator_name(f"admin ({who})"),
                )
                if not outcome.accepted:
                    messages.warning(request, f"The leader of {role} refused to step down.")
                    return
                new = outcome.successor
                messages.success(
                    request,
                    f"{outcome.answered_by} stepped down from {role}"
                    + (f"; new leader {new.id} (epoch {new.epoch})." if new else "."),
                )
            else:
                fenced, _, problem = fence_role_and_database(
                    settings, role, epoch=None, timeout=STATUS_TIMEOUT, wait=2.0
                )
                if problem is not None:
                    messages.warning(request, f"Database fence of {role} not raised: {problem}")
                new = fenced.successor
                term = f"{fenced.fenced.id} (epoch {fenced.fenced.epoch})"
                text = (
                    f"The leader {term} handed {role} over cleanly on request; nothing fenced"
                    if fenced.handed_over
                    else f"Fenced {term} from {role}: {fenced.reason}"
                )
                messages.success(
                    request,
                    text + (f"; new leader {new.id} (epoch {new.epoch})." if new else "."),
                )
            logger.warning("admin: %s %s the leader of %r", who, action, role)
        except ElectionError as exc:
            messages.error(request, f"Could not {action} the leader of {role}: {exc}")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Ask NATS and render the status table."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        report: StatusReport | None = None
        error = ""
        history: list[TransitionEvent] | None = None
        try:
            settings = conf.leader_settings()
            report = fetch_report(
                settings,
                configured_roles=conf.expected_roles(settings),
                timeout=STATUS_TIMEOUT,
            )
            history = fetch_history(settings)
        except ConfigError as exc:
            error = f"Invalid {conf.SETTING_NAME} settings: {exc}"
        except ElectionError as exc:
            logger.warning("election status page: %s", exc)
            error = f"Cannot read the elections: {exc}"
        refresh = _refresh_seconds(request)
        # This host's clock, for display only ("as of"); nothing compares it.
        as_of = dt.datetime.now(dt.timezone.utc)
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
            "as_of": as_of,
            "history_kept": history is not None,
            "histories": _histories(report, history or [], as_of),
            "can_operate": self.has_operate_permission(request),
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_nats_leader/election_status.html", context)


def fetch_history(
    settings: LeaderSettings, *, limit: int = HISTORY_EVENTS
) -> list[TransitionEvent] | None:
    """The newest kept events of the settings' bucket, or ``None`` without an events stream."""
    return with_backend(
        settings,
        lambda backend: read_events(backend, settings.bucket, limit=limit, timeout=STATUS_TIMEOUT),
        timeout=STATUS_TIMEOUT,
        name=operator_name("admin election status"),
    )


def _histories(
    report: StatusReport | None, events: list[TransitionEvent], as_of: dt.datetime
) -> dict[str, dict[str, Any]]:
    """Per role: its timeline (SVG) and its last transitions, newest first."""
    if report is None:
        return {}
    by_role = terms(events)
    times = [t for t in (stored_time(e) for e in events) if t is not None]
    since = min(times, default=as_of - dt.timedelta(hours=1))
    # From the oldest kept event (a little before it), and never less than 10 s wide.
    since = min(since - dt.timedelta(seconds=1), as_of - dt.timedelta(seconds=10))
    found: dict[str, dict[str, Any]] = {}
    for status in report.roles:
        role_events = [e for e in events if e.role == status.role]
        found[status.role] = {
            # Safe: timeline_svg escapes every text it puts in the markup.
            "svg": mark_safe(timeline_svg(by_role.get(status.role, []), now=as_of, since=since)),
            "transitions": list(reversed(role_events[-LAST_TRANSITIONS:])),
        }
    return found


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
