"""The documentation stays navigable: a short README, links that resolve, no orphan page, one home per fact.

Plain text checks over README.md and docs/**/*.md; no torch needed.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
MIN_SHARED_PARAGRAPH = 200  # characters: a paragraph this long lives in one file only

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\n]|\][^(])*?\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text with fenced code blocks removed and inline code blanked (links inside code are not links)."""
    return INLINE_CODE.sub("`x`", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except '-' and '_', spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 ... suffixes for repeated headings."""
    seen: dict[str, int] = defaultdict(int)
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def relative_links(path: Path) -> list[tuple[str, Path, str]]:
    """(the link as written, the file it names, its anchor or '') for every relative link and image."""
    out = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        out.append((target, dest, anchor))
    return out


def paragraphs(path: Path) -> list[str]:
    """Blocks of text between blank lines, whitespace collapsed."""
    blocks = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
    return [" ".join(b.split()) for b in blocks if b.strip()]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target, dest, anchor in relative_links(path):
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_doc_is_reachable_from_readme():
    reached, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached or not page.exists():
            continue
        reached.add(page)
        todo += [dest for _, dest, _ in relative_links(page) if dest.suffix == ".md"]
    orphans = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p.resolve() not in reached]
    assert not orphans, f"pages no link from README.md leads to: {orphans}"


def test_benchmark_history_is_split_by_run():
    assert not (DOCS / "bench_vs_hf.md").exists(), "each benchmark run has its own file under docs/bench/"
    assert list((DOCS / "bench").glob("*.md")), "docs/bench/ holds the dated benchmark runs"


def test_no_paragraph_is_stated_twice():
    homes: dict[str, set[str]] = defaultdict(set)
    for path in markdown_files():
        for para in paragraphs(path):
            if len(para) >= MIN_SHARED_PARAGRAPH:
                homes[para].add(str(path.relative_to(ROOT)))
    repeated = {p[:120] + "...": sorted(files) for p, files in homes.items() if len(files) > 1}
    assert not repeated, f"paragraphs stated in more than one file (link to one home instead): {repeated}"


def test_slug_follows_github():
    assert slug("Launchers: beyond one process") == "launchers-beyond-one-process"
    assert slug("`draft=suffix` and the cache") == "draftsuffix-and-the-cache"
    assert slug("Where the time goes (best run of each method)") == "where-the-time-goes-best-run-of-each-method"
    assert slug("snake_case and kebab-case") == "snake_case-and-kebab-case"
