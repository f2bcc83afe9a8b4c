"""How an iteration's prompt groups are cut into worker calls."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from periodic_rl.rollout.backend import JobSource
    from periodic_rl.rollout.types import GroupJob

T = TypeVar("T")


def plan_calls(
    jobs: list[T], groups_per_call: int, num_workers: int, ramp_groups: int | None = None
) -> list[list[T]]:
    """Cut ``jobs`` into calls of ``groups_per_call``, in order.

    With ``ramp_groups`` (the groups of one trainer micro-batch) smaller than
    ``groups_per_call``, each worker's first call and the iteration's last ``num_workers`` calls
    carry ``ramp_groups`` groups: the trainer starts on its first micro-batch after one
    micro-batch's generation instead of a whole call's, and after the last group arrives it has
    one micro-batch left to train instead of a call's worth. The calls in between keep the larger
    batch, which the engine generates more efficiently. Pipeline fill and drain are the two
    stretches of an overlapped iteration in which one side idles, so they are the ones kept short.
    """
    if groups_per_call < 1 or num_workers < 1 or (ramp_groups is not None and ramp_groups < 1):
        raise ValueError("groups_per_call, num_workers and ramp_groups must be >= 1")

    def chunks(part: list[T], size: int) -> list[list[T]]:
        return [part[i : i + size] for i in range(0, len(part), size)]

    if ramp_groups is None or ramp_groups >= groups_per_call:
        return chunks(jobs, groups_per_call)
    ramp = num_workers * ramp_groups
    head = jobs[: min(ramp, len(jobs))]
    rest = jobs[len(head) :]
    tail = rest[max(0, len(rest) - ramp) :]
    middle = rest[: len(rest) - len(tail)]
    return chunks(head, ramp_groups) + chunks(middle, groups_per_call) + chunks(tail, ramp_groups)


def take_jobs(
    source: JobSource | None, pending: deque[list[GroupJob]], indices: set[int], size: int
) -> bool:
    """Move the jobs added to ``source`` into ``pending`` (as calls of ``size``); whether more
    may still come."""
    if source is None:
        return False
    closed = source.closed  # read first: whatever was put before the close is taken below
    jobs = source.next_jobs()
    for job in jobs:
        if job.index in indices:
            raise ValueError(f"job index {job.index} is used twice in one generate call")
        indices.add(job.index)
    pending.extend(jobs[i : i + size] for i in range(0, len(jobs), size))
    return not closed
