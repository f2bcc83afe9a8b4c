"""Checkpoints that are written atomically and load with ``weights_only=True``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``path`` through a temporary file in the same directory, then renames it.

    A crash or Ctrl-C mid-write leaves the previous checkpoint (and ``last.ckpt``) intact: the
    rename is atomic on POSIX file systems, so a reader sees the old file or the new one.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(temporary, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        kwargs = {} if map_location is None else {"map_location": map_location}
        return super().load_checkpoint(path, weights_only=True, **kwargs)
