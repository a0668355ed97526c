"""The README is a front page (issue 31): at most 250 lines, and every relative link and picture
in it points at a file of the repository (and at a heading of that page, when it names one)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's (and MkDocs' toc) anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m[1]) for m in re.finditer(r"^#+\s+(.*)$", page.read_text(), re.MULTILINE)}


def test_readme_is_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the tables belong in docs/"


def test_readme_relative_links_resolve():
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"^[a-z]+://|^mailto:", t)]
    assert len(targets) > 10, "the link pattern found too few links"
    broken = []
    for target in targets:
        path, _, anchor = target.partition("#")
        page = (ROOT / path).resolve() if path else README
        if not page.exists() or anchor and page.suffix == ".md" and anchor not in _anchors(page):
            broken.append(target)
    assert not broken, f"README.md links to what is not there: {broken}"


def test_slug_matches_known_headings():
    assert _slug("Recipes: keep the best weights, stop a run that diverges") == (
        "recipes-keep-the-best-weights-stop-a-run-that-diverges"
    )
    assert _slug("`EarlyStopping` and `ModelCheckpoint` on the HDI") == "earlystopping-and-modelcheckpoint-on-the-hdi"
