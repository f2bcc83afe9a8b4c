"""The package's architecture, enforced: no import cycle inside ``periodic_rl``, the import
contracts of ``pyproject.toml`` (``lint-imports``), and the CPU tuner imported only where a run
trains on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def import_cycles(package: str) -> list[list[str]]:
    """Every set of modules of ``package`` that import each other in a circle (Tarjan's strongly
    connected components of the import graph, function-level and type-only imports included)."""
    graph = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycle_inside_the_package():
    assert import_cycles("periodic_rl") == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules importing each other (one of them only for type
    checking, which counts) are found."""
    package = tmp_path / "cyclic_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic_pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclic_pkg import a\n"
    )
    (package / "c.py").write_text("from cyclic_pkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cyclic_pkg") == [["cyclic_pkg.a", "cyclic_pkg.b"]]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _imported_after(code: str) -> list[str]:
    """The ``periodic_rl.cpu_tuning`` modules a fresh interpreter has imported after ``code``."""
    probe = (
        f"{code}\nimport sys\n"
        "print(sorted(m for m in sys.modules if m.startswith('periodic_rl.cpu_tuning')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return eval(done.stdout.strip().splitlines()[-1])  # a printed list of names


def test_a_cuda_run_imports_no_cpu_tuning_module():
    """The whole training stack imported and a strategy on a (mocked) CUDA device choosing its
    tuner: nothing of the CPU tuner is imported; on the CPU the same choice imports it."""
    code = (
        "import torch\n"
        "import periodic_rl.cli, periodic_rl.module, periodic_rl.strategies.distributed\n"
        "from periodic_rl import PeriodicAsyncStrategy\n"
        "strategy = PeriodicAsyncStrategy(engine='hf', device='{device}')\n"
        "tuning = strategy.choose_tuning()\n"
        "assert type(tuning).__name__ == '{expected}', type(tuning)\n"
    )
    assert _imported_after(code.format(device="cuda:0", expected="HardwareTuning")) == []
    on_cpu = _imported_after(code.format(device="cpu", expected="CPUTuning"))
    assert "periodic_rl.cpu_tuning.plugin" in on_cpu
