"""The README stays an introduction: short, its first command near the top, every line fitting a terminal, and its
links to docs/ pointing at pages that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 triton==3.6.0 -e "
                "'.[test,cuda]' && python -m pytest -q")


def test_the_readme_is_short_and_starts_with_a_command():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    first_command = next(i for i, line in enumerate(lines) if line.startswith("```bash"))
    assert first_command < 40
    assert TEST_COMMAND in lines  # CI runs exactly this line


def test_every_doc_line_fits_120_columns():
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    long = [(p.name, i + 1) for p in pages for i, line in enumerate(p.read_text(encoding="utf-8").splitlines())
            if len(line) > 120 and line != TEST_COMMAND]
    assert not long, long


def test_the_readmes_links_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#:]+)\)", text)
    assert targets and all((ROOT / t).exists() for t in targets), [t for t in targets if not (ROOT / t).exists()]
