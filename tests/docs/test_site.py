"""The documentation site builds with warnings as errors.

MkDocs validates every internal link and anchor (``validation`` in
``mkdocs.yml``), so a page renamed or a heading changed without its links
fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict_has_no_warning(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    pages = sorted(p.parent.name for p in tmp_path.glob("*/index.html"))
    assert "getting-started" in pages and "design" in pages, pages
