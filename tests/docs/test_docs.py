"""README and docs/ stay true and walkable: every relative link in every page resolves (files
and heading anchors), README stays a first visit (under 250 lines, the two commands first),
and the pages that name server flags or metrics name ones that exist. The checkers are
``test_operations_doc``'s (tested there on bad samples)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.test_operations_doc import (
    FLAG,
    LINK,
    METRIC,
    broken_links,
    exported_metrics,
    server_flags,
    unknown_flags,
    unknown_metrics,
)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "deploy").rglob("README.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert not broken_links(text, page.parent), broken_links(text, page.parent)


def test_readme_is_a_first_visit() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) < 250, len(lines)
    opening = "\n".join(lines[:20])
    assert "python -m tinyserve" in opening and "bash .ci/run" in opening
    docs = {t for t in LINK.findall(text) if t.startswith("docs/")}
    for page in ("usage", "api", "architecture", "operations", "results", "limits"):
        assert any(t.startswith(f"docs/{page}.md") for t in docs), page  # every page linked


@pytest.mark.parametrize("name", ["README.md", "docs/usage.md", "docs/api.md",
                                  "docs/architecture.md", "docs/limits.md"])
def test_flags_and_metrics_named_exist(name: str) -> None:
    text = (ROOT / name).read_text(encoding="utf-8")
    assert not unknown_flags(text, server_flags()), unknown_flags(text, server_flags())
    assert not unknown_metrics(text, exported_metrics()), unknown_metrics(text, exported_metrics())


def test_the_checks_see_the_pages() -> None:
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    assert len(set(FLAG.findall(usage))) >= 20
    assert len(METRIC.findall(usage)) >= 3
    assert sum(len(LINK.findall(p.read_text(encoding="utf-8"))) for p in PAGES) >= 100
