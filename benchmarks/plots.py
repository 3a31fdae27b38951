"""Plots of the benchmarks' JSON output, for docs/benchmarks.md.

Reads what ``core.py --json`` and ``beat_failover.py --json`` wrote and draws:

* ``failover-by-server.png``: every crash failover (TTL 1 s and 5 s) and every
  graceful hand-over of ``core.py``, one column per nats-server version,
  each run a dot over its box (median, quartiles);
* ``beat-vs-redbeat.png``: ``beat_failover.py``'s two schedulers: the time
  from the kill of the active scheduler to the next dispatch (each kill a
  dot, by kill point), and the ticks lost, sent twice and run twice.

Run::

    python benchmarks/core.py --only core --scale-roles 0 --json benchmarks/data/core.json
    python benchmarks/beat_failover.py --json benchmarks/data/beat_failover.json
    python benchmarks/plots.py            # writes docs/images/*.png

Each figure's numbers are printed too (one line per series), so a run can be
checked against the tables. Needs matplotlib (in the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "data"
IMAGES = ROOT / "docs" / "images"

#: The core benchmark's measurements drawn, by name prefix: (panel title, scale, unit).
CORE_PANELS = (
    ("crash failover, TTL 1 s", "crash failover, TTL 1 s", 1.0, "s"),
    ("crash failover, TTL 5 s", "crash failover, TTL 5 s", 1.0, "s"),
    ("graceful hand-over", "graceful hand-over, 10 candidates", 1000.0, "ms"),
)
#: One colour per scheduler / server, the same in every figure.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
#: Marker per kill point of the beat benchmark.
MARKERS = {"random": "o", "before publish": "v", "after publish": "^"}

# The figures are files checked into docs/: no timestamp or random id in them.
_SAVE = {"dpi": 110, "metadata": {"Software": None}}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _jitter(count: int, seed: int) -> list[float]:
    import numpy as np

    # Fixed seed: the same input draws the same file.
    return list(np.random.default_rng(seed).uniform(-0.12, 0.12, count))


def _measurement(server: dict[str, Any], prefix: str) -> list[float]:
    for item in server["measurements"]:
        if item["name"].startswith(prefix):
            return [float(v) for v in item["samples"]]
    return []


def failover_by_server(core: dict[str, Any], out: Path) -> list[str]:
    """Draw the core benchmark's failover and hand-over per nats-server version.

    Returns:
        One line per (panel, server): runs, median, p99-ish max, for the log.

    """
    plt = _pyplot()
    servers = core["servers"]
    names = [f"nats-server\n{s['version']}" for s in servers]
    fig, axes = plt.subplots(1, len(CORE_PANELS), figsize=(10, 3.6), layout="constrained")
    lines = []
    for ax, (title, prefix, scale, unit) in zip(axes, CORE_PANELS, strict=True):
        series = [[v * scale for v in _measurement(s, prefix)] for s in servers]
        ax.boxplot(
            series,
            positions=range(len(series)),
            widths=0.5,
            showfliers=False,
            medianprops={"color": "black"},
        )
        for i, values in enumerate(series):
            xs = [i + dx for dx in _jitter(len(values), seed=i)]
            ax.scatter(xs, values, s=12, alpha=0.7, color=COLOURS[i % len(COLOURS)], zorder=3)
            if values:
                lines.append(
                    f"{out.name}: {title}, nats-server {servers[i]['version']}: "
                    f"{len(values)} runs, median {statistics.median(values):.3f} {unit}, "
                    f"max {max(values):.3f} {unit}"
                )
        top = max((max(v) for v in series if v), default=1.0)
        if unit == "s":
            ttl = float(title.rsplit("TTL ", 1)[1].split()[0])
            ax.axhline(ttl, color="grey", linestyle="--", linewidth=1)
            ax.annotate("TTL", (-0.45, ttl), color="grey", va="bottom", ha="left")
            top = max(top, ttl)
        ax.set_xticks(range(len(series)), names)
        ax.set_xlim(-0.6, len(series) - 0.4)
        ax.set_ylabel(unit)
        if unit == "ms":
            # Hand-overs: a few ms, with a tail under load ten times longer.
            ax.set_yscale("log")
            bottom = min((min(v) for v in series if v), default=1.0)
            ax.set_ylim(bottom * 0.7, top * 1.5)
            ax.set_title(f"{title} (log scale)")
        else:
            ax.set_ylim(0, top * 1.12)
            ax.set_title(title)
    load = core.get("load_average")
    under = f", load average {load[0]:.1f} → {load[1]:.1f}" if load else ""
    fig.suptitle(f"Crash failover and graceful hand-over, {core['machine']}{under}", fontsize=9)
    fig.savefig(out, **_SAVE)
    plt.close(fig)
    return lines


def beat_vs_redbeat(beat: dict[str, Any], out: Path) -> list[str]:
    """Draw beat's failover and tick losses against celery-redbeat.

    Returns:
        One line per scheduler: kills, median failover, ticks lost / sent
        twice / run twice, for the log.

    """
    plt = _pyplot()
    schedulers = beat["schedulers"]
    labels = list(schedulers)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10, 3.8), layout="constrained", width_ratios=(1, 1.4)
    )
    lines = []
    for i, label in enumerate(labels):
        crashes = schedulers[label]["crashes"]
        for point, marker in MARKERS.items():
            values = [c["failover"] for c in crashes if c["point"] == point]
            xs = [i + dx for dx in _jitter(len(values), seed=10 * i + len(point))]
            left.scatter(
                xs,
                values,
                marker=marker,
                s=28,
                color=COLOURS[i % len(COLOURS)],
                alpha=0.8,
                zorder=3,
            )
        failovers = [c["failover"] for c in crashes]
        if failovers:
            median = statistics.median(failovers)
            left.hlines(median, i - 0.25, i + 0.25, color="black", linewidth=1.5)
        pauses = [p for kind in schedulers[label]["pauses"].values() for p in kind]
        twice = sum(int(s.get("run_twice", 0)) for s in [*crashes, *pauses])
        lines.append(
            f"{out.name}: {label}: {len(crashes)} kills, median failover "
            f"{statistics.median(failovers) if failovers else float('nan'):.2f} s, "
            f"ticks lost {sum(c['lost'] for c in crashes):.1f}, sent twice "
            f"{sum(c['duplicates'] for c in [*crashes, *pauses])}, run twice {twice}"
        )
    ttl = float(beat["settings"]["lock_ttl"])
    left.axhline(ttl, color="grey", linestyle="--", linewidth=1)
    left.annotate("lock TTL", (-0.55, ttl), color="grey", va="bottom", ha="left")
    # The legend says what the markers mean; the colour is the scheduler's.
    for point, marker in MARKERS.items():
        left.scatter([], [], marker=marker, color="grey", label=f"killed {point}")
    left.hlines([], 0, 0, color="black", linewidth=1.5, label="median")
    every = [c["failover"] for label in labels for c in schedulers[label]["crashes"]]
    left.set_xticks(range(len(labels)), labels)
    left.set_xlim(-0.6, len(labels) - 0.4)
    left.set_ylim(0, max([ttl, *every]) * 1.15)
    left.set_ylabel("s")
    left.set_title("SIGKILL of the active scheduler → next dispatch")
    left.legend(loc="lower center", fontsize=8, frameon=False)

    # Right: per scenario, ticks lost (per kill, mean), sent twice and run twice (totals).
    points = list(MARKERS)
    groups = [f"killed\n{p}" for p in points] + ["paused\nmid-dispatch", "paused\nat random"]
    kinds = 3  # bars per scheduler: lost, sent twice, run twice
    width = 0.84 / (kinds * len(labels))
    highest = 1.0
    for i, label in enumerate(labels):
        crashes, pauses = schedulers[label]["crashes"], schedulers[label]["pauses"]
        scenarios = [[c for c in crashes if c["point"] == p] for p in points]
        scenarios += [pauses.get("mid-dispatch", []), pauses.get("random", [])]
        # Ticks lost are measured after kills only (a paused scheduler's
        # successor dispatches on): no bar for the pauses.
        lost = [statistics.mean(c["lost"] for c in s) if s else 0.0 for s in scenarios[:3]]
        sent = [sum(int(c.get("duplicates", 0)) for c in s) for s in scenarios]
        twice = [sum(int(c.get("run_twice", 0)) for c in s) for s in scenarios]
        colour = COLOURS[i % len(COLOURS)]
        first = [g - 0.42 + (kinds * i + 0.5) * width for g in range(len(groups))]
        bars = (
            (first[:3], lost, {"color": colour}, "lost per kill (mean)"),
            ([x + width for x in first], sent, {"fill": False, "edgecolor": colour}, "sent twice"),
            (
                [x + 2 * width for x in first],
                twice,
                {"color": colour, "alpha": 0.45, "hatch": "//"},
                "run twice",
            ),
        )
        for xs, values, style, what in bars:
            right.bar(xs, values, width, label=f"{label}: {what}", **style)
            for x, value in zip(xs, values, strict=True):
                right.annotate(f"{value:.3g}", (x, value), ha="center", va="bottom", fontsize=6)
            highest = max(highest, *values)
    right.set_xticks(range(len(groups)), groups)
    right.set_ylim(0, highest * 1.6)  # room for the legend above the bars
    right.set_ylabel("ticks (lost: mean per kill; twice: totals)")
    right.set_title("Ticks lost, sent twice and run twice, by scenario")
    right.legend(fontsize=7, frameon=False, loc="upper left", ncols=2)
    settings = beat["settings"]
    fig.suptitle(
        f"Beat: {settings['replicas']} replicas, {settings['entries']} entries every 1 s, "
        f"lock TTL {settings['lock_ttl']} s, nats-server {settings['nats_server']}; "
        f"{settings['machine']}",
        fontsize=9,
    )
    fig.savefig(out, **_SAVE)
    plt.close(fig)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Draw every figure whose input exists; print one line per series."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=Path, default=RESULTS / "core.json")
    parser.add_argument("--beat", type=Path, default=RESULTS / "beat_failover.json")
    parser.add_argument("--out", type=Path, default=IMAGES, help="directory of the PNG files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    drawn = 0
    for path, draw, name in (
        (args.core, failover_by_server, "failover-by-server.png"),
        (args.beat, beat_vs_redbeat, "beat-vs-redbeat.png"),
    ):
        if not path.is_file():
            print(f"{path}: missing, {name} not drawn", file=sys.stderr)
            continue
        for line in draw(json.loads(path.read_text()), args.out / name):
            print(line)
        drawn += 1
    return 0 if drawn else 1


if __name__ == "__main__":
    sys.exit(main())
