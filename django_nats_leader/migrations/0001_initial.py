"""The fence's table and the (table-less) election status entry of the admin."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    """Create :class:`~django_nats_leader.models.FenceEpoch`."""

    initial = True

    dependencies = []  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="ElectionStatus",
            fields=[
                ("role", models.CharField(max_length=255, primary_key=True, serialize=False)),
            ],
            options={
                "verbose_name": "election status",
                "verbose_name_plural": "election status",
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="FenceEpoch",
            fields=[
                (
                    "role",
                    models.CharField(
                        help_text="The election role.",
                        max_length=255,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("epoch", models.BigIntegerField(help_text="Highest term epoch accepted so far.")),
                (
                    "token_prefix",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="First characters of that term's token (never the whole token).",
                        max_length=16,
                    ),
                ),
                (
                    "holder",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="Who wrote it (instance id), if given.",
                        max_length=255,
                    ),
                ),
                (
                    "updated_at",
                    models.DateTimeField(auto_now=True, help_text="When the epoch last changed."),
                ),
            ],
            options={
                "verbose_name": "fence epoch",
                "verbose_name_plural": "fence epochs",
                "ordering": ("role",),
            },
        ),
    ]
