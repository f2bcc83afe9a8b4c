"""The project stands alone: every Markdown document the code or docs point to is in the repo."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"report.md"}  # written by a run (FitReport), not a document of the repo
# written by benchmarks/gpu_check_report.py from a GPU run (the repo has it once one ran)
GENERATED |= {"gpu.md"}
# written by benchmarks/agentic_report.py from benchmarks/results/agentic.json (likewise)
GENERATED |= {"agentic_benchmark.md"}
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


HASH = re.compile(r"\b[0-9a-f]{7,40}\b")


def _commit_hashes(text: str) -> list[str]:
    """Word-bounded tokens of 7 to 40 hex characters with at least one digit and one letter
    a-f: what a commit hash looks like (a long decimal number or a word like ``defaced`` is
    not one)."""
    return [
        token
        for token in HASH.findall(text)
        if re.search(r"[0-9]", token) and re.search(r"[a-f]", token)
    ]


def test_no_commit_hash_in_readme_or_guide():
    """The front page and the user guide describe the library, not its history: no commit
    hashes (a measured number names the command that produced it instead)."""
    found = []
    for name in ("README.md", "docs/guide.md"):
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            found += [f"{name}:{number}: {token}" for token in _commit_hashes(line)]
    assert not found, "commit hashes in the user-facing docs:\n" + "\n".join(found)


def test_commit_hash_pattern():
    text = "at commit f47758a, 1029222 faults, node 3f2a9c1e, decade, c297b4c26be2cd7f"
    assert _commit_hashes(text) == ["f47758a", "3f2a9c1e", "c297b4c26be2cd7f"]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, (
        f"README.md has {len(lines)} lines; at most 150 (move details to docs/)"
    )


def _block(text: str, language: str) -> str:
    """The first fenced code block of ``language`` in ``text``."""
    match = re.search(rf"^```{language}\n(.*?)^```", text, re.S | re.M)
    assert match, f"README.md has no ```{language} block"
    return match.group(1)


def _replace(code: str, old: str, new: str) -> str:
    """``code`` with ``old`` (which must occur exactly once) replaced by ``new``."""
    assert code.count(old) == 1, (
        f"README.md's example no longer contains {old!r} exactly once: update this test"
    )
    return code.replace(old, new)


def test_readme_example_runs(tiny_llama_path, tmp_path, monkeypatch):
    """The README's minimal example, as printed, trains on data in the format the README shows:
    only the model (a tiny one, 8 new tokens), the engine (the in-process HF engine, no Ray),
    the number of steps and the data file's path are substituted."""
    import json

    readme = (ROOT / "README.md").read_text()
    shown = [json.loads(line) for line in _block(readme, "json").splitlines() if line.strip()]
    assert shown and all(isinstance(row.get("prompt"), str) for row in shown), shown
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:  # 20 distinct prompts with the README's columns (2 held out)
        for i in range(20):
            row = shown[i % len(shown)]
            f.write(json.dumps({**row, "prompt": f"{row['prompt']} ({i})"}) + "\n")

    code = _block(readme, "python")
    code = _replace(  # and a short completion budget: the default 256 tokens take minutes
        code, 'model="smollm2-135m-instruct"', f"model={tiny_llama_path!r}, max_new_tokens=8"
    )
    code = _replace(
        code,
        'PeriodicAsyncStrategy(engine="vllm")',
        'PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)',
    )
    code = _replace(code, "max_steps=20", "max_steps=1")
    code = _replace(code, 'PromptDataModule("data.jsonl")', f"PromptDataModule({str(data)!r})")
    monkeypatch.chdir(tmp_path)  # Lightning's logs and checkpoints
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 1
    assert trainer.lightning_module.eval_history, "no held-out evaluation ran"
