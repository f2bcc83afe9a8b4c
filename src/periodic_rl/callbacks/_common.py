"""What the callbacks share: where to write, how to write without leaving half a file behind.

Every artefact is written to a temporary name in its destination folder and moved into place
with ``os.replace``, so a reader (a person, TensorBoard, vLLM, a crashed run's post-mortem)
sees either the old artefact or the new one, never a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from periodic_rl.iteration import IterationStats
from periodic_rl.rollout.timing import SpanRecorder


@runtime_checkable
class RunRecords(Protocol):
    """What the callbacks read of the LightningModule (``RLModule`` has both): the record of the
    iteration that just ended and every held-out evaluation so far."""

    last_iteration: IterationStats | None

    @property
    def eval_history(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class RecordsSpans(Protocol):
    """A strategy that records where an iteration's time goes (the periodic-async ones)."""

    @property
    def spans(self) -> SpanRecorder: ...


def last_iteration(module: Any) -> IterationStats | None:
    """The record of the iteration that just ended (None from a module that keeps none)."""
    return module.last_iteration if isinstance(module, RunRecords) else None


def eval_history(module: Any) -> list[dict[str, Any]]:
    """Every held-out evaluation of the run so far (empty from a module that keeps none)."""
    return list(module.eval_history) if isinstance(module, RunRecords) else []


def run_dir(trainer: Any) -> Path:
    """The run's log folder: the first logger's ``log_dir``, else ``default_root_dir``."""
    log_dir = trainer.log_dir
    return Path(log_dir if log_dir is not None else trainer.default_root_dir)


def finished_iteration(trainer: Any) -> int:
    """The 0-based number of the iteration that just ended, in ``on_train_batch_end``.

    It is the policy version the iteration trained from (the number the strategy's
    :class:`SpanRecorder` tags spans with): with one optimizer step per iteration, the trainer's
    ``global_step`` has already counted it; with ``num_iterations`` steps, the module says.
    """
    stats = last_iteration(trainer.lightning_module)
    return stats.policy_version if stats is not None else trainer.global_step - 1


def span_recorder(trainer: Any) -> SpanRecorder | None:
    """The strategy's timing spans, or None when the strategy records none."""
    strategy = trainer.strategy
    return strategy.spans if isinstance(strategy, RecordsSpans) else None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plain_permissions(path: Path) -> None:
    """Give ``path`` (and, for a folder, everything in it) the permissions a plain ``open`` or
    ``mkdir`` would: temp-file helpers and some writers (safetensors) make files owner-only,
    which would hide an exported model from a server running as another user."""
    mask = _umask()
    if path.is_file():
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        yield Path(tmp)
        _plain_permissions(Path(tmp))  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, value: Any) -> Path:
    """Write ``value`` as JSON to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(value))
    return path


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``target``; on success it becomes ``target``.

    An existing ``target`` is first renamed aside (a folder cannot be replaced while it has
    files), so ``target`` is always either absent, the old one or the complete new one.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        _plain_permissions(tmp)  # mkdtemp makes it owner-only
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
