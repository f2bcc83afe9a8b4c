"""Checkpoints that are written atomically and load with ``weights_only=True``."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class CheckpointDiskFullError(OSError):
    """No space (or quota) left while writing a checkpoint; the previous one is untouched."""


class _RecordingWriter:
    """A file's ``write`` and ``flush`` that remember the ``OSError`` either raised: torch.save's
    zip writer reports a failed write as ``RuntimeError: ... unexpected pos``, without the
    errno (measured with torch 2.x on a full tmpfs)."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        try:
            self.handle.flush()
        except OSError as error:
            self.error = error
            raise


def _disk_full(target: Path) -> str:
    try:
        usage = shutil.disk_usage(target.parent)
        space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
    except OSError:
        space = "free space unknown"
    return (
        f"no space left to write checkpoint {target} ({space} on its file system); the "
        "previous checkpoints there are untouched (this one was written to a temporary file, "
        "now removed). Free space there, or point the checkpoints elsewhere "
        "(ModelCheckpoint(dirpath=...); trainer.callbacks in YAML), then resume with "
        "--ckpt_path last"
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``path`` through a temporary file in the same directory, then renames it.

    A crash or Ctrl-C mid-write leaves the previous checkpoint (and ``last.ckpt``) intact: the
    rename is atomic on POSIX file systems, so a reader sees the old file or the new one.
    A full disk (or quota) is the same: the partial temporary file is removed, and the error
    (:class:`CheckpointDiskFullError`) names the path, the space left and what to do.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        writer = _RecordingWriter()
        try:
            with open(temporary, "wb") as handle:
                writer.handle = handle
                torch.save(checkpoint, writer)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except Exception as error:
            full = [
                e
                for e in (error, writer.error)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
            ]
            if not full:
                raise
            temporary.unlink(missing_ok=True)  # first: the space it took is free again
            raise CheckpointDiskFullError(full[0].errno, _disk_full(target)) from error
        finally:
            temporary.unlink(missing_ok=True)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        kwargs = {} if map_location is None else {"map_location": map_location}
        return super().load_checkpoint(path, weights_only=True, **kwargs)
