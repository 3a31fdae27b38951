"""The permission to resign and fence leaders from the admin page."""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    """Add ``operate_election`` to the election status entry."""

    dependencies = [("django_nats_leader", "0001_initial")]  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.AlterModelOptions(
            name="electionstatus",
            options={
                "default_permissions": ("view",),
                "managed": False,
                "permissions": (("operate_election", "Can resign and fence election leaders"),),
                "verbose_name": "election status",
                "verbose_name_plural": "election status",
            },
        ),
    ]
