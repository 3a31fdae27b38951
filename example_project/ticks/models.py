"""The ledger: one row per execution of the singleton job."""

from __future__ import annotations

from django.db import models


class Tick(models.Model):
    """One run of the periodic job, written under the database fence.

    ``slot`` is the tick's identity (the time the schedule says it is due, as
    the leader scheduler stamps it on the message): a healthy ledger has
    exactly one row per slot and no slot missing.
    """

    entry = models.CharField(max_length=200)
    slot = models.DateTimeField(null=True, db_index=True)
    run = models.IntegerField(null=True)
    dispatch_epoch = models.BigIntegerField(null=True)
    leader_epoch = models.BigIntegerField()
    worker = models.CharField(max_length=200)
    pid = models.IntegerField()
    executed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("id",)

    def __str__(self) -> str:
        return f"{self.entry} @ {self.slot} by {self.worker}"
