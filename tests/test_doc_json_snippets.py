"""Every JSON snippet in README.md, BENCHMARKS.md and examples/ is a document vLLM's flags read:
JSON, once vLLM's expansion of bare sizes (`8G`) has run; it pastes into vLLM and into kvtool."""

import json
import re
from pathlib import Path

from kvtool.engine.config.sizes import expand_json_human_readable_numbers
from tests.conftest import REPO

DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "examples").rglob("*.md"))]
# A shell-quoted document ('{...}' or 'NAME={...}'), or an inline code span holding an object.
_QUOTED = re.compile(r"'(?:[\w-]+=)?(\{.*?\})'", re.S)
_INLINE = re.compile(r"`(\{\".*?\})`")


def snippets(path: Path) -> list[str]:
    text = path.read_text()
    found = _QUOTED.findall(text) + _INLINE.findall(text)
    for block in re.findall(r"```json\n(.*?)```", text, re.S):
        found.append(block)
    return found


def test_docs_hold_json_snippets():
    assert sum(len(snippets(p)) for p in DOCS) >= 4


def test_every_json_snippet_in_the_docs_parses():
    bad = []
    for path in DOCS:
        for snippet in snippets(path):
            try:
                json.loads(expand_json_human_readable_numbers(snippet))
            except json.JSONDecodeError as e:
                bad.append(f"{path.relative_to(REPO)}: {snippet[:80]!r}: {e}")
    assert not bad, "\n".join(bad)


def test_every_example_jsonl_line_parses():
    for path in sorted((REPO / "examples").rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                json.loads(line)
