"""The Kubernetes manifests of ``deploy/kubernetes/``, run as a team would run them.

A three-node NATS cluster as ``nats.yaml``'s StatefulSet runs it
(``deploy/nats/cluster.conf`` and ``deploy/nats/permissions.conf`` through
its ConfigMaps, the passwords from the Secret, its probes), the app ``proj`` as the README there
shows it, then, in the README's order: the Job's command, two pods of each
Deployment (their command and their environment, the Secret's values filled
in), their startup, readiness and liveness probes, ``nats-leader status`` in
a pod, beat's ticks reaching a worker, and every pod replaced one by one
through its ``preStop`` hook and SIGTERM, within its grace period, with a
leader of each role at the end; then the NATS servers replaced one by one
through theirs, under running pods.

What differs from a cluster, and nothing else: the NATS and Redis addresses,
the Secret's values, and each pod's metrics ports (pods have a network of
their own; these processes share the host's, so each pod gets free ports and
the probes and an exec probe's literal ports follow). Each pod has a
hostname of its own, as in Kubernetes (a UTS namespace: ``unshare``; its
hooks and exec probes run in it with ``nsenter``): ``nats-leader release``
hands over the roles of the pod's host.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from celery_nats_leader.testing import NatsServer
from celery_nats_leader.testing.cluster import NatsCluster
from celery_nats_leader.testing.ports import free_port
from tests.support.procs import Proc
from tests.support.services import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
NATS = ROOT / "deploy" / "nats"
#: The shipped Prometheus scrape job (and the rule files it names).
SCRAPE_JOB = ROOT / "deploy" / "prometheus" / "scrape-pods.yml"
#: The Secret ``nats-users``: one password per NATS user.
SECRET = {
    "admin": "adm-pw-r",
    "worker": "wrk-pw-r",
    "beat": "bt-pw-r",
    "web": "web-pw-r",
    "viewer": "vw-pw-r",
}
#: A Redis database of this test's own (flushed before and after).
REDIS_URL = "redis://127.0.0.1:6379/11"
BIN = Path(sys.executable).parent
#: A worker's log line for a heartbeat tick that ran (its id is the tick's).
SUCCEEDED = re.compile(r"Task proj\.celery\.heartbeat\[([0-9a-f-]+)\] succeeded")
APP_BLOCK = re.compile(
    r"^<!-- test: deploy file=proj/celery.py -->\n```python\n(?P<body>.*?)^```$", re.M | re.S
)


def manifest(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


def workload(name: str, kind: str) -> dict[str, Any]:
    [found] = [d for d in manifest(name) if d["kind"] == kind]
    return found


def nats_server_config() -> tuple[str, dict[str, str]]:
    """``nats.yaml``'s server: its configuration file as mounted, and its environment.

    The projected volume joins the ConfigMap ``nats-config`` (its
    ``nats.conf``) and ``nats-files``, made from ``deploy/nats/`` as its
    comment says; the includes are done as text (the harness writes each
    member's file elsewhere).
    """
    docs = manifest("nats.yaml")
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap"]
    stateful = workload("nats.yaml", "StatefulSet")
    pod = stateful["spec"]["template"]["spec"]
    [container] = pod["containers"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "config"]
    sources = {s["configMap"]["name"] for s in volume["projected"]["sources"]}
    assert sources == {config_map["metadata"]["name"], "nats-files"}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "config"]
    args = container["args"]
    config_path = args[args.index("-c") + 1]
    assert Path(config_path).parent == Path(mount["mountPath"]), (config_path, mount)
    files = {"cluster.conf", "permissions.conf"}  # kubectl create configmap nats-files ...

    def resolve(line: str) -> str:
        found = re.fullmatch(r"\s*include \./(\S+)\s*", line)
        if not found:
            return line
        assert found.group(1) in files, line
        return (NATS / found.group(1)).read_text()

    text = "\n".join(
        resolve(line) for line in config_map["data"][Path(config_path).name].splitlines()
    )
    env = {
        item["name"]: SECRET[item["valueFrom"]["secretKeyRef"]["key"]]
        for item in container["env"]
        if "secretKeyRef" in item.get("valueFrom", {})
    }
    return text, env


def http_status(port: int, path: str) -> int | None:
    """An httpGet probe's status code on this host's ``port`` (``None``: nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def nats_probe_passes(server: NatsServer, container: dict[str, Any], kind: str) -> bool:
    """Whether ``server`` passes ``nats.yaml``'s probe ``kind`` (its monitoring port)."""
    return http_status(server.monitor_port, container[kind]["httpGet"]["path"]) == 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """The StatefulSet of ``nats.yaml``: three servers from its configuration and Secret."""
    text, env = nats_server_config()
    conf = tmp_path_factory.mktemp("nats") / "nats.conf"
    conf.write_text(text)
    saved = dict(os.environ)
    # permissions.conf reads the passwords from the server's environment.
    os.environ.update(env)
    try:
        with NatsCluster(3, config_file=conf) as made:
            # Each server passes the StatefulSet's probes.
            probes = workload("nats.yaml", "StatefulSet")["spec"]["template"]["spec"]
            [container] = probes["containers"]
            for server in made.servers:
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert nats_probe_passes(server, container, kind), (kind, server.server_name)
            yield made
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The app as the README shows it (the image's code)."""
    match = APP_BLOCK.search((KUBE / "README.md").read_text())
    assert match, "deploy/kubernetes/README.md shows no proj/celery.py"
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "celery.py").write_text(match.group("body"))
    (tmp_path / "proj" / "__init__.py").write_text("from proj.celery import app\n")
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield tmp_path
    client.flushdb()


class Pod:
    """One pod of a workload: its container's command with its environment."""

    def __init__(
        self, workload: dict[str, Any], index: int, cluster: NatsCluster, project: Path
    ) -> None:
        spec = workload["spec"]["template"]["spec"]
        [self.container] = spec["containers"]
        self.grace = float(spec.get("terminationGracePeriodSeconds", 30))
        self.name = f"{workload['metadata']['name']}-{index}"
        self.project = project
        #: containerPort -> this pod's port on the host.
        self.ports = {p["containerPort"]: free_port() for p in self.container.get("ports", [])}
        self.named = {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}
        self.annotations = dict(
            workload["spec"]["template"].get("metadata", {}).get("annotations", {})
        )
        self.env = self._environment(cluster)
        self.proc: Proc | None = None

    def _environment(self, cluster: NatsCluster) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
        env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(self.project))
        for item in self.container.get("env", []):
            name = item["name"]
            if "value" in item:
                value = str(item["value"])
            else:
                value = SECRET[item["valueFrom"]["secretKeyRef"]["key"]]
            if name == "NATS_LEADER_SERVERS":
                value = ",".join(cluster.urls)
            elif name == "CELERY_BROKER_URL":
                value = REDIS_URL
            elif name.endswith("METRICS_PORT"):
                value = str(self.ports[int(value)])
            env[name] = value
        return env

    def argv(self, command: list[str]) -> list[str]:
        """A container command as run here (an exec probe's ports follow the pod's)."""
        text = [str(a) for a in command]
        for container_port, port in self.ports.items():
            text = [a.replace(str(container_port), str(port)) for a in text]
        if text and text[0] == "python":
            text[0] = sys.executable
        return text

    def start(self, log_dir: Path) -> Proc:
        argv = self.argv(self.container["command"] + self.container.get("args", []))
        # The pod's own hostname; exec keeps the process's pid for nsenter.
        in_pod = ["unshare", "--uts", "sh", "-c", f'hostname {self.name} && exec "$@"', "sh"]
        self.proc = Proc(
            self.name,
            [*in_pod, *argv],
            env=self.env,
            log_path=log_dir / f"{self.name}.log",
            cwd=self.project,
        )
        return self.proc

    def exec(self, command: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``kubectl exec``: a command in the running pod (its hostname)."""
        assert self.proc is not None
        return subprocess.run(
            ["nsenter", "--target", str(self.proc.pid), "--uts", "--", *self.argv(command)],
            env=self.env,
            cwd=self.project,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def http(self, probe: dict[str, Any]) -> int | None:
        """An httpGet probe's status code (``None``: nothing answers)."""
        get = probe["httpGet"]
        return http_status(self.ports[self.named.get(get["port"], get["port"])], get["path"])

    def probe_passes(self, kind: str) -> bool:
        probe = self.container[kind]
        if "httpGet" in probe:
            code = self.http(probe)
            return code is not None and 200 <= code < 400
        return self.exec(probe["exec"]["command"], timeout=10).returncode == 0

    def wait_started(self) -> None:
        """The startup probe passes within its budget, then readiness and liveness."""
        startup = self.container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert self.proc is not None
        wait_for(lambda: self.probe_passes("startupProbe"), budget, f"{self.name} started",
                 lambda: self.proc.log()[-3000:] if self.proc else "")  # fmt: skip
        wait_for(lambda: self.probe_passes("readinessProbe"), 30, f"{self.name} ready",
                 lambda: self.proc.log()[-3000:] if self.proc else "")  # fmt: skip
        # Kubernetes restarts a pod whose liveness probe fails failureThreshold
        # times in a row, periodSeconds apart: it must pass within that.
        live = self.container["livenessProbe"]
        wait_for(lambda: self.probe_passes("livenessProbe"),
                 live["periodSeconds"] * live["failureThreshold"], f"{self.name} live",
                 lambda: self.proc.log()[-3000:] if self.proc else "")  # fmt: skip

    def replace(self) -> float:
        """What a rolling update does to the pod: preStop, then SIGTERM; seconds it took."""
        assert self.proc is not None
        began = time.monotonic()
        hook = self.container["lifecycle"]["preStop"]["exec"]["command"]
        done = self.exec(hook, timeout=self.grace)
        assert done.returncode == 0, done.stdout + done.stderr
        self.proc.terminate()
        self.proc.wait(self.grace)
        return time.monotonic() - began


def status(pod: Pod) -> subprocess.CompletedProcess[str]:
    return pod.exec(["celery", "-A", "proj", "nats-leader", "status"])


def every_role_led(pod: Pod) -> str:
    """``nats-leader status`` in ``pod`` once it exits 0: every configured role has a leader.

    A started pod's probes pass while its elections may still be campaigning
    (a worker's embedded beat child starts after the worker), and a released
    role is taken by the successor's own campaign: awaited, not assumed.
    """
    shown: list[subprocess.CompletedProcess[str]] = []

    def led() -> bool:
        shown[:] = [status(pod)]
        return shown[0].returncode == 0

    wait_for(led, 30, "every role led in `nats-leader status`",
             lambda: shown[0].stdout + shown[0].stderr if shown else "")  # fmt: skip
    return shown[0].stdout


def heartbeats(pods: list[Pod]) -> int:
    return (
        sum(p.proc.log().count("Task proj.celery.heartbeat[") for p in pods if p.proc is not None)
        // 2
    )  # received + succeeded


def run_job(cluster: NatsCluster, project: Path, log_dir: Path) -> str:
    job = Pod(workload("buckets-job.yaml", "Job"), 0, cluster, project)
    proc = job.start(log_dir)
    assert proc.wait(60) == 0, proc.log()
    return proc.log()


class Prometheus:
    """A real Prometheus with the shipped scrape job and alert rules.

    ``deploy/prometheus/scrape-pods.yml``'s job as written, its relabelling
    included, except the discovery: Kubernetes' pod discovery gives one
    target per declared container port with the pod's annotations and the
    port's name as ``__meta_kubernetes_*`` labels; a file (rewritten as pods
    come and go) gives the same labels here, and the job's own rules decide
    what is scraped. It scrapes and evaluates every second, so that a rule's
    condition shows within seconds (as a pending alert: the rules' ``for``
    durations are a minute, and the firing itself is unit-tested with
    promtool).
    """

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.targets_file = tmp_path / "targets.json"
        self.targets_file.write_text("[]")
        config = tmp_path / "prometheus.yml"
        shipped = yaml.safe_load(SCRAPE_JOB.read_text())
        [job] = shipped["scrape_configs"]
        del job["kubernetes_sd_configs"]
        job["file_sd_configs"] = [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(SCRAPE_JOB.parent / f) for f in shipped["rule_files"]],
                    "scrape_configs": [job],
                }
            )
        )
        self.proc = Proc(
            "prometheus",
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            env=dict(os.environ),
            log_path=tmp_path / "prometheus.log",
            cwd=tmp_path,
        )
        wait_for(lambda: self._get("/-/ready") is not None, 30, "Prometheus ready")

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                body = r.read()
        except OSError:
            return None
        return json.loads(body) if path.startswith("/api/") else body

    def scrape(self, pods: list[Pod]) -> None:
        """Discover the pods still running, as Kubernetes' pod discovery would."""
        targets = []
        for pod in pods:
            if pod.proc is None or not pod.proc.alive:
                continue
            meta = {
                "__meta_kubernetes_namespace": "default",
                "__meta_kubernetes_pod_name": pod.name,
                **{
                    "__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", name): value
                    for name, value in pod.annotations.items()
                },
            }
            for name, container_port in pod.named.items():
                targets.append(
                    {
                        "targets": [f"127.0.0.1:{pod.ports[container_port]}"],
                        "labels": {**meta, "__meta_kubernetes_pod_container_port_name": name},
                    }
                )
        self.targets_file.write_text(json.dumps(targets))

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        return [] if answer is None else list(answer["data"]["result"])

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The alerts ``name``, pending or firing, as Prometheus evaluates them."""
        answer = self._get("/api/v1/alerts")
        found = [] if answer is None else answer["data"]["alerts"]
        return [a for a in found if a["labels"]["alertname"] == name]

    def leader_pod(self, role: str) -> str | None:
        """The pod whose scraped ``nats_leader_is_leader`` says it leads ``role``."""
        found = self.query(f'nats_leader_is_leader{{role="{role}"}} == 1')
        return str(found[0]["metric"]["pod"]) if len(found) == 1 else None

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def tick_runs(pods: list[Pod]) -> Counter[str]:
    """Each heartbeat task id (one per tick) and how often it succeeded."""
    found: Counter[str] = Counter()
    for pod in pods:
        if pod.proc is not None:
            found.update(SUCCEEDED.findall(pod.proc.log()))
    return found


#: Numbers of pods started after the first ones (their names: beat-7, ...).
POD_NUMBERS = itertools.count(10)


def crash_the_beat_pods(
    prometheus: Prometheus,
    workers: list[Pod],
    beats: list[Pod],
    cluster: NatsCluster,
    project: Path,
    log_dir: Path,
) -> list[Pod]:
    """SIGKILL the leading beat pod, then the other; Kubernetes starts new ones.

    Prometheus scrapes the pods' declared ports and evaluates the shipped
    rules on those series: one leader of each role, the successor after the
    crash, ``NatsLeaderRoleGone`` while no beat pod runs, and not after.
    Returns the beat pods running at the end.
    """
    prometheus.scrape([*workers, *beats])

    def leaders() -> dict[str, str]:
        found = prometheus.query("sum by (role) (nats_leader_is_leader)")
        return {r["metric"]["role"]: r["value"][1] for r in found}

    wait_for(lambda: leaders() == {"reports": "1", "beat": "1"}, 30, "one leader of each role")
    crashed = wait_for(lambda: prometheus.leader_pod("beat"), 30, "the beat leader's series")
    [leading] = [p for p in beats if p.name == crashed]
    assert leading.proc is not None
    leading.proc.kill()
    leading.proc.wait(10)
    prometheus.scrape([*workers, *beats])
    # The other beat pod takes over within the TTL (the default, 10 s).
    successor = wait_for(
        lambda: (name := prometheus.leader_pod("beat")) not in (None, crashed) and name,
        10 + 15,
        "a successor of the killed beat pod",
    )
    before = heartbeats(workers)
    wait_for(lambda: heartbeats(workers) >= before + 2, 30, f"ticks from {successor}")

    # Every beat pod down: the role's series are gone, NoLeader cannot fire,
    # NatsLeaderRoleGone does (pending: its "for" is a minute).
    for pod in beats:
        if pod.proc is not None and pod.proc.alive:
            pod.proc.kill()
            pod.proc.wait(10)
    prometheus.scrape(workers)
    wait_for(
        lambda: [a["labels"]["role"] for a in prometheus.alerts("NatsLeaderRoleGone")] == ["beat"],
        30,
        "NatsLeaderRoleGone for beat",
    )
    fresh = [
        Pod(workload("beat.yaml", "Deployment"), next(POD_NUMBERS), cluster, project) for _ in beats
    ]
    for pod in fresh:
        pod.start(log_dir)
    for pod in fresh:
        pod.wait_started()
    prometheus.scrape([*workers, *fresh])
    wait_for(lambda: not prometheus.alerts("NatsLeaderRoleGone"), 30, "NatsLeaderRoleGone to clear")
    wait_for(lambda: leaders() == {"reports": "1", "beat": "1"}, 30, "a beat leader again")
    return fresh


def test_worker_and_beat_manifests_come_up_tick_and_roll_over(
    cluster: NatsCluster, project: Path, tmp_path: Path
) -> None:
    created = run_job(cluster, project, tmp_path)
    for made in (
        "election bucket 'leaders' created",
        "beat state bucket 'leaders_beat' created",
        "once-guard lease bucket 'leaders_once_leases' created",
        "once-guard done bucket 'leaders_once' created",
    ):
        assert made in created, created
    # Four buckets, each on the three servers (R3), as the Job asks.
    assert created.count("  replicas       3\n") == 4, created

    workers = [Pod(workload("worker.yaml", "Deployment"), i, cluster, project) for i in range(2)]
    beats = [Pod(workload("beat.yaml", "Deployment"), i, cluster, project) for i in range(2)]
    try:
        for pod in [*workers, *beats]:
            pod.start(tmp_path)
        for pod in [*workers, *beats]:
            pod.wait_started()
        shown = every_role_led(workers[0])
        assert "reports" in shown and "beat" in shown, shown
        wait_for(lambda: heartbeats(workers) >= 2, 30, "beat's ticks run on a worker")
        for pod in workers:
            assert "once-guard cannot use" not in (pod.proc.log() if pod.proc else "")

        prometheus = Prometheus(tmp_path)
        try:
            beats = crash_the_beat_pods(prometheus, workers, beats, cluster, project, tmp_path)
        finally:
            prometheus.close()

        # A rolling update: each pod replaced in turn, its roles handed over.
        for old in [*workers, *beats]:
            seconds = old.replace()
            assert seconds < old.grace, (old.name, seconds)
            fresh = Pod(
                workload("worker.yaml" if old in workers else "beat.yaml", "Deployment"),
                next(POD_NUMBERS),
                cluster,
                project,
            )
            fresh.start(tmp_path)
            fresh.wait_started()
            (workers if old in workers else beats).append(fresh)
        live = [p for p in [*workers, *beats] if p.proc is not None and p.proc.alive]
        assert len(live) == 4
        every_role_led(live[0])
        before = heartbeats(workers)
        wait_for(lambda: heartbeats(workers) >= before + 2, 30, "ticks after the roll")
        # Through the crashes and the roll, every tick ran once.
        runs = tick_runs(workers)
        assert runs and max(runs.values()) == 1, [t for t, n in runs.items() if n > 1]
    finally:
        for pod in [*workers, *beats]:
            if pod.proc is not None and pod.proc.alive:
                pod.proc.kill()


@contextlib.contextmanager
def embedded_beat_pods(cluster: NatsCluster, project: Path, log_dir: Path) -> Iterator[list[Pod]]:
    """The Job, then two ``worker-with-beat.yaml`` pods: started, led, ticking; killed after."""
    run_job(cluster, project, log_dir)
    pods = [
        Pod(workload("worker-with-beat.yaml", "Deployment"), i, cluster, project) for i in range(2)
    ]
    try:
        for pod in pods:
            pod.start(log_dir)
        for pod in pods:
            pod.wait_started()  # the liveness probe asks both ports
        every_role_led(pods[0])
        wait_for(lambda: heartbeats(pods) >= 2, 30, "the embedded beat's ticks run")
        yield pods
    finally:
        for pod in pods:
            if pod.proc is not None and pod.proc.alive:
                pod.proc.kill()


def test_worker_with_embedded_beat_manifest_comes_up(
    cluster: NatsCluster, project: Path, tmp_path: Path
) -> None:
    with embedded_beat_pods(cluster, project, tmp_path) as pods:
        # The shipped scrape job keeps both ports of each pod, by name; the
        # beat role's series come from the beat child's.
        prometheus = Prometheus(tmp_path)
        try:
            prometheus.scrape(pods)
            wanted = {(p.name, port) for p in pods for port in ("metrics", "beat-metrics")}
            wait_for(
                lambda: (
                    {
                        (r["metric"]["pod"], r["metric"]["port_name"])
                        for r in prometheus.query("up == 1")
                    }
                    == wanted
                ),
                30,
                "both ports of every pod scraped",
            )
            wait_for(
                lambda: (
                    {
                        (r["metric"]["role"], r["metric"]["port_name"])
                        for r in prometheus.query("nats_leader_is_leader")
                    }
                    == {("reports", "metrics"), ("beat", "beat-metrics")}
                ),
                30,
                "each role's series on its process's port",
            )
        finally:
            prometheus.close()
        seconds = pods[0].replace()
        assert seconds < pods[0].grace
        every_role_led(pods[1])


def roll_nats_pod(cluster: NatsCluster, index: int) -> float:
    """What a rolling update of ``nats.yaml`` does to one server; seconds it was down.

    Its ``preStop`` hook as written (lame duck mode, then the wait for the
    server's exit; the container's process 1 is nats-server, here it has a
    pid of its own), then SIGTERM, within ``terminationGracePeriodSeconds``;
    then the new pod's server on the same store, passing its probes before
    the StatefulSet goes on to the next.
    """
    spec = workload("nats.yaml", "StatefulSet")["spec"]["template"]["spec"]
    [container] = spec["containers"]
    server = cluster.servers[index]
    pid = server.pid
    assert pid is not None
    shell, flag, script = container["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, flag) == ("sh", "-c"), (shell, flag)
    assert script.startswith("nats-server ") and script.count(" 1 ") + script.count("=1 ") == 2
    script = script.replace("nats-server ", f"{shlex.quote(server.binary)} ", 1)
    script = script.replace("ldm=1 ", f"ldm={pid} ").replace("kill -0 1 ", f"kill -0 {pid} ")
    grace = spec["terminationGracePeriodSeconds"]
    began = time.monotonic()
    hook = subprocess.Popen(
        [shell, flag, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # The server exits after the lame duck mode's grace period and the
        # closing of every client's connection (reaped by its parent, this
        # process, as a container ends with its process 1); the hook then.
        wait_for(lambda: not server.is_running, grace, f"{server.server_name} to leave")
        output, _ = hook.communicate(timeout=5)
    finally:
        if hook.poll() is None:
            hook.kill()
    assert hook.returncode == 0, output
    server.stop()  # the SIGTERM after the hook: nothing left to stop
    log = server.log_text(since_start=True)
    assert "Entering lame duck mode" in log, log[-3000:]
    cluster.restart(index)
    for kind in ("startupProbe", "readinessProbe"):
        wait_for(
            functools.partial(nats_probe_passes, server, container, kind),
            60,
            f"{server.server_name} passes its {kind}",
        )
    return time.monotonic() - began


def terms(pod: Pod) -> dict[str, tuple[str, int]]:
    """Each role's leader and epoch, from ``nats-leader status --json``."""
    shown = pod.exec(["celery", "-A", "proj", "nats-leader", "status", "--json"])
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return {r["role"]: (r["leader_id"], r["epoch"]) for r in json.loads(shown.stdout)["roles"]}


def test_a_nats_rolling_update_through_its_prestop_keeps_every_term(
    cluster: NatsCluster, project: Path, tmp_path: Path
) -> None:
    """``nats.yaml``'s servers replaced one by one, highest ordinal first, under running pods.

    Lame duck mode moves the pods' connections to the other servers before
    each one stops: no role changes leader, beat's ticks go on, each once.
    """
    with embedded_beat_pods(cluster, project, tmp_path) as pods:
        # These pods' own terms: a pod killed by an earlier test leaves its
        # record until the key expires (an instance id starts with its host).
        def own_terms() -> dict[str, tuple[str, int]] | None:
            now = terms(pods[0])
            hosts = {leader.split(":")[0] for leader, _ in now.values()}
            ours = set(now) == {"reports", "beat"} and hosts <= {p.name for p in pods}
            return now if ours else None

        before = wait_for(own_terms, 60, "both roles led by these pods")

        for index in reversed(range(len(cluster.servers))):
            seconds = roll_nats_pod(cluster, index)
            print(f"{cluster.servers[index].server_name}: replaced in {seconds:.1f}s")

        assert terms(pods[1]) == before
        ticked = heartbeats(pods)
        wait_for(lambda: heartbeats(pods) >= ticked + 2, 30, "ticks after the roll")
        runs = tick_runs(pods)
        assert runs and max(runs.values()) == 1, [t for t, n in runs.items() if n > 1]
        for pod in pods:
            assert pod.proc is not None and pod.proc.alive, pod.name


def test_the_readme_app_is_what_the_manifests_run() -> None:
    # Every container runs `celery -A proj`, the README's app.
    for name in ("worker.yaml", "beat.yaml", "worker-with-beat.yaml", "buckets-job.yaml"):
        for doc in manifest(name):
            if doc["kind"] in ("Deployment", "Job"):
                [container] = doc["spec"]["template"]["spec"]["containers"]
                assert shlex.join(container["command"]).startswith("celery -A proj "), name
