"""A sized, seeded prompt loader whose position survives a checkpoint.

Lightning saves and restores the state of any train loader that has ``state_dict`` and
``load_state_dict``; with this one, a resumed run sees exactly the prompts the uninterrupted run
would have seen. Being sized, it is never prefetched ahead of the current iteration.

With several training processes (ranks), each iteration draws one global batch of
``world_size x batch_size`` rows from the seeded order and rank ``r`` takes the ``r``-th slice,
so the ranks' batches, concatenated in rank order, are exactly the batch a one-rank run with
``world_size x batch_size`` prompts would draw.

Dynamic sampling (:mod:`periodic_rl.rollout.dynamic_sampling`) draws spare prompts from
:meth:`PromptLoader.spare_rows`: a seeded order of every training row of its own per iteration,
the same on every rank and for any ``world_size`` and ``batch_size``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class IndexedPrompts(Protocol):
    """A train loader that can tell any iteration's rows before it yields them (what bounded
    staleness needs to generate later iterations ahead)."""

    def rows_of_iteration(self, iteration: int) -> list[dict[str, Any]]: ...


@runtime_checkable
class SparePrompts(Protocol):
    """A train loader that can draw spare prompts for an iteration (what dynamic sampling
    needs to refill an iteration whose groups it dropped)."""

    def spare_rows(self, iteration: int, count: int, start: int = 0) -> list[dict[str, Any]]: ...


class PromptLoader:
    """Batches of ``batch_size`` rows, reshuffled (seeded) every epoch; the last short batch is
    dropped so every iteration has the same number of groups (on every rank).

    Args:
        rank, world_size: this process's slice of each global batch (module docstring).
    """

    def __init__(
        self,
        rows: list[dict[str, Any]],
        batch_size: int,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if len(rows) < batch_size * world_size:
            raise ValueError(
                f"{len(rows)} training rows is fewer than one iteration's prompts: "
                f"batch_size={batch_size} x {world_size} rank(s)"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out
        self._spare_order: tuple[tuple[int, int], list[int]] | None = None

    def __len__(self) -> int:
        return len(self.rows) // (self.batch_size * self.world_size)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        order = self._order(self.epoch)
        while self.position < len(self):
            batch = self._batch(order, self.position)
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def rows_of_iteration(self, iteration: int) -> list[dict[str, Any]]:
        """This rank's rows of the run's ``iteration``-th batch (0-based, counting across
        epochs): what iterating yields then, known ahead (bounded staleness generates later
        iterations' prompts before the trainer reaches them)."""
        epoch, position = divmod(iteration, len(self))
        return self._batch(self._order(epoch), position)

    def spare_rows(self, iteration: int, count: int, start: int = 0) -> list[dict[str, Any]]:
        """Spare rows ``start .. start + count - 1`` of ``iteration`` (dynamic sampling's extra
        prompts): a seeded permutation of all the training rows, a new one each time it runs
        out. A function of the loader's seed, ``iteration`` and the spare's number only (not of
        the rank, ``world_size``, ``batch_size``, ``shuffle`` or the loader's position). Spares
        may repeat prompts of the iteration's own batch (they get other sampling seeds)."""
        if iteration < 0 or count < 0 or start < 0:
            raise ValueError(f"spare_rows({iteration}, {count}, {start}): negative argument")
        out = []
        for s in range(start, start + count):
            cycle, place = divmod(s, len(self.rows))
            out.append(self.rows[self._spares(iteration, cycle)[place]])
        return out

    def _spares(self, iteration: int, cycle: int) -> list[int]:
        key, cached = (iteration, cycle), self._spare_order  # one read: thread-safe
        if cached is not None and cached[0] == key:
            return cached[1]
        seed = ((self.seed * 1_000_003 + iteration) * 1_000_003 + cycle) % 2**62 + 2**62
        generator = torch.Generator().manual_seed(seed)  # apart from the epochs' seeds
        order = torch.randperm(len(self.rows), generator=generator).tolist()
        self._spare_order = key, order
        return order

    def _batch(self, order: list[int], position: int) -> list[dict[str, Any]]:
        start = (position * self.world_size + self.rank) * self.batch_size
        return [self.rows[i] for i in order[start : start + self.batch_size]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
