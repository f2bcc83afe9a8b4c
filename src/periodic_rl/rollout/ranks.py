"""`RankLink`: how the training processes (ranks) exchange what the rollout side needs.

Rank 0 drives the rollout workers for every rank: it receives each rank's prompts of the
iteration (:meth:`RankLink.gather`), generates and scores them, and sends every finished group
to the rank that owns it (:meth:`RankLink.send` / :meth:`RankLink.recv`), while all ranks are
back-propagating. After a weight push it tells every rank the new fingerprint
(:meth:`RankLink.broadcast`), so each rank verifies its own groups.

Groups travel on a process group of their own (gloo, CPU): a background thread sends and
receives them while the main threads run the training strategy's collectives (DDP's gradient
all-reduce, FSDP's reduce-scatter) on the default group. ``gather`` and ``broadcast`` run on
the training threads only, at points every rank reaches in the same order.

One rank (:class:`SingleRank`) needs none of this: every method is the identity.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RankLink(Protocol):
    """What the rollout side needs from the other training processes."""

    rank: int
    world_size: int

    def gather(self, item: Any) -> list[Any]:
        """Every rank's ``item``, in rank order (a collective: every rank calls it)."""
        ...

    def broadcast(self, item: Any) -> Any:
        """Rank 0's ``item`` on every rank (a collective)."""
        ...

    def send(self, rank: int, item: Any) -> None:
        """Send ``item`` to ``rank`` (rank 0's rollout thread)."""
        ...

    def recv(self) -> Any:
        """The next item rank 0 sent to this rank (this rank's rollout thread)."""
        ...


class SingleRank:
    """The :class:`RankLink` of a one-process run."""

    rank = 0
    world_size = 1

    def gather(self, item: Any) -> list[Any]:
        return [item]

    def broadcast(self, item: Any) -> Any:
        return item

    def send(self, rank: int, item: Any) -> None:
        raise RuntimeError(f"one training process: there is no rank {rank} to send to")

    def recv(self) -> Any:
        raise RuntimeError("one training process: nothing is sent to rank 0")


class ProcessGroupLink:
    """The :class:`RankLink` of an initialised ``torch.distributed`` job.

    Creating it is a collective (``new_group``): every rank must build it at the same point.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroupLink needs an initialised torch.distributed job")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._rollout_group = dist.new_group(backend="gloo")  # CPU objects, own thread
        self._object_group = dist.new_group(backend="gloo")  # gather/broadcast on CPU

    def gather(self, item: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, item, group=self._object_group)
        return out

    def broadcast(self, item: Any) -> Any:
        import torch.distributed as dist

        box = [item if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._object_group)
        return box[0]

    def send(self, rank: int, item: Any) -> None:
        import torch.distributed as dist

        dist.send_object_list([item], dst=rank, group=self._rollout_group)

    def recv(self) -> Any:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.recv_object_list(box, src=0, group=self._rollout_group)
        return box[0]


def rank_link() -> RankLink:
    """:class:`ProcessGroupLink` when ``torch.distributed`` runs with several ranks, else
    :class:`SingleRank`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProcessGroupLink()
    return SingleRank()
