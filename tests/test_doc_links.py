"""Every relative link in the docs (README.md, BENCHMARKS.md, docs/, examples/) names a file the
repository has, and a link to a heading of a Markdown file names a heading that file has."""

import re
from pathlib import Path

from tests.conftest import REPO

DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md")),
        *sorted((REPO / "examples").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(path: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", path.read_text()))


def test_the_docs_hold_relative_links():
    assert sum(1 for p in DOCS for t in links(p) if not re.match(r"[a-z]+:", t)) >= 10


def test_every_relative_link_resolves():
    bad = []
    for path in DOCS:
        for target in links(path):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(REPO)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{path.relative_to(REPO)}: {target}: no such heading")
    assert not bad, "\n".join(bad)
