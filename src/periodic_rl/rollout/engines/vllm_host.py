"""What an in-process vLLM does to the process that starts it, and what undoes it.

``CPUWorker`` replaces ``torch.set_num_threads`` by a no-op and vLLM re-seeds the global RNGs at
start (:func:`host_state_preserved` restores both). vLLM also freezes the GC heap
(``gc.freeze``) until shutdown, caches its environment variables after the first start (the
engine clears that cache before each start), and patches a few ``torch.cuda`` /
``Tensor.pin_memory`` attributes with CPU no-ops (harmless on a CPU host). Its decode uses the
host's ``torch.get_num_threads()``. The multiprocess engine leaves ``/dev/shm`` files behind
(:class:`ShmFiles` removes those this process tree created).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from periodic_rl.rollout.processes import LEFTOVER_SHM_PREFIXES, descendants, shm_files

SHM = Path("/dev/shm")


def _set_environ(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextmanager
def environ(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for ``None``, remove) environment variables, restoring them afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(saved)


@contextmanager
def host_state_preserved() -> Iterator[None]:
    """Undo what an in-process vLLM start does to the host: it disables
    ``torch.set_num_threads`` for good and re-seeds the global RNGs."""
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    torch_rng = torch.get_rng_state()
    python_rng = random.getstate()
    try:
        import numpy

        numpy_rng: Any = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch here
        numpy, numpy_rng = None, None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_rng)
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)


def _entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


class ShmFiles:
    """The vLLM ``/dev/shm`` files (``psm_*``, ``sem.mp-*``) an engine's start created, to
    remove at its shutdown.

    A new name alone is not proof of ownership: other processes on the machine may create
    segments meanwhile. A new file mapped or held open by this process or its descendants is
    ours (:meth:`note`, called while the engine's processes are alive).
    """

    def __init__(self) -> None:
        self.before = _entries()
        self.ours: set[str] = set()

    def note(self) -> None:
        """Add the new vLLM files that this process tree holds now."""
        new = {n for n in _entries() - self.before if n.startswith(LEFTOVER_SHM_PREFIXES)}
        tree = [os.getpid(), *(pid for pid, _ in descendants(os.getpid()))]
        self.ours |= new & {os.path.basename(path) for path in shm_files(tree)}

    def remove(self) -> None:
        """Delete every file noted (those already gone are skipped)."""
        for name in sorted(self.ours):
            (SHM / name).unlink(missing_ok=True)
        self.ours.clear()
