from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Tick",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("entry", models.CharField(max_length=200)),
                ("slot", models.DateTimeField(db_index=True, null=True)),
                ("run", models.IntegerField(null=True)),
                ("dispatch_epoch", models.BigIntegerField(null=True)),
                ("leader_epoch", models.BigIntegerField()),
                ("worker", models.CharField(max_length=200)),
                ("pid", models.IntegerField()),
                ("executed_at", models.DateTimeField(auto_now_add=True)),
            ],
            options={"ordering": ("id",)},
        ),
    ]
