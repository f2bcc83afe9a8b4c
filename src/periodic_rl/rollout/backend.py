"""`RolloutBackend`: the interface every set of rollout engines offers the rollout side.

Two implementations: :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts` (engines in Ray
actors, groups streamed back as they finish, dead workers replaced) and
:class:`~periodic_rl.rollout.local.LocalRollouts` (one engine in the trainer's process, for
debugging). The :class:`~periodic_rl.rollout.controller.RolloutController` talks to either only
through these five methods.

:meth:`RolloutBackend.generate` takes a fixed list of jobs and, optionally, a :class:`JobSource`
that the caller adds jobs to while the generation runs (dynamic sampling's spare prompts,
:mod:`periodic_rl.rollout.dynamic_sampling`): the backend takes them as they come and ends
once the source is closed and every job was generated.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch

from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig


class JobSource:
    """Jobs added while a :meth:`RolloutBackend.generate` runs (thread-safe).

    The caller :meth:`put` s jobs and finally :meth:`close` s the source; the backend takes
    what was added with :meth:`next_jobs` (reading :attr:`closed` *before* it, so that nothing
    put before the close is missed) and may :meth:`wait` for more when it has nothing to do.
    """

    def __init__(self) -> None:
        self._jobs: list[GroupJob] = []
        self._closed = False
        self._cond = threading.Condition()

    def put(self, jobs: Iterable[GroupJob]) -> None:
        jobs = list(jobs)
        if not jobs:
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("put() on a closed JobSource")
            self._jobs.extend(jobs)
            self._cond.notify_all()

    def close(self) -> None:
        """No more jobs will be added (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def next_jobs(self) -> list[GroupJob]:
        """Every job added since the last call, in the order added (never blocks)."""
        with self._cond:
            jobs, self._jobs = self._jobs, []
            return jobs

    def wait(self, timeout: float | None = None) -> bool:
        """Block until jobs are waiting or the source is closed (or ``timeout`` s passed);
        whether either is the case."""
        with self._cond:
            return bool(self._cond.wait_for(lambda: self._jobs or self._closed, timeout))


@runtime_checkable
class GroupGenerator(Protocol):
    """What generates an iteration's groups (what :func:`~periodic_rl.rollout.producer.produce`
    needs): a backend, or a backend wrapped to generate in chunks
    (:class:`~periodic_rl.rollout.partial.PartialRollouts`)."""

    def generate(
        self,
        jobs: list[GroupJob],
        sampling: SamplingConfig,
        version: int,
        groups_per_call: int | None = None,
        ramp_groups: int | None = None,
        cancel: threading.Event | None = None,
        more_jobs: JobSource | None = None,
    ) -> Iterator[GeneratedGroup]:
        """Every job once, each group stamped with the version and fingerprint of the weights
        that generated it, in completion order. Stops early once ``cancel`` is set.
        ``more_jobs``: jobs added during the generation (their indices unique among all the
        call's jobs), generated too; the iterator ends once it is closed and all are done."""
        ...


@runtime_checkable
class RolloutBackend(GroupGenerator, Protocol):
    """Rollout engines behind one API: load weights (verified), generate groups, shut down."""

    def start(self) -> object:
        """Start the engines (idempotent); returns once every engine holds the same weights."""
        ...

    def push_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, keep: list[str] | None = None
    ) -> str:
        """Load ``state_dict`` on every engine as policy ``version``; check each engine's
        fingerprint of what it holds against the fingerprint of what was sent; return it.
        ``keep``: LoRA-adapted weight names to keep as the base of later adapter pushes."""
        ...

    def push_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> str:
        """Merge a LoRA adapter payload into the kept base on every engine; verified like
        :meth:`push_weights`; returns the fingerprint of base and adapter together."""
        ...

    def weights_will_change(self) -> None:
        """The trainer is about to change the weights it pushed last (an optimizer step): the
        backend finishes whatever still reads them (a copy kept for restarted engines)."""
        ...

    def shutdown(self) -> None:
        """Stop every engine and process it started (idempotent)."""
        ...
