"""A table the fence tests write to under the fence (no migrations: created by syncdb)."""

from __future__ import annotations

from django.db import models


class Write(models.Model):
    """One fenced write: which term wrote it, and who."""

    role = models.CharField(max_length=100)
    epoch = models.BigIntegerField()
    writer = models.CharField(max_length=100)

    class Meta:
        app_label = "fenceapp"
        ordering = ("id",)
