"""The documentation site builds with warnings as errors.

MkDocs validates every internal link and anchor (``validation`` in
``mkdocs.yml``), so a page renamed or a heading changed without its links
fails here.
"""

from __future__ import annotations

import html
import os
import re
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
    # The home page's diagram of a term's life is a Mermaid block the theme
    # draws (the custom fence is configured), not a code listing.
    home = html.unescape((tmp_path / "index.html").read_text())
    (diagram,) = re.findall(r'<pre class="mermaid"><code>(.*?)</code></pre>', home, re.S)
    assert diagram.startswith("sequenceDiagram")
    phases = re.findall(r"rect [^\n]+\n\s+Note over [\w,]+: ([\w-]+)", diagram)
    assert phases == ["campaign", "renew", "hand-over", "crash", "fence"]
    assert "refused: 12 < floor 15" in diagram


README = ROOT / "README.md"


def test_readme_stays_a_front_door() -> None:
    # The reference lives in docs/; the README is what it is, two commands,
    # quickstarts, headline numbers and links.
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference into docs/"


def test_readme_links_into_the_site_resolve() -> None:
    from markdown.extensions.toc import slugify

    text = README.read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links, "the README links into docs/"
    for path, anchor in links:
        page = ROOT / path
        assert page.is_file(), f"README links to missing {path}"
        if anchor:
            headings = re.findall(r"^#{1,6} (.+?)\s*$", page.read_text(), re.M)
            slugs = {slugify(h, "-") for h in headings}
            assert anchor in slugs, f"README links to {path}#{anchor}: no such heading"
