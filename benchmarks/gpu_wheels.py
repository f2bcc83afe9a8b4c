"""Prepare the GPU check for the lent machine: the wheels it lacks, their size, the command.

The lent GPU machine (Python 3.12, torch 2.11, transformers 5.17, lightning, peft, ...; no
network, no Ray, no vLLM) receives the checkout plus the ignored folders named in the run's
``carry``, at most 64 MiB in all, and a command line under 2,000 characters. This downloads
into ``.gpu_wheels/`` the pure-Python wheels for CPython 3.12 that ``import periodic_rl`` and a
fit with in-process rollouts need and the machine lacks or has too old (the versions of this
checkout's ``.venv``, which the suite tests), checks that what the installed transformers
requires of the compiled packages is met by the machine's versions (compiled wheels do not
travel), prints the size and fails when the checkout and the wheels reach 64 MiB, and prints the
command to run there (``make gpu-check`` runs the same on any CUDA machine).

    make gpu-wheels          # or: .venv/bin/python benchmarks/gpu_wheels.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".gpu_wheels"
LIMIT_MIB = 64
COMMAND_LIMIT = 2000
PYTHON_VERSION = "3.12"
#: What travels, with the platform of its wheel (None: pure Python): transformers at the version
#: the code needs (the machine has 5.17), regex (compiled, small; transformers checks its
#: version at import and the machine's is unknown), peft (imported by every weight push; the
#: release the suite runs with this transformers), pebble (the reward pool, on the fit path),
#: jsonargparse (the CLI).
CARRIED = {
    "transformers": None,
    "regex": "manylinux2014_x86_64",
    "peft": None,
    "pebble": None,
    "jsonargparse": None,
}
#: The machine's versions of what transformers needs that cannot travel as pure wheels
#: (the lent machine's package list, as a session saw it).
MACHINE = {"huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0"}
REMOTE_PYTHON = "/opt/torch/.venv/bin/python"


def pinned(name: str) -> str:
    """``name==<the version installed here>``: the release the suite runs."""
    return f"{name}=={importlib.metadata.version(name)}"


def unmet_on_machine(name: str) -> list[str]:
    """What ``name`` (installed here) requires of :data:`MACHINE` that the machine's versions
    do not satisfy."""
    problems = []
    for line in importlib.metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        have = MACHINE.get(req.name.lower().replace("_", "-"))
        if have is not None and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{name} needs {req}, the machine has {have}")
    return problems


def fetch(spec: str, platform: str | None) -> None:
    """A wheel of ``spec`` for CPython 3.12 (on ``platform``) into :data:`WHEELS`: the published
    one, or built here for a pure-Python package published as source only."""
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    where = ["--platform", platform] if platform else []
    downloaded = subprocess.run(
        [*pip, "download", "--no-deps", "--only-binary", ":all:", "--python-version"]
        + [PYTHON_VERSION, *where, "--dest", str(WHEELS), spec],
        check=False,
    )
    if downloaded.returncode != 0 and platform is None:
        print(f"{spec}: no wheel for Python {PYTHON_VERSION} published; building one here")
        subprocess.run([*pip, "wheel", "--no-deps", "-w", str(WHEELS), spec], check=True)
    elif downloaded.returncode != 0:
        raise SystemExit(f"{spec}: no wheel for CPython {PYTHON_VERSION} on {platform}")


def tree_bytes() -> int:
    """Bytes of what the run copies besides the carried folders: tracked and untracked,
    not ignored files."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return sum((REPO / f).stat().st_size for f in files if f and (REPO / f).is_file())


def commit() -> str:
    """The checkout's commit, ``-dirty`` when it has uncommitted changes."""
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, check=False).returncode
    return head + ("-dirty" if dirty else "")


def command(wheels: list[Path], python: str = REMOTE_PYTHON, out: str = "$OUT") -> str:
    """The command line for the lent machine, run in the checkout's root."""
    rel = " ".join(str(w.relative_to(REPO)) for w in wheels)
    return (
        f"{python} -m pip install -q --no-index --no-deps {rel} && "
        f"{python} benchmarks/gpu_check.py --out {out} --commit {commit()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=REMOTE_PYTHON, help="the machine's Python")
    args = parser.parse_args(argv)
    problems = unmet_on_machine("transformers")
    if problems:
        print("the lent machine cannot run this transformers:\n  " + "\n  ".join(problems))
        return 1
    WHEELS.mkdir(exist_ok=True)
    specs = {pinned(name): platform for name, platform in CARRIED.items()}
    for stale in WHEELS.glob("*.whl"):  # wheels of other versions would install as well
        if not any(stale.name.lower().startswith(s.replace("==", "-").lower()) for s in specs):
            stale.unlink()
    for spec, platform in specs.items():
        fetch(spec, platform)
    wheels = sorted(WHEELS.glob("*.whl"))
    carried = sum(w.stat().st_size for w in wheels)
    total = carried + tree_bytes()
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(
        f"wheels: {carried / 2**20:.2f} MiB; with the checkout: {total / 2**20:.2f} MiB "
        f"(limit {LIMIT_MIB} MiB)"
    )
    if total >= LIMIT_MIB * 2**20:
        print(f"too large: the checkout and {WHEELS.name}/ must stay under {LIMIT_MIB} MiB")
        return 1
    line = command(wheels, args.python)
    if len(line) >= COMMAND_LIMIT:
        print(f"the command is {len(line)} characters, the limit is {COMMAND_LIMIT}")
        return 1
    print(f"carry: {WHEELS.name}")
    print(f"command ({len(line)} characters), run in the checkout's root there:\n{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
