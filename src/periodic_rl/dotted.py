"""Objects named in configs by a dotted path: ``package.module:name`` or ``package.module.name``."""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(path: str) -> Any:
    """The object ``path`` names; raises what the import or the lookup raises (``ImportError``,
    ``AttributeError``, ``ValueError`` for an empty module name), for the caller to explain."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)
