"""Models of the Django app: the fence's high-water marks and the admin status page."""

from __future__ import annotations

from datetime import datetime

from django.db import models


class FenceEpoch(models.Model):
    """The highest term epoch the database has accepted a fenced write from, per role.

    One row per role, written only by :func:`django_nats_leader.fencing.fenced`
    under a row lock. An epoch here never decreases.
    """

    role: models.CharField[str, str] = models.CharField(
        max_length=255, primary_key=True, help_text="The election role."
    )
    epoch: models.BigIntegerField[int, int] = models.BigIntegerField(
        help_text="Highest term epoch accepted so far."
    )
    token_prefix: models.CharField[str, str] = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="First characters of that term's token (never the whole token).",
    )
    holder: models.CharField[str, str] = models.CharField(
        max_length=255, blank=True, default="", help_text="Who wrote it (instance id), if given."
    )
    updated_at: models.DateTimeField[datetime, datetime] = models.DateTimeField(
        auto_now=True, help_text="When the epoch last changed."
    )

    class Meta:
        """One row per role, listed by role."""

        verbose_name = "fence epoch"
        verbose_name_plural = "fence epochs"
        ordering = ("role",)

    def __str__(self) -> str:
        return f"{self.role} @ epoch {self.epoch}"


class ElectionStatus(models.Model):
    """No table: the admin's entry point to the live election status page.

    The page itself asks NATS (see :mod:`django_nats_leader.admin`); this
    unmanaged model only gives it a place, a URL and a permission in the admin.
    """

    role: models.CharField[str, str] = models.CharField(max_length=255, primary_key=True)

    class Meta:
        """No table; only a view permission."""

        managed = False
        verbose_name = "election status"
        verbose_name_plural = "election status"
        default_permissions = ("view",)
        permissions = (("operate_election", "Can resign and fence election leaders"),)

    def __str__(self) -> str:
        return self.role
