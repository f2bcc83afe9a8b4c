"""Checkpoints that are written atomically and load with ``weights_only=True``."""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import os
import shutil
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

log = logging.getLogger(__name__)


class CheckpointDiskFullError(OSError):
    """No space (or quota) left while writing a checkpoint; the previous one is untouched."""


class _RecordingWriter:
    """A file's ``write`` and ``flush`` that remember the ``OSError`` either raised: torch.save's
    zip writer reports a failed write as ``RuntimeError: ... unexpected pos``, without the
    errno (torch 2.x)."""

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


def _drop_cached(fd: int) -> None:
    """Drop the written (and fsynced, so clean) file's pages from the page cache: a checkpoint
    is not read back soon, and the next one then reuses those pages instead of claiming as
    much fresh memory again (several GB per save with a full optimizer state)."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no posix_fadvise
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


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
                _drop_cached(handle.fileno())
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


class CheckpointWriteError(RuntimeError):
    """A checkpoint written in the background failed; the file it names was not (re)placed."""


class _Changed(Exception):
    """A tensor differs from the pending snapshot's copy: the snapshot cannot be shared."""


_Key = tuple[int, str, int]
_SMALL_NEW_BYTES = 1 << 20  # a new storage up to this size does not stop snapshot sharing
_COMPARE_CHUNK = 64 * 2**20  # bytes of a non-CPU storage brought over at a time to compare


def _key(storage: torch.UntypedStorage) -> _Key:
    return storage.data_ptr(), str(storage.device), storage.nbytes()


def _words(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a flat tensor of 8-byte words (bytes when the size is odd):
    wider elements compare several times faster."""
    dtype = torch.int64 if storage.nbytes() % 8 == 0 else torch.uint8
    count = storage.nbytes() // dtype.itemsize
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (count,), (1,))


def _same_bytes(source: torch.UntypedStorage, copy: torch.UntypedStorage) -> bool:
    if source.nbytes() != copy.nbytes():
        return False
    a, b = _words(source), _words(copy)
    if source.device.type == "cpu":
        return torch.equal(a, b)
    chunk = _COMPARE_CHUNK // a.element_size()
    return all(
        torch.equal(a[i : i + chunk].cpu(), b[i : i + chunk]) for i in range(0, a.numel(), chunk)
    )


class _Snapshot:
    """A copy of a checkpoint whose tensors live in host memory that training no longer touches.

    Containers are rebuilt, other values deep-copied, and every tensor storage copied once:
    tensors that share a storage (tied weights, views) share the copy, as ``torch.save`` would
    have stored them. ``provide(storage)`` gives the copy of a source storage: a fresh one
    (from the buffers of the previous snapshot when sizes match) or, for a second save of the
    same state, the pending snapshot's own (:class:`_Changed` when the bytes differ)."""

    def __init__(self, provide: Any, source: _Snapshot | None = None) -> None:
        self.provide, self.source = provide, source
        self.copies: dict[_Key, torch.UntypedStorage] = {}
        self.written: str | None = None  # the file holding these bytes, once written
        self.data: Any = None  # the copied checkpoint

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, dict):
            out = copy.copy(value)  # keeps the type and attributes (a state dict's _metadata)
            for key, item in value.items():
                out[key] = self(item)
            return out
        if isinstance(value, list):
            return type(value)(self(item) for item in value)
        if isinstance(value, tuple):
            items = [self(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
        if (
            not plain
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or (tensor.is_conj() or tensor.is_neg() or tensor.device.type == "meta")
        ):
            if self.source is not None:  # not among the pending snapshot's storages
                raise _Changed
            return tensor.detach().to("cpu", copy=True)
        storage = tensor.untyped_storage()
        key = _key(storage)
        copied = self.copies.get(key)
        if copied is None:
            copied = self.copies[key] = self.provide(storage)
        out = torch.empty(0, dtype=tensor.dtype).set_(
            copied, tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
        return out


def _same_value(a: Any, b: Any) -> bool:
    """Whether two copied checkpoints would load as the same values (then one file can serve
    both): same containers, keys in the same order, equal plain values, equal tensors (a
    storage they share counts as equal without reading it)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or a.requires_grad != b.requires_grad:
            return False
        if (_key(a.untyped_storage()), a.storage_offset(), a.stride()) == (
            _key(b.untyped_storage()),
            b.storage_offset(),
            b.stride(),
        ):
            return True
        return torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot say: not the same
        return False


def _link_atomically(source: str, target: str) -> bool:
    """Make ``target`` a hard link to the finished file ``source`` (a temporary link renamed
    over ``target``); ``False`` when ``source`` is gone or links are not possible there."""
    temporary = f"{target}.{os.getpid()}.{threading.get_native_id()}.link"
    try:
        os.link(source, temporary)
    except OSError:
        return False
    try:
        os.replace(temporary, target)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return True


def _background_priority() -> None:
    """This thread at the lowest CPU priority (nice 19), allowed on every core: it takes only
    the CPU time that training and the rollout workers leave, on whichever core has some (it
    would otherwise inherit the training process's pinning, ``trainer_cores``)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # 0: this thread (Linux)


class AsyncAtomicCheckpointIO(AtomicCheckpointIO):
    """:class:`AtomicCheckpointIO` off the training loop's critical path.

    ``save_checkpoint`` copies what the checkpoint holds into host memory (every tensor storage,
    synchronously: a memory copy, far cheaper than serialising and writing) and returns; a
    background thread then serialises, writes, fsyncs and renames it exactly as
    :class:`AtomicCheckpointIO` does. The file is therefore the state at the moment of the call,
    however training goes on meanwhile (Lightning's ``AsyncCheckpointIO`` copies tensors on
    their own device, holds a copy per queued save and removes old checkpoints while a write
    may still be running; this class does neither).

    - At most one snapshot is held: a save waits for the previous write to finish, except a
      save of the very same tensors (``ModelCheckpoint`` writes ``last.ckpt`` right after the
      top-k file, with the old top-k file's removal queued between): those bytes are compared
      with the pending snapshot and shared, not copied (small new tensors, such as the RNG
      state of each dump, are copied). When every value is the same, the second file is a
      hard link to the first (made through a temporary name, then renamed: atomic), so the
      disk writes the bytes once; where links fail it is written in full.
    - Its buffers are kept for the next save (one checkpoint's worth of host memory; reusing
      them makes the copy several times faster than allocating) and freed at ``teardown``.
    - Removing an old checkpoint is queued behind the writes, so it never races them.
    - A failed write surfaces at the next save, removal, load, :meth:`wait` or ``teardown``
      (the end of ``fit``), naming the file (:class:`CheckpointDiskFullError` for a full disk,
      :class:`CheckpointWriteError` otherwise); the writes and removals queued after it are
      skipped, so the previous checkpoints stay as they were. A partial file never reaches the
      final path (the temporary file is removed, or left beside it by a crash).
    - ``teardown`` waits for the writes: once ``trainer.fit`` returns, the checkpoints are on
      disk. Outside ``fit`` (``trainer.save_checkpoint`` after it), call :meth:`wait`.

    The writer thread runs at the lowest CPU priority, on any core (:func:`_background_priority`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Future[None], _Snapshot | None]] = []
        self._failure: tuple[str, BaseException] | None = None
        self._buffers: dict[int, list[torch.UntypedStorage]] = {}

    def __getstate__(self) -> dict[str, Any]:  # a strategy may be pickled (spawned processes)
        self.wait()
        return {**self.__dict__, "_executor": None, "_pending": [], "_buffers": {}}

    # ---- CheckpointIO -----------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AsyncAtomicCheckpointIO takes no storage_options")
        target = os.fspath(path)
        snapshot, data = self._shared(checkpoint)
        if snapshot is None:
            self.wait()
            snapshot = _Snapshot(self._fresh)
            data = snapshot(checkpoint)
            self._buffers = {}  # those not reused are freed now
        snapshot.data = data
        self._submit(self._write, snapshot, snapshot, data, target)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        if self._pending:
            self._submit(self._remove, None, os.fspath(path))
        else:
            self.wait()
            super().remove_checkpoint(path)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        return super().load_checkpoint(path, map_location, weights_only)

    def teardown(self) -> None:
        handling = sys.exc_info()[1]  # Lightning tears down from its exception handler too
        try:
            self.wait()
        except Exception as error:
            if handling is None:
                raise
            log.error("%s", error)  # reported, not masking the error that ends the fit
        finally:
            if self._executor is not None:  # idle: wait() above waited for every job
                self._executor.shutdown(wait=False)
                self._executor = None
            self._buffers = {}
        super().teardown()

    # ---- the background side ------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every queued write and removal is done; raise the first failure once."""
        pending, self._pending = self._pending, []
        buffers: dict[int, torch.UntypedStorage] = {}
        for future, snapshot in pending:
            future.result()  # the jobs catch their own errors: this only waits
            for storage in snapshot.copies.values() if snapshot else ():
                buffers[id(storage)] = storage
        for storage in buffers.values():
            self._buffers.setdefault(storage.nbytes(), []).append(storage)
        failure, self._failure = self._failure, None
        if failure is not None:
            path, error = failure
            if isinstance(error, CheckpointDiskFullError):
                raise error  # its message names the file and what to do
            raise CheckpointWriteError(
                f"writing checkpoint {path} in the background failed ({type(error).__name__}: "
                f"{error}); it was not written, and the checkpoints saved before it are as they "
                "were. The saves and removals queued after it were skipped."
            ) from error

    def _submit(self, job: Any, snapshot: _Snapshot | None, *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending.append((self._executor.submit(job, *args), snapshot))

    def _write(self, snapshot: _Snapshot, data: dict[str, Any], path: str) -> None:
        """Write ``data`` to ``path``; the same bytes already written (``last.ckpt`` after the
        top-k file) become a hard link to that file (atomically, through a temporary name),
        halving the disk writes, or a full write where links fail (another file system)."""
        source = snapshot.source
        linked = (
            source is not None
            and source.written is not None
            and _same_value(source.data, data)  # the non-tensor entries too
            and self._run(path, _link_atomically, source.written, path)
        )
        if not linked:
            self._run(path, AtomicCheckpointIO.save_checkpoint, self, data, path)
        if self._failure is None:
            snapshot.written = path

    def _remove(self, path: str) -> None:
        self._run(path, AtomicCheckpointIO.remove_checkpoint, self, path)

    def _run(self, path: str, action: Any, *args: Any) -> Any:
        if self._failure is not None:
            return None  # an earlier write failed: leave everything as it is
        try:
            _background_priority()
            return action(*args)
        except BaseException as error:
            self._failure = (path, error)
            return None

    # ---- snapshots ----------------------------------------------------------------------------
    def _fresh(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        free = self._buffers.get(storage.nbytes())
        copied = free.pop() if free else torch.UntypedStorage(storage.nbytes())
        copied.copy_(storage)
        return copied

    def _shared(self, checkpoint: dict[str, Any]) -> tuple[_Snapshot | None, Any]:
        """The pending snapshot's copies for a checkpoint of the same tensor values, or
        ``(None, None)`` (nothing pending, a failure to report, or a tensor that changed)."""
        # The last snapshot queued: removals queued after it (ModelCheckpoint removes the old
        # top-k file between the new one and last.ckpt) do not change what it holds.
        pending = next((snap for _, snap in reversed(self._pending) if snap is not None), None)
        if pending is None or self._failure is not None:
            return None, None

        reused = []

        def shared(storage: torch.UntypedStorage) -> torch.UntypedStorage:
            copied = pending.copies.get(_key(storage))
            if copied is None and storage.nbytes() <= _SMALL_NEW_BYTES:
                # made for this save (the RNG state): its own small copy, no sharing needed
                return torch.UntypedStorage(storage.nbytes()).copy_(storage)
            if copied is None or not _same_bytes(storage, copied):
                raise _Changed
            reused.append(copied)
            return copied

        snapshot = _Snapshot(shared, source=pending)
        try:
            data = snapshot(checkpoint)
        except _Changed:
            return None, None
        return (snapshot, data) if reused else (None, None)  # else: another state altogether
