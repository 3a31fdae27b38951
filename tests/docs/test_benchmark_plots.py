"""``benchmarks/plots.py`` draws the benchmark figures from the benchmarks' JSON output.

A small sample of what ``core.py --json`` and ``beat_failover.py --json``
write goes through the script as a user runs it; the numbers it prints are
the sample's, and the images are real PNGs of the expected size with
something drawn on them. The figures in docs/ are the ones benchmarks.md shows.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "plots.py"

CORE = {
    "benchmark": "core",
    "machine": "test x86_64, 2 cores, Python 3.11",
    "servers": [
        {
            "version": version,
            "measurements": [
                {"name": "KV `get` round trip (floor)", "samples": [0.0003], "unit": 1000,
                 "suffix": " ms", "target": "–"},
                {"name": "crash failover, TTL 1 s, 5 candidates", "samples": ttl1, "unit": 1,
                 "suffix": "s", "target": "p99 ≤ 1.05 s"},
                {"name": "crash failover, TTL 5 s, 5 candidates", "samples": ttl5, "unit": 1,
                 "suffix": "s", "target": "p99 ≤ 5.05 s"},
                {"name": "graceful hand-over, 10 candidates", "samples": handover, "unit": 1000,
                 "suffix": " ms", "target": "p99 ≤ 5 ms"},
            ],
            "notes": [],
        }
        for version, ttl1, ttl5, handover in (
            ("2.9.10", [0.80, 0.85, 0.90], [4.80, 4.85, 4.90], [0.004, 0.005, 0.010]),
            ("2.15.1", [0.82, 0.84, 0.98], [4.81, 4.83, 4.99], [0.005, 0.006, 0.011]),
        )
    ],
}  # fmt: skip


def _crash(point: str, failover: float, lost: float, dup: int = 0) -> dict[str, object]:
    return {"point": point, "failover": failover, "lost": lost, "duplicates": dup,
            "run_twice": 0, "never_run": 0}  # fmt: skip


BEAT = {
    "benchmark": "beat_failover",
    "settings": {"replicas": 3, "entries": 5, "lock_ttl": 5, "loop_interval": 1.0,
                 "nats_server": "2.9.10", "machine": "Linux x86_64, 2 CPUs, Python 3.11"},
    "schedulers": {
        "celery-nats-leader": {
            "crashes": [_crash("random", 4.5, 0), _crash("before publish", 4.0, 0),
                        _crash("after publish", 5.1, 0, 1)],
            "pauses": {"mid-dispatch": [{"duplicates": 1, "outcome": "kept running",
                                         "run_twice": 0}],
                       "random": [{"duplicates": 0, "outcome": "kept running", "run_twice": 0}]},
        },
        "celery-redbeat": {
            "crashes": [_crash("random", 5.2, 4.8), _crash("before publish", 4.3, 5.2),
                        _crash("after publish", 5.6, 5.4)],
            "pauses": {"mid-dispatch": [{"duplicates": 4, "outcome": "exited", "run_twice": 4}],
                       "random": [{"duplicates": 0, "outcome": "exited", "run_twice": 0}]},
        },
    },
}  # fmt: skip


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _drawn_share(path: Path) -> float:
    """Share of the image's pixels that are not white."""
    from matplotlib import image

    pixels = image.imread(str(path))[:, :, :3]
    return float((pixels.sum(axis=2) < 2.9).mean())


def test_plots_are_drawn_from_the_benchmarks_json(tmp_path: Path) -> None:
    core, beat = tmp_path / "core.json", tmp_path / "beat.json"
    core.write_text(json.dumps(CORE))
    beat.write_text(json.dumps(BEAT))
    out = tmp_path / "images"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--core", str(core), "--beat", str(beat), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == [
        "failover-by-server.png: crash failover, TTL 1 s, nats-server 2.9.10: "
        "3 runs, median 0.850 s, max 0.900 s",
        "failover-by-server.png: crash failover, TTL 1 s, nats-server 2.15.1: "
        "3 runs, median 0.840 s, max 0.980 s",
        "failover-by-server.png: crash failover, TTL 5 s, nats-server 2.9.10: "
        "3 runs, median 4.850 s, max 4.900 s",
        "failover-by-server.png: crash failover, TTL 5 s, nats-server 2.15.1: "
        "3 runs, median 4.830 s, max 4.990 s",
        "failover-by-server.png: graceful hand-over, nats-server 2.9.10: "
        "3 runs, median 5.000 ms, max 10.000 ms",
        "failover-by-server.png: graceful hand-over, nats-server 2.15.1: "
        "3 runs, median 6.000 ms, max 11.000 ms",
        "beat-vs-redbeat.png: celery-nats-leader: 3 kills, median failover 4.50 s, "
        "ticks lost 0.0, sent twice 2, run twice 0",
        "beat-vs-redbeat.png: celery-redbeat: 3 kills, median failover 5.20 s, "
        "ticks lost 15.4, sent twice 4, run twice 4",
    ]
    assert _png_size(out / "failover-by-server.png") == (1100, 396)
    assert _png_size(out / "beat-vs-redbeat.png") == (1100, 418)
    for name in ("failover-by-server.png", "beat-vs-redbeat.png"):
        assert 0.02 < _drawn_share(out / name) < 0.5, name  # drawn on, not a black box

    # The same input draws the same files (they are checked into docs/).
    again = tmp_path / "again"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--core",
            str(core),
            "--beat",
            str(beat),
            "--out",
            str(again),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    for name in ("failover-by-server.png", "beat-vs-redbeat.png"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_benchmarks_page_shows_the_figures_of_the_checked_in_data(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    shown = set(re.findall(r"!\[[^\]]*\]\(images/([\w.-]+\.png)\)", page))
    assert shown == {"failover-by-server.png", "beat-vs-redbeat.png"}
    # Drawn again from benchmarks/data/: the same figures, and the medians
    # the script prints from that data are the ones the page quotes.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    for name in shown:
        assert _png_size(tmp_path / name) == _png_size(ROOT / "docs" / "images" / name), name
    medians = re.findall(
        r"(?:crash failover|celery-\S+).*?median (?:failover )?([\d.]+ s)", result.stdout
    )
    # Four crash failovers (two TTLs, two servers), three beat schedulers.
    assert len(medians) == 7, result.stdout
    for median in medians:
        number = median.removesuffix(" s")
        assert f"{number} s" in page or f"{number} /" in page, f"{median} not on the page"
