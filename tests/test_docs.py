"""The project stands alone: every Markdown document the code or docs point to is in the repo."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"report.md"}  # written by a run (FitReport), not a document of the repo
REFERENCE = re.compile(r"[\w./-]*\w\.md\b")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_every_referenced_markdown_document_exists():
    names = {p.name for p in _tracked("*.md")}
    sources = _tracked("src", "docs", "examples", "benchmarks/*.py", "benchmarks/*.sh", "tests")
    sources += [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    missing = []
    for path in sources:
        if path.suffix not in {".py", ".md", ".yaml", ".sh", ".toml", ""} or not path.is_file():
            continue
        for ref in REFERENCE.findall(path.read_text(errors="replace")):
            name = Path(ref).name
            if name not in names and name not in GENERATED:
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not missing, "references to documents that are not in the repository:\n" + "\n".join(
        missing
    )


def test_bad_input_table_names_tests_that_exist():
    """Every test the troubleshooting guide's "Bad input" tables cite is a test function of the
    file it names (the table stays honest when tests move), and there are at least 25 rows."""
    import ast

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = text[text.index("## Bad input") :]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`tests/" in line]
    assert len(rows) >= 25, f"{len(rows)} tested rows in the Bad input tables"
    missing = []
    for row in rows:
        cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.rsplit("|", 2)[-2])
        assert cited, f"a row without a test id in its last column: {row[:80]}"
        for path, name in cited:
            file = ROOT / path
            tree = ast.parse(file.read_text()) if file.is_file() else ast.Module(body=[])
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            if name not in names:
                missing.append(f"{path}::{name}")
    assert not missing, "tests cited in docs/troubleshooting.md that do not exist:\n" + "\n".join(
        missing
    )
