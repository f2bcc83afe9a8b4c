"""Weights broadcast from the trainer straight into the rollout workers, through a process group
of their own (``push_transport="broadcast"`` of :class:`~periodic_rl.rollout.workers.rollouts.
RayRollouts`).

The trainer (rank 0) and the workers (rank ``i + 1`` for worker ``i``) form a group that never
touches ``torch.distributed``'s default group: a worker's in-process vLLM engine owns a
world-size-1 default group already, and the trainer may have its DDP group. The group is a
backend built directly on a store: NCCL between GPUs, gloo between CPUs.

- **Store**: a ``TCPStore`` the trainer serves on a socket it binds itself
  (:class:`StoreServer`): on 127.0.0.1 for a local run, so nothing listens beyond loopback, or on
  the trainer node's address when the workers run on a cluster. Each group formation
  (a *generation*) uses its own ``PrefixStore``, so a re-formed group never reads the keys of
  the one it replaces.
- **Transport**: the tensors travel in buckets (:class:`BroadcastPlan`): tensors are packed
  byte-wise into flat ``uint8`` buffers of at most ``bucket_bytes`` (a tensor larger than that
  travels alone, without a copy), so a model of hundreds of small tensors takes a handful of
  collectives. Names that share one tensor (tied embeddings) travel once and are re-tied on
  arrival. Every member must hold the same plan: the trainer sends it with its call to the
  workers.
- **Faults**: the group has a timeout (every collective, and its formation); a member that
  dies makes the others' collectives fail (gloo: the broken connections; NCCL: the deadline,
  after which the backend is aborted rather than left to NCCL's watchdog). A failed member
  closes its group (:meth:`WeightGroup.close`); the caller re-forms a new generation.

Gloo binds its connections to an address given explicitly (``ProcessGroupGloo.create_device``),
never to whatever the host name resolves to. NCCL's bootstrap sockets go on the interface named
by ``NCCL_SOCKET_IFNAME``, which every member (the trainer as rank 0 and each worker) sets to the
loopback interface for a local run as it joins, unless the user set it
(:func:`~periodic_rl.compat.torch_distributed.nccl_environment`): NCCL's own choice leaves ``lo``
out.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, Protocol

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]

#: Where packed tensors start inside a bucket: a multiple of every element size.
_ALIGN = 64
#: Default bucket size: few collectives, a bounded extra copy on the sender.
BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a push: its name, dtype (``"bfloat16"``...), shape, and where its bytes
    start in its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors that travel as one flat ``uint8`` buffer of ``nbytes`` (one collective)."""

    nbytes: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class BroadcastPlan:
    """What every member of a push must agree on: the buckets in order, and the names that are
    aliases of another (tied weights, sent once)."""

    buckets: tuple[Bucket, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls, state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES
    ) -> BroadcastPlan:
        """The plan of ``state_dict`` (in its order), tied tensors sent once."""
        buckets: list[Bucket] = []
        current: list[TensorSpec] = []
        size = 0
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, tensor in state_dict.items():
            if tensor.numel():
                key = (
                    tensor.device,
                    tensor.data_ptr(),
                    tensor.dtype,
                    tensor.shape,
                    tensor.stride(),
                )
                if key in seen:
                    aliases[name] = seen[key]
                    continue
                seen[key] = name
            spec = TensorSpec(name, _dtype_name(tensor.dtype), tuple(tensor.shape))
            start = -(-size // _ALIGN) * _ALIGN
            if current and start + spec.nbytes > bucket_bytes:
                buckets.append(Bucket(size, tuple(current)))
                current, start = [], 0
            current.append(TensorSpec(spec.name, spec.dtype, spec.shape, start))
            size = start + spec.nbytes
        if current:
            buckets.append(Bucket(size, tuple(current)))
        return cls(tuple(buckets), aliases)

    @property
    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors] + list(self.aliases)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class GroupAddress:
    """Where and how to join one generation of a weight group (sent to every worker)."""

    host: str  # the store's address (the trainer's)
    port: int
    world_size: int
    generation: int
    backend: Backend = "gloo"
    timeout_s: float = 120.0

    @property
    def prefix(self) -> str:
        return f"periodic_rl/weights/{self.generation}"


class Work(Protocol):
    """The part of ``torch.distributed``'s ``Work`` this module waits on."""

    def is_completed(self) -> bool: ...

    def wait(self, timeout: timedelta = ...) -> bool: ...


class StoreServer:
    """The trainer's ``TCPStore`` server, on a socket bound to ``host`` (port: any free one
    unless given). One serves every generation of groups (``PrefixStore`` per generation)."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 120.0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        self.host, self.port = host, listener.getsockname()[1]
        # The store's server takes the socket over (and closes it when the store goes).
        self.store: dist.TCPStore | None = dist.TCPStore(
            host,
            self.port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )

    def close(self) -> None:
        self.store = None  # the last reference: the server stops and its socket closes


class WeightGroup:
    """One member's handle on one generation of a weight group.

    Build it with :meth:`join` (every member at once: it returns when all have joined, or
    raises after the timeout). Rank 0 :meth:`send`\\ s, the others :meth:`receive`.
    """

    def __init__(self, backend: dist.ProcessGroup, address: GroupAddress, rank: int) -> None:
        self.backend: dist.ProcessGroup | None = backend
        self.address, self.rank = address, rank
        self.device = torch.device("cuda") if address.backend == "nccl" else torch.device("cpu")

    @classmethod
    def join(
        cls,
        address: GroupAddress,
        rank: int,
        bind_host: str,
        store: dist.Store | None = None,
    ) -> WeightGroup:
        """Join generation ``address.generation`` as ``rank``. ``bind_host``: this member's own
        address for gloo's connections (127.0.0.1 for a local run). ``store``: the trainer's
        served store (the others connect to ``address``)."""
        timeout = timedelta(seconds=address.timeout_s)
        if store is None:
            store = dist.TCPStore(address.host, address.port, None, False, timeout)
        prefixed = dist.PrefixStore(address.prefix, store)
        if address.backend == "nccl":
            from periodic_rl.compat.torch_distributed import nccl_environment

            os.environ.update(nccl_environment(address.host))  # before NCCL's first use
            backend = _nccl(prefixed, rank, address.world_size, timeout)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            backend = dist.ProcessGroupGloo(prefixed, rank, address.world_size, options)
        return cls(backend, address, rank)

    def device_uuid(self) -> str | None:
        """The UUID of this member's current CUDA device (NCCL), else ``None``."""
        if self.address.backend != "nccl":
            return None
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def send(self, plan: BroadcastPlan, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Broadcast ``state_dict``'s tensors (rank 0) in ``plan``'s order; returns when they
        have left (NCCL: when the collectives completed)."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 (the trainer) sends")
        works: list[tuple[Work, torch.Tensor]] = []
        for bucket in plan.buckets:
            buffer = self._pack(bucket, state_dict)
            works.append((self._broadcast(buffer), buffer))
            if self.address.backend == "gloo":  # gloo runs one at a time anyway: no extra copies
                self._wait(works.pop())
        for work in works:
            self._wait(work)

    def receive(self, plan: BroadcastPlan) -> dict[str, torch.Tensor]:
        """Receive every tensor of ``plan`` (views into one buffer per bucket, on this group's
        device), aliases re-tied."""
        if self.rank == 0:
            raise RuntimeError("rank 0 (the trainer) does not receive")
        tensors: dict[str, torch.Tensor] = {}
        works = []
        for bucket in plan.buckets:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            works.append((self._broadcast(buffer), buffer))
            for spec in bucket.tensors:
                tensors[spec.name] = (
                    buffer[spec.offset : spec.offset + spec.nbytes]
                    .view(_dtype(spec.dtype))
                    .view(spec.shape)
                )
        for work in works:
            self._wait(work)
        for name, target in plan.aliases.items():
            tensors[name] = tensors[target]
        return tensors

    def close(self) -> None:
        """Leave the group: abort what is in flight and drop the backend (its connections
        close, so the other members' collectives fail instead of waiting for this one)."""
        backend, self.backend = self.backend, None
        if backend is None:
            return
        try:
            backend.abort()
        except Exception:  # noqa: BLE001 - already broken: closing is all that is left
            pass
        try:
            backend.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # ---- internals ------------------------------------------------------------------------
    def _pack(self, bucket: Bucket, state_dict: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if len(bucket.tensors) == 1 and bucket.tensors[0].offset == 0:
            (spec,) = bucket.tensors
            return _bytes(_checked(spec, state_dict[spec.name]).to(self.device))
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        for spec in bucket.tensors:
            tensor = _checked(spec, state_dict[spec.name])
            buffer[spec.offset : spec.offset + spec.nbytes].copy_(_bytes(tensor))
        return buffer

    def _broadcast(self, buffer: torch.Tensor) -> Work:
        if self.backend is None:
            raise RuntimeError("this weight group was closed")
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        options.timeout = timedelta(seconds=self.address.timeout_s)
        return self.backend.broadcast([buffer], options)

    def _wait(self, item: tuple[Work, torch.Tensor]) -> None:
        work, _buffer = item  # the buffer stays referenced until its collective is done
        if self.address.backend == "nccl":
            # NCCL's wait does not block the host: poll until done, and abort on the deadline
            # ourselves rather than let NCCL's watchdog tear the process down.
            deadline = time.monotonic() + self.address.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(
                        f"weight broadcast (generation {self.address.generation}, rank "
                        f"{self.rank}) did not complete within {self.address.timeout_s:.0f} s"
                    )
                time.sleep(0.0005)
        work.wait()


def local_bind_host(store_host: str) -> str | None:
    """127.0.0.1 when the store is on loopback (a local run), else ``None`` (use this node's
    own address)."""
    from periodic_rl.compat.torch_distributed import is_loopback

    return "127.0.0.1" if is_loopback(store_host) else None


def _nccl(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A ``ProcessGroupNCCL`` on ``store`` (torch 2.13: ``(store, rank, size, options)``, the
    timeout in the options); NCCL's own timeout is twice ours, so our deadline aborts first."""
    if not dist.is_nccl_available():
        raise RuntimeError("the broadcast push over NCCL needs torch built with NCCL")
    from torch.distributed import ProcessGroupNCCL  # absent from CPU builds

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout * 2
    return ProcessGroupNCCL(store, rank, size, options)


def _checked(spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
    if _dtype_name(tensor.dtype) != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise ValueError(
            f"{spec.name}: {tensor.dtype} {tuple(tensor.shape)} does not match the plan's "
            f"{spec.dtype} {spec.shape}"
        )
    return tensor.detach()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat ``uint8`` tensor (a view when it is contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = [
    "BUCKET_BYTES",
    "Bucket",
    "BroadcastPlan",
    "GroupAddress",
    "StoreServer",
    "TensorSpec",
    "WeightGroup",
    "local_bind_host",
]
