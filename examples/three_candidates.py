"""Three candidate processes elect a leader; the leader is killed; then a clean stop.

Run it with ``.venv/bin/python examples/three_candidates.py``. It uses the
NATS server of ``NATS_URL``, or starts a private ``nats-server -js`` (from
``PATH`` or ``/usr/sbin``) on a free port with a temporary store, and prints
what happens:

* three ``examples/leader.py`` processes campaign; one leads;
* the leader is killed with SIGKILL: a follower takes over within the TTL;
* the new leader is stopped with SIGTERM: it releases the key and the last
  follower is promoted within milliseconds;
* after each step, the role as an operator sees it (``Elector.status``).

Exit status 0 when all of that happened and the epochs grew with every term.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from celery_nats_leader import ElectionConfig, Elector

ROLE = "reports"
BUCKET = "example_leaders"
TTL = 2.0
LEADER = Path(__file__).with_name("leader.py")
EVENT = re.compile(r"^(?P<name>\S+) (?P<what>leading epoch (?P<epoch>\d+)|stopped leading|ready)")


class Candidates:
    """``examples/leader.py`` processes and the events they print."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.events: list[tuple[float, str, str, int]] = []  # (when, who, what, epoch)
        self.changed = threading.Condition()

    def spawn(self, name: str) -> None:
        """Start one candidate."""
        proc = subprocess.Popen(
            [sys.executable, str(LEADER), "--name", name, "--role", ROLE, "--bucket", BUCKET,
             "--ttl", str(TTL)],
            env={**os.environ, "NATS_URL": self.url, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.procs[name] = proc
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = EVENT.match(line)
            if match:
                what = match["what"].split(" epoch")[0]
                with self.changed:
                    self.events.append(
                        (time.monotonic(), match["name"], what, int(match["epoch"] or 0))
                    )
                    self.changed.notify_all()

    def wait(
        self, what: str, among: set[str], since: float = 0.0, timeout: float = 15.0
    ) -> tuple[float, str, int]:
        """The first ``what`` event ("leading", "ready") of one of ``among`` after ``since``."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for at, name, kind, epoch in self.events:
                    if kind == what and name in among and at >= since:
                        return at, name, epoch
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit(
                        f"FAILED: no {what!r} from {sorted(among)} within {timeout}s; "
                        f"seen: {self.events}"
                    )
                self.changed.wait(left)

    def ready(self, names: set[str]) -> None:
        """Wait until every candidate in ``names`` has started its election."""
        for name in names:
            self.wait("ready", {name})

    def close(self) -> None:
        """Stop whatever still runs."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def show(elector: Elector) -> None:
    """Print the role as ``celery nats-leader status`` would see it."""
    for row in elector.status(BUCKET):
        if row.role != ROLE:
            continue
        alive = ", ".join(f"{c['id']} ({c['state']})" for c in row.candidates)
        print(f"   status: leader {row.leader_id}, epoch {row.epoch}; live candidates: {alive}")


def scenario(url: str) -> None:
    """Drive three candidates and narrate."""
    print(f"NATS at {url}; role {ROLE!r}, TTL {TTL:g}s")
    names = {"candidate-1", "candidate-2", "candidate-3"}
    group = Candidates(url)
    # An observer: reads the status; campaigns for nothing (a role of its own).
    with Elector(url) as elector:
        elector.add_role(
            ElectionConfig(role="observer", bucket=BUCKET, ttl=TTL, create_bucket=True)
        )
        try:
            for name in sorted(names):
                group.spawn(name)
            group.ready(names)
            _, first, epoch1 = group.wait("leading", names)
            print(f"1. {first} leads (epoch {epoch1})")
            show(elector)

            group.procs[first].kill()
            killed_at = time.monotonic()
            rest = names - {first}
            at, second, epoch2 = group.wait("leading", rest, since=killed_at)
            print(
                f"2. SIGKILL {first}: {second} leads {at - killed_at:.2f}s later "
                f"(within the TTL of {TTL:g}s), epoch {epoch2}"
            )
            show(elector)

            group.procs[second].send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            at, third, epoch3 = group.wait("leading", rest - {second}, since=stopped_at)
            print(
                f"3. SIGTERM {second}: it released the key; {third} leads "
                f"{(at - stopped_at) * 1000:.0f} ms later, epoch {epoch3}"
            )
            show(elector)
        finally:
            group.close()
    if not epoch1 < epoch2 < epoch3:
        raise SystemExit(f"FAILED: epochs {epoch1}, {epoch2}, {epoch3} did not grow")
    print("Epochs grew with every term: a stale leader's token is always older.")


@contextmanager
def nats_server() -> Iterator[str]:
    """A private JetStream nats-server on a free port; yields its URL."""
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as store:
        proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            for line in proc.stderr:  # it logs to stderr; ready when it says so
                if "Server is ready" in line:
                    break
            else:
                raise SystemExit(f"FAILED: {binary} exited with {proc.wait()}")
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


def main() -> None:
    """Use ``NATS_URL`` or a private server, then run the scenario."""
    url = os.environ.get("NATS_URL")
    if url:
        scenario(url)
        return
    with nats_server() as url:
        scenario(url)


if __name__ == "__main__":
    main()
