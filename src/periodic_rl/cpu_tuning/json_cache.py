"""A JSON file of cache entries keyed by JSON objects: read leniently, written atomically.

The measured choices the library remembers between runs (the engine dtype's decode rates, the
hardware split) keep one entry per key in such a file. A file that is missing or unreadable
reads as empty (an unreadable one with a warning naming it): a cache never stops a run. A write
goes to a temporary file in the same folder, flushed to disk, then renamed over the cache, so
a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def entry_name(key: dict[str, Any]) -> str:
    """The entry's name in the file: ``key`` as canonical JSON."""
    return json.dumps(key, sort_keys=True)


def read_entries(path: Path, what: str) -> dict[str, Any]:
    """The file's entries; ``{}`` for no file, and (with a warning naming ``what`` and the
    file) for one that is not a JSON object."""
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
        entries = error
    if not isinstance(entries, dict):
        log.warning("%s cache %s is unreadable (%s); ignoring it", what, path, entries)
        return {}
    return entries


def read_entry(path: Path, key: dict[str, Any], what: str) -> Any:
    """``key``'s entry, or None."""
    return read_entries(path, what).get(entry_name(key))


def write_entry(path: Path, key: dict[str, Any], entry: dict[str, Any], what: str) -> None:
    """Add (or replace) ``key``'s entry, keeping the others (an unreadable file is replaced)."""
    entries = read_entries(path, what)
    entries[entry_name(key)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(entries, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
