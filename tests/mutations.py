"""Mutation checks: each promise of the library, broken on purpose, must fail a test.

``make mutations`` (or ``.venv/bin/python tests/mutations.py [NAME ...]``) runs, for each row of
:data:`MUTATIONS`: copy the repository's ``src/``, ``tests/``, ``examples/``, ``pyproject.toml``,
the ``Makefile`` and the benchmark modules the tests import (:data:`COPIED`) to a
temporary directory, apply one exact text replacement to one file (the
original text must occur exactly once, so a refactor cannot silently disable a mutation), and
run only the tests that should catch it, with ``PYTHONPATH`` pointing at the copy's ``src`` (the
child checks that ``periodic_rl`` is imported from there, not from the editable install, and so
do the Ray workers, which import from the same directory). A mutation is *caught* when those
tests fail. Before the mutations, the same tests run once on an unmutated copy and must pass,
else a "caught" would mean nothing. Exit status 0 only if every mutation was caught.

Not collected by pytest (no ``test_`` prefix). The rows live in ``tests/mutation_rows/``, one
module per part of the library; to add a mutation, append a ``Mutation`` to the module of the file
it breaks: ``old`` is copied verbatim from the file (whitespace included), ``tests`` are pytest
node ids relative to the repository root.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutation_rows import MUTATIONS, Mutation  # tests/ is on the path: this script's folder

ROOT = Path(__file__).resolve().parents[1]
COPIED = [
    "src",
    "tests",
    "examples",
    "pyproject.toml",
    "Makefile",  # tests/test_dependencies.py reads the extras it installs
    "benchmarks/soak_run.py",  # the soak test imports it, and its helpers
    "benchmarks/common.py",
    "benchmarks/child_runs.py",
    "benchmarks/vs_trl_report.py",  # the benchmark's verdicts, and what they import
    "benchmarks/vs_trl_runs.py",
    "benchmarks/vs_trl.py",  # the order of the runs
    "benchmarks/benchmarks_doc.py",  # the page's reading of the runs, and its text
    "benchmarks/benchmarks_doc_text.py",
    "benchmarks/gpu_check*.py",  # the GPU check, its parts and its page (tests/test_gpu_check.py)
    "benchmarks/gpu_wheels.py",
]
TIMEOUT_S = 1200


def copy_tree(destination: Path) -> None:
    """The files under :data:`COPIED` that git tracks or would add (new files not yet committed,
    ignored ones left out), as they are in the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *COPIED],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # tracked but deleted in the working tree: skip
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def mutated(mutation: Mutation, text: str) -> str:
    """``text`` with the mutation applied; refuses unless ``old`` occurs exactly once."""
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(
            f"mutation {mutation.name!r}: the original text occurs {count} times in "
            f"{mutation.file} (expected once); update the row in tests/mutations.py"
        )
    return text.replace(mutation.old, mutation.new)


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.file
    path.write_text(mutated(mutation, path.read_text()))


def child_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree / "src")
    env.pop("RAY_ADDRESS", None)
    return env


def check_import(tree: Path) -> None:
    """The child must import the copy's ``periodic_rl``, not the editable install's."""
    found = subprocess.run(
        [sys.executable, "-c", "import periodic_rl; print(periodic_rl.__file__)"],
        cwd=tree,
        env=child_env(tree),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to((tree / "src").resolve()):
        raise SystemExit(f"the child imports periodic_rl from {found}, not from {tree / 'src'}")


def run_tests(tree: Path, tests: tuple[str, ...], stop_early: bool) -> tuple[str, float, str]:
    """Run ``tests`` in ``tree``; returns (outcome, seconds, output tail). Outcomes: ``passed``,
    ``failed`` (a test failed, or collection failed), ``error`` (no such test, usage error),
    ``timeout``."""
    missing = [t for t in tests if not (tree / t.split("::")[0]).exists()]
    if missing:
        return "error", 0.0, f"no such test file: {', '.join(missing)}"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests]
    if stop_early:
        command.insert(4, "-x")
    began = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=child_env(tree),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - began, ""
    seconds = time.monotonic() - began
    lines = (done.stdout + done.stderr).strip().splitlines()
    errors = [  # why the tests failed
        line for line in lines if line.startswith("E ") and re.search(r"Error|assert|Failed", line)
    ][:4]
    tail = "\n".join(errors + lines[-8:])
    outcome = {0: "passed", 1: "failed", 2: "failed"}.get(done.returncode, "error")
    return outcome, seconds, tail


def fresh_tree() -> Path:
    tree = Path(tempfile.mkdtemp(prefix="periodic-rl-mutation-"))
    copy_tree(tree)
    check_import(tree)
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only mutations whose name contains these")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--verbose", action="store_true", help="show how each one was caught")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(n in m.name for n in args.names)]
    if args.list or not chosen:
        for mutation in MUTATIONS:
            print(f"{mutation.name}: {mutation.file} -> {', '.join(mutation.tests)}")
        return 0 if chosen else 2
    for mutation in chosen:  # every row still applies to today's sources, before anything runs
        mutated(mutation, (ROOT / mutation.file).read_text())

    if not args.no_baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        tree = fresh_tree()
        try:
            present = tuple(t for t in tests if (tree / t.split("::")[0]).exists())
            outcome, seconds, tail = run_tests(tree, present, stop_early=False)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        print(
            f"baseline (unmutated, {len(present)} test ids): {outcome} in {seconds:.0f} s",
            flush=True,
        )
        if outcome != "passed":
            print(tail)
            print("the tests fail without any mutation: fix them first")
            return 1

    rows = []
    for mutation in chosen:
        tree = fresh_tree()
        try:
            apply(mutation, tree)
            outcome, seconds, tail = run_tests(tree, mutation.tests, stop_early=True)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        verdict = {"failed": "caught"}.get(outcome, f"NOT caught ({outcome})")
        rows.append((mutation.name, verdict, seconds))
        print(f"{verdict:<24} {seconds:6.0f} s  {mutation.name}", flush=True)
        if outcome != "failed" or args.verbose:
            print("  " + tail.replace("\n", "\n  "), flush=True)

    width = max(len(name) for name, _, _ in rows)
    print(f"\n| {'mutation':<{width}} | {'result':<24} | {'seconds':>7} |")
    print(f"|{'-' * (width + 2)}|{'-' * 26}|{'-' * 9}|")
    for name, verdict, seconds in rows:
        print(f"| {name:<{width}} | {verdict:<24} | {seconds:7.0f} |")
    survivors = sum(not verdict.startswith("caught") for _, verdict, _ in rows)
    print(f"\n{len(rows) - survivors} of {len(rows)} mutations caught")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
