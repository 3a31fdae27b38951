"""The deployment files of ``deploy/`` agree with the package they deploy.

* ``deploy/kubernetes/*.yaml`` parse; every ``NATS_LEADER_*`` variable
  names a real setting and the package reads the values as given; the
  probes hit the paths the worker's probe server answers, on the port the
  metrics setting opens; every
  ``celery`` command line parses with Celery's own command-line interface
  (options included, the ``nats-leader`` commands too); a preStop hand-over
  fits in the grace period; each PodDisruptionBudget selects its pods.
  ``test_deploy_rehearsal.py`` runs them.
* ``deploy/nats/*.conf`` pass ``nats-server -t`` (the server's own syntax
  check) on every server version under test; they are started by
  ``tests/integration/test_deploy_nats.py`` and the cluster harness.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import warnings
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from celery_nats_leader.config.settings import LeaderSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
SETTINGS = {f.name for f in dataclasses.fields(LeaderSettings)}
PREFIX = "NATS_LEADER_"
#: The NATS tools' credentials (read by the package) and the broker (read by
#: the app shown in deploy/kubernetes/README.md).
APP_VARIABLES = {"NATS_USER", "NATS_PASSWORD", "CELERY_BROKER_URL"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


DOCS = documents()


def pod_specs(kind: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, workload, pod spec) of every workload of ``kind``."""
    return [(w, d, d["spec"]["template"]["spec"]) for w, d in DOCS if d["kind"] == kind]


def containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for kind in ("Deployment", "Job"):
        for where, _, spec in pod_specs(kind):
            found += [(f"{where}/{c['name']}", c) for c in spec["containers"]]
    return found


def command_lines(container: dict[str, Any]) -> list[list[str]]:
    """The ``celery`` command lines a container runs (its command, a shell's, its preStop)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    lines = []
    if argv[:2] == ["sh", "-c"]:
        for part in " ".join(argv[2:]).split("&&"):
            lines.append(shlex.split(part))
    else:
        lines.append(argv)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
    if pre_stop:
        lines.append(pre_stop["command"])
    return lines


def celery_parses(argv: list[str]) -> click.Context:
    """Parse ``argv`` with Celery's CLI (and its plugins) without running it.

    Returns the context of the last command, with its parsed options.
    """
    from celery import Celery
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery

    assert argv[0] == "celery", argv
    # What `celery -A proj` puts in the context before a command parses
    # (some options default to the app's configuration).
    obj = CLIContext(app=Celery("proj"), no_color=True, workdir=None, quiet=True)
    ctx = celery.make_context("celery", argv[1:], obj=obj)
    words = _unparsed(ctx)
    group: click.Command = celery
    while words:
        assert isinstance(group, click.Group), (argv, group)
        command = group.get_command(ctx, words[0])
        assert command is not None, f"{argv}: no command {words[0]!r}"
        ctx = command.make_context(words[0], words[1:], parent=ctx)
        words = _unparsed(ctx) if isinstance(command, click.Group) else []
        group = command
    return ctx


def _unparsed(ctx: click.Context) -> list[str]:
    """A group's words left for its subcommand (Click 8.2 deprecates how it says them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return [*ctx.protected_args, *ctx.args]


def test_manifests_are_found() -> None:
    kinds = sorted(d["kind"] for _, d in DOCS)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "Deployment",
        "Job",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "Service",
        "StatefulSet",
    ]


@pytest.mark.parametrize(("where", "container"), containers(), ids=lambda v: str(v)[:40])
def test_environment_names_real_settings(where: str, container: dict[str, Any]) -> None:
    names = [e["name"] for e in container.get("env", [])]
    assert names, where
    for name in names:
        if name.startswith(PREFIX):
            assert name[len(PREFIX) :].lower() in SETTINGS, f"{where}: {name} is no setting"
        else:
            assert name in APP_VARIABLES, f"{where}: {name}"
    # The values, as the package reads them from the environment.
    environ = {e["name"]: e.get("value") or "secret" for e in container["env"]}
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(PREFIX) or name in APP_VARIABLES or name == "NATS_URL":
                patch.delenv(name)
        for name, value in environ.items():
            patch.setenv(name, value)
        settings = LeaderSettings.from_celery({})
    assert len(settings.servers) == 3, where
    assert settings.connect_options["user"] == environ["NATS_USER"], where
    if "NATS_LEADER_METRICS_PORT" in environ:
        assert settings.metrics_port == int(environ["NATS_LEADER_METRICS_PORT"])
        assert settings.required is True


@pytest.mark.parametrize(("where", "container"), containers(), ids=lambda v: str(v)[:40])
def test_command_lines_parse(where: str, container: dict[str, Any]) -> None:
    for argv in command_lines(container):
        celery_parses(argv)


@pytest.mark.parametrize(("where", "workload", "spec"), pod_specs("Deployment"))
def test_probes_use_the_metrics_port_and_the_probe_paths(
    where: str, workload: dict[str, Any], spec: dict[str, Any]
) -> None:
    from celery_nats_leader.observe.probes import ProbeServer

    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(env[f"{PREFIX}METRICS_PORT"]), where
    probes = {k: container[k] for k in ("livenessProbe", "readinessProbe", "startupProbe")}
    if "exec" in probes["livenessProbe"]:
        # `worker -B`: liveness asks both the worker's and its beat's
        # /healthz, with the command docs/operating.md shows (and
        # tests/beat/test_beat_probes.py runs against a real worker -B).
        assert ports["beat-metrics"] == int(env[f"{PREFIX}BEAT_METRICS_PORT"]), where
        command = probes.pop("livenessProbe")["exec"]["command"]
        assert command[:2] == ["python", "-c"], where
        page = (DEPLOY.parent / "docs" / "operating.md").read_text()
        assert f'- "{command[2]}"' in page, where
        assert f"for p in ({ports['metrics']}, {ports['beat-metrics']})]" in command[2], where
        assert "/healthz" in command[2], where
    else:
        assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz", where
    gets = {k: probe["httpGet"] for k, probe in probes.items()}
    assert {p["port"] for p in gets.values()} == {"metrics"}, where
    assert gets["startupProbe"]["path"] == "/healthz"
    assert gets["readinessProbe"]["path"] == "/readyz"
    # The paths the probe server answers (anything else is a 404).
    source = Path(ProbeServer.__module__.replace(".", "/") + ".py")
    text = (Path(__file__).resolve().parents[2] / source).read_text()
    assert '"/healthz"' in text and '"/readyz"' in text


def test_beat_runs_the_leader_scheduler() -> None:
    commands = {
        where.partition(":")[0]: spec["containers"][0]["command"]
        for where, _, spec in pod_specs("Deployment")
    }
    # As Celery's own command line reads them (for `beat`, -S is the
    # scheduler; for `worker`, it is --statedb).
    beat = celery_parses(commands["beat.yaml"])
    assert (beat.info_name, beat.params["scheduler"]) == ("beat", "nats_leader")
    embedded = celery_parses(commands["worker-with-beat.yaml"])
    assert embedded.info_name == "worker"
    assert (embedded.params["beat"], embedded.params["scheduler"]) == (True, "nats_leader")
    assert embedded.params["statedb"] is None
    plain = celery_parses(commands["worker.yaml"])
    assert not plain.params["beat"]


@pytest.mark.parametrize(("where", "workload", "spec"), pod_specs("Deployment"))
def test_pre_stop_release_fits_the_grace_period(
    where: str, workload: dict[str, Any], spec: dict[str, Any]
) -> None:
    (container,) = spec["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[3:5] == ["nats-leader", "release"], where
    timeout = float(command[command.index("--timeout") + 1])
    assert timeout < spec["terminationGracePeriodSeconds"], where
    # A budget keeps all but one replica of it up during voluntary disruptions.
    labels = workload["spec"]["template"]["metadata"]["labels"]
    budgets = [
        d
        for _, d in DOCS
        if d["kind"] == "PodDisruptionBudget"
        and d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert [b["spec"]["maxUnavailable"] for b in budgets] == [1], where
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("config", ["single.conf", "cluster.conf", "permissions.conf"])
def test_nats_configs_pass_the_servers_check(config: str, tmp_path: Path) -> None:
    from tests.integration.helpers import servers_under_test

    text = (DEPLOY / "nats" / config).read_text()
    if config != "permissions.conf":
        text += "include ./permissions.conf\n"  # as the production checklist says
    env = {f"{user}_PASSWORD": "x" for user in ("WORKER", "BEAT", "WEB", "VIEWER", "ADMIN")}
    (tmp_path / "permissions.conf").write_text((DEPLOY / "nats" / "permissions.conf").read_text())
    (tmp_path / config).write_text(text)
    for version, binary in servers_under_test().items():
        done = subprocess.run(
            [binary, "-t", "-c", str(tmp_path / config)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, f"{version}: {done.stdout}{done.stderr}"
