"""Full weight pushes to rollout workers on this machine through shared memory: no copy.

Through Ray's object store a push copies every tensor into the store before any worker can load
it (taking longer whenever the store has to make room). To workers on this machine,
:func:`share` sends instead where each tensor lies: the storages of the pushed tensors move once
into shared memory (torch's file-descriptor sharing, in place: the policy's parameters keep
training there, at no cost per step), and each push describes them (the trainer's file
descriptor and its inode, byte offset, dtype, shape). A worker's :class:`SharedWeightsReader`
maps each file read-only (once, kept between pushes) and hands the engine views of it.

Safe because nothing writes the pushed tensors while a worker reads them: a push returns once
every worker has loaded and fingerprinted them (the fingerprint covers what it read), and the
trainer's next optimizer step first waits for the copy that restarted workers load
(:meth:`periodic_rl.rollout.workers.rollouts.RayRollouts.weights_will_change`).

Imports no torch at the top (the rollout worker imports this module before it pins its cores).
Relies on torch's private ``UntypedStorage._share_fd_cpu_`` (what ``torch.multiprocessing``
shares CPU tensors with: moves the storage into a shared-memory file once and returns its file
descriptor, kept open while the storage lives).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Set to ``0`` to push through Ray's object store to workers on this machine too.
ENV_SWITCH = "PERIODIC_RL_SHARED_WEIGHTS"


@dataclass(frozen=True)
class SharedTensor:
    """Where one pushed tensor lies: the trainer's file descriptor ``fd`` (the file ``inode``,
    ``size`` bytes), from byte ``offset``, contiguous."""

    fd: int
    inode: int
    size: int
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SharedPush:
    """A full push by description: the tensors of process ``pid`` on the machine ``boot_id``."""

    pid: int
    boot_id: str
    tensors: dict[str, SharedTensor]


def machine_boot_id() -> str:
    """This machine's boot id (two processes with the same one share ``/proc`` and memory)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def share(state_dict: Mapping[str, torch.Tensor]) -> SharedPush | None:
    """``state_dict`` as a :class:`SharedPush` (its storages moved into shared memory first,
    once per storage); ``None`` when a tensor cannot travel so (not a contiguous CPU tensor, its
    storage shared another way, or more storages than a quarter of the file limit, as each
    keeps a file open): the caller pushes through the object store then."""
    for tensor in state_dict.values():
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
            return None
    storages = {t.untyped_storage().data_ptr() for t in state_dict.values()}
    if len(storages) > _max_files():
        return None
    tensors = {}
    for name, tensor in state_dict.items():
        storage = tensor.untyped_storage()
        try:
            fd, size = storage._share_fd_cpu_()
        except RuntimeError:  # e.g. shared by file name already
            return None
        tensors[name] = SharedTensor(
            fd=fd,
            inode=os.fstat(fd).st_ino,
            size=size,
            offset=tensor.storage_offset() * tensor.element_size(),
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=tuple(tensor.shape),
        )
    return SharedPush(os.getpid(), machine_boot_id(), tensors)


def _max_files() -> int:
    """Storages a push may keep open as files: a quarter of this process's file limit (each
    shared storage holds a file descriptor for as long as it lives)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft // 4) if soft != resource.RLIM_INFINITY else 1 << 16


@dataclass
class SharedWeightsReader:
    """A worker's read-only mappings of the trainer's shared weights, kept between pushes (the
    parameters' files stay the same while the trainer's storages live)."""

    _maps: dict[tuple[int, int, int, int], Any] = field(default_factory=dict)

    def read(self, push: SharedPush) -> dict[str, torch.Tensor]:
        """Tensors viewing the pushed weights (read-only: the engine copies what it keeps).
        Raises ``RuntimeError`` for a push from another machine or a file that changed."""
        import numpy as np
        import torch

        if push.boot_id != machine_boot_id():
            raise RuntimeError(
                "a shared-memory weight push reached a worker on another machine; set "
                f"{ENV_SWITCH}=0 to push through Ray's object store"
            )
        used, tensors = {}, {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for name, where in push.tensors.items():
                key = (push.pid, where.fd, where.inode, where.size)
                mapped = used.get(key)
                if mapped is None:
                    mapped = self._maps.get(key)
                    if mapped is None:
                        mapped = torch.from_numpy(self._map(push.pid, where, np))
                    used[key] = mapped
                dtype = getattr(torch, where.dtype)
                count = 1
                for dim in where.shape:
                    count *= dim
                nbytes = count * dtype.itemsize
                flat = mapped[where.offset : where.offset + nbytes]
                tensors[name] = flat.view(dtype).view(where.shape)
        self._maps = used  # the files of storages the trainer freed are let go
        return tensors

    @staticmethod
    def _map(pid: int, where: SharedTensor, np: Any) -> Any:
        path = f"/proc/{pid}/fd/{where.fd}"
        try:
            if os.stat(path).st_ino != where.inode:
                raise RuntimeError(f"{path} is no longer the pushed weights' file")
            return np.memmap(path, dtype=np.uint8, mode="r", shape=(where.size,))
        except OSError as error:
            raise RuntimeError(
                f"cannot read the trainer's shared weights at {path} ({error}); set "
                f"{ENV_SWITCH}=0 to push through Ray's object store"
            ) from error

    def close(self) -> None:
        self._maps = {}
