"""Every code block of the docs and the README that is a complete program runs here.

A block is marked by an HTML comment on the line before its fence (invisible
on GitHub and in the site)::

    <!-- test: GROUP [file=PATH] [expect="text"] [wait="text|text"] -->

``GROUP`` says how it runs:

* ``run``: a Python program, run to completion against a real nats-server
  (``NATS_URL``); it must exit 0 and print ``expect`` when given.
* ``sigterm``: a long-running Python program; once it printed ``expect`` it
  gets SIGTERM, must exit 0 on its own and leave no leader key behind (the
  role was released, not left to expire).
* any other name: a *scenario*, the group's blocks in document order, in one
  project directory: a block with ``file=`` is written there; a ``sh`` block
  runs line by line (``celery ... worker`` / ``beat`` lines in the background,
  each next line waiting for the texts of ``wait`` in their output, the
  others must exit 0); a Python block without ``file=`` is a client program
  run to completion, after which ``expect`` must appear in the background
  processes' output.

Scenario projects get a ``proj/__init__.py`` of the test's own that exposes
the app and points its broker at this test's keys in the local Redis, so that
the documented ``proj/celery.py`` stays what a user writes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.js.errors import NoKeysError

from celery_nats_leader.testing import NatsServer
from tests.support.services import require_service

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REDIS_URL = os.environ.get("CNL_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The interpreter of the documented programs and commands: this one, or the one
#: of another virtualenv (tests/docs/test_install_pinned.py: a user's pinned versions).
PYTHON = os.environ.get("CNL_DOCS_PYTHON", sys.executable)
BIN = Path(PYTHON).parent

MARKED = re.compile(
    r"^<!-- test: (?P<spec>.*?) -->\n```(?P<lang>\w*)\n(?P<body>.*?)^```$", re.M | re.S
)


@dataclass
class Block:
    """One marked code block."""

    path: Path
    line: int
    group: str
    lang: str
    body: str
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def marked_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for m in MARKED.finditer(text):
            group, *rest = shlex.split(m["spec"])
            attrs = dict(item.split("=", 1) for item in rest)
            line = text.count("\n", 0, m.start()) + 2
            blocks.append(Block(path, line, group, m["lang"], m["body"], attrs))
    return blocks


BLOCKS = marked_blocks()
SCENARIOS = sorted({b.group for b in BLOCKS} - {"run", "sigterm"})


def _where(block: Block) -> str:
    return block.where


def test_blocks_are_marked_and_well_formed() -> None:
    # The programs this file promises to run are there (a broken marker would
    # silently drop them).
    assert [b for b in BLOCKS if b.group == "run"], "no `run` block found"
    assert [b for b in BLOCKS if b.group == "sigterm"], "no `sigterm` block found"
    assert {"celery-quickstart", "django-quickstart"} <= set(SCENARIOS), SCENARIOS
    for block in BLOCKS:
        assert block.lang in {"python", "sh"}, block.where
        assert set(block.attrs) <= {"file", "expect", "wait"}, block.where
        if block.lang == "python":
            compile(block.body, block.where, "exec")
    # Every marker precedes a fence (a marker followed by prose marks nothing).
    for path in DOCS:
        text = path.read_text()
        count = len(re.findall(r"^<!-- test: ", text, re.M))
        assert count == len([b for b in BLOCKS if b.path == path]), path


class Output:
    """A child process's combined output, read on a thread, awaitable by text."""

    def __init__(self, proc: subprocess.Popen[str], name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # EOF marker
            self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> str:
        """Block until a line containing ``needle`` appeared; return that line."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if needle in line:
                        return line
                seen = len(self.lines)
                if self.lines and self.lines[-1] == "":
                    raise AssertionError(
                        f"{self.name} exited before printing {needle!r}:\n{self.text}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{self.name}: no {needle!r} within {timeout}s:\n{self.text}"
                    )
                self._changed.wait(left)

    def close(self) -> None:
        """Wait for the reader to see EOF and close the pipe."""
        self._thread.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._thread.join(timeout)
        return code


def _start(argv: list[str], cwd: Path, env: dict[str, str], name: str) -> Output:
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: cleaned up as a whole
    )
    return Output(proc, name)


def _stop_group(out: Output) -> None:
    if out.proc.poll() is None:
        os.killpg(out.proc.pid, signal.SIGKILL)
        out.proc.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(out.proc.pid, signal.SIGKILL)  # anything it left behind
    out.close()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


def _env(nats_server: NatsServer, project: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CELERY_"))}
    env.update(
        NATS_URL=nats_server.url,
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(project),
        PYTHONUNBUFFERED="1",
    )
    return env


async def _live_keys(url: str, bucket: str = "leaders") -> list[str]:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(bucket)
        try:
            return list(await kv.keys())
        except NoKeysError:
            return []
    finally:
        await nc.close()


@pytest.mark.integration
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.group == "run"], ids=_where)
def test_program_runs(block: Block, nats_server: NatsServer, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.body)
    done = subprocess.run(
        [PYTHON, str(script)],
        cwd=tmp_path,
        env=_env(nats_server, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"
    if "expect" in block.attrs:
        assert block.attrs["expect"] in done.stdout, f"{block.where}\n{done.stdout}"


@pytest.mark.integration
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.group == "sigterm"], ids=_where)
async def test_program_releases_its_role_on_sigterm(
    block: Block, nats_server: NatsServer, tmp_path: Path
) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.body)
    out = _start([PYTHON, str(script)], tmp_path, _env(nats_server, tmp_path), block.where)
    try:
        out.wait_for(block.attrs["expect"], timeout=30)
        assert await _live_keys(nats_server.url), "leading, yet no key in the bucket"
        sent = time.monotonic()
        out.proc.send_signal(signal.SIGTERM)
        code = out.finish(timeout=10)
        stopped_after = time.monotonic() - sent
    finally:
        _stop_group(out)
    assert code == 0, out.text
    # Released, not left to expire: the key is gone when the process is.
    assert await _live_keys(nats_server.url) == [], out.text
    assert stopped_after < 5, f"SIGTERM took {stopped_after:.1f}s"


PROJ_INIT = '''\
"""Written by the docs test: the app of proj/celery.py, on this test's Redis keys."""
from .celery import app

app.conf.broker_url = {redis!r}
app.conf.broker_transport_options = {{"global_keyprefix": {prefix!r}}}
celery_app = app
'''

MANAGE_PY = """\
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""


def _is_background(argv: list[str]) -> bool:
    return argv[0] == "celery" and any(word in argv for word in ("worker", "beat"))


@pytest.mark.integration
@pytest.mark.celery
@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(scenario: str, nats_server: NatsServer, tmp_path: Path) -> None:
    require_service("redis broker", REDIS_URL)
    blocks = [b for b in BLOCKS if b.group == scenario]
    project = tmp_path / "project"
    (project / "proj").mkdir(parents=True)
    prefix = f"cnl-docs-{uuid.uuid4().hex[:10]}:"
    (project / "proj" / "__init__.py").write_text(PROJ_INIT.format(redis=REDIS_URL, prefix=prefix))
    (project / "manage.py").write_text(MANAGE_PY)
    env = _env(nats_server, project)
    background: list[Output] = []

    def log() -> str:
        return "\n".join(f"--- {o.name}\n{o.text}" for o in background)

    try:
        for block in blocks:
            if "file" in block.attrs:
                target = project / block.attrs["file"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.body)
            elif block.lang == "sh":
                waits = [w for w in block.attrs.get("wait", "").split("|") if w]
                for raw in block.body.splitlines():
                    command = raw.split("#", 1)[0].strip()
                    if not command:
                        continue
                    argv = shlex.split(command)
                    if _is_background(argv):
                        out = _start(argv, project, env, f"{block.where}: {command}")
                        background.append(out)
                        for text in waits:
                            out.wait_for(text, timeout=60)
                        continue
                    done = subprocess.run(
                        argv, cwd=project, env=env, capture_output=True, text=True,
                        timeout=60, check=False,
                    )  # fmt: skip
                    assert done.returncode == 0, (
                        f"{block.where}: `{command}` exited {done.returncode}\n"
                        f"{done.stdout}\n{done.stderr}\n{log()}"
                    )
            else:
                done = subprocess.run(
                    [PYTHON, "-c", block.body], cwd=project, env=env,
                    capture_output=True, text=True, timeout=60, check=False,
                )  # fmt: skip
                assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"
                if "expect" in block.attrs:
                    assert background, f"{block.where}: expect needs a running worker"
                    background[-1].wait_for(block.attrs["expect"], timeout=60)
        assert background, f"scenario {scenario} started no worker"
        for out in background:  # warm shutdown, as `docker stop` does
            out.proc.send_signal(signal.SIGTERM)
        for out in background:
            assert out.finish(timeout=30) == 0, log()
    finally:
        for out in background:
            _stop_group(out)
        _delete_redis_keys(prefix)


def _delete_redis_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
