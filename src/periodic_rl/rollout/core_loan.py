"""`CoreLoan`: one side of an overlapped run borrows the other's CPU cores while they are idle.

Overlapped on disjoint cores, a worker that has generated its share of an iteration sits idle
until the next weight push, while the trainer still back-propagates the last micro-batches and
steps the optimizer on its own cores. A loan moves the trainer's threads onto the workers'
cores as well (and sizes torch's thread pool to match) from the moment the iteration's
generation is complete; :meth:`CoreLoan.give_back` returns them before the push, when the
workers load the new weights and then generate the next iteration. The update is the same
either way (the same operations, on more threads).

The other way round, the trainer only waits while the workers load a weight push: each worker
borrows the trainer's cores for the load and gives them back before it generates again. The
load's torch thread pool grows to the borrowed cores (vLLM's CPU worker disables
``torch.set_num_threads`` at start; the engine puts it back,
:func:`periodic_rl.rollout.vllm_host.host_state_preserved`), and the reload measured faster for
it (``benchmarks/push.py --modes default no-loans``). The first generate call of an iteration,
which the trainer also only waits for, gained nothing measurable when tried by hand, so a worker
borrows for loads only.

The trainer does not wait for the end of the micro-batch it is in when generation ends: while
one trains, :func:`lend_once_ready` checks at every tensor the forward saves for backward and
every one the backward reads back (autograd's saved-tensor hooks, on the training thread) and
lends at the first such point after the last group was generated. In the demo's timeline the
loan began up to a whole micro-batch (over a second) after the worker's last call otherwise.

Only the threads that ran on the borrower's cores when the loan began move (and those started
during the loan on the widened set, such as new OpenMP workers): a thread that chose its own
cores (a background checkpoint writer allowed on every core) keeps them. Thread counts must be
set from the thread that runs the work (OpenMP's thread count is per thread), so both calls
belong on that thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from periodic_rl.rollout.options import RolloutOptions
from periodic_rl.rollout.timing import LOAN_LANE

__all__ = ["LOAN_LANE", "CoreLoan", "lend_once_ready", "lendable_cores"]


def _thread_ids() -> set[int]:
    return {int(entry) for entry in os.listdir("/proc/self/task")}


def _affinity(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except OSError:  # the thread ended meanwhile
        return None


def _move(tids: Iterable[int], cores: set[int]) -> None:
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            continue


@dataclass
class CoreLoan:
    """Lends another process's idle cores to this one: the workers' to the trainer between
    generation and the push, the trainer's to a worker while it loads a push.

    ``lent_s``: seconds the cores were lent in all, ``loans``: loans made (for metrics and
    tests); ``own``: this process's cores while a loan is out (``None`` otherwise).
    Times are ``time.time()`` seconds, like the spans of :mod:`periodic_rl.rollout.timing`.
    """

    lent_s: float = 0.0
    loans: int = 0
    own: set[int] | None = None
    _moved: set[int] = field(default_factory=set)
    _before: set[int] = field(default_factory=set)
    _since: float = 0.0

    @property
    def lent(self) -> bool:
        return self.own is not None

    def lend(self, cores: Iterable[int]) -> bool:
        """Widen this process to its own cores plus ``cores`` (their owner must leave them idle
        until :meth:`give_back`). Returns whether a loan began: not when one is out already,
        nor when this process already runs on every one of those cores."""
        if self.lent:
            return False
        own = os.sched_getaffinity(0)
        wide = own | {int(c) for c in cores}
        if wide == own:
            return False
        import torch

        self._before = _thread_ids()
        self._moved = {t for t in self._before if _affinity(t) == own}
        _move(self._moved, wide)
        os.sched_setaffinity(0, wide)
        torch.set_num_threads(len(wide))
        self.own, self._since = own, time.time()
        self.loans += 1
        return True

    def give_back(self) -> tuple[float, float] | None:
        """Back onto this process's own cores; the loan's ``(start, end)``, or ``None`` (and
        nothing done) without a loan out."""
        if self.own is None:
            return None
        import torch

        own, wide = self.own, os.sched_getaffinity(0)
        started = {t for t in _thread_ids() - self._before if _affinity(t) == wide}
        _move(self._moved | started, own)
        os.sched_setaffinity(0, own)
        torch.set_num_threads(len(own))
        end = time.time()
        self.lent_s += end - self._since
        self.own, self._moved, self._before = None, set(), set()
        return self._since, end


@contextmanager
def lend_once_ready(loan: CoreLoan, cores: list[int], ready: Callable[[], bool]) -> Iterator[None]:
    """While the block runs on this thread, lend ``cores`` at the first point ``ready()`` is
    true: each tensor autograd saves for backward (forward) or reads back (backward) on this
    thread is such a point. Thread counts are per thread, so only this thread lends; other
    threads' autograd passes no point (the hooks are this thread's). The hooks pass every
    tensor through unchanged."""
    import torch

    thread = threading.get_ident()

    def point(tensor: torch.Tensor) -> torch.Tensor:
        if not loan.lent and threading.get_ident() == thread and ready():
            loan.lend(cores)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(point, point):
        yield


def lendable_cores(
    options: RolloutOptions, worker_cores: list[list[int]] | None, world_size: int
) -> list[int]:
    """The workers' cores (``worker_cores``, where they run now) the trainer may borrow while
    the workers have nothing to generate (``lend_idle_cores``): only with workers pinned to
    cores of this machine and one training process; else none."""
    o = options
    if not (o.lend_idle_cores and worker_cores and o.use_ray and o.ray_address is None):
        return []
    if world_size != 1:
        return []
    return sorted({c for cores in worker_cores for c in cores})
