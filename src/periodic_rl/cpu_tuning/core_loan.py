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
:func:`periodic_rl.rollout.engines.vllm_host.host_state_preserved`), so the reload runs on more
cores (docs/overlap.md). The first generate call of an iteration, which the trainer also only
waits for, gains nothing from them, so a worker borrows for loads only.

The trainer does not wait for the end of the micro-batch it is in when generation ends: while
one trains, :func:`lend_once_ready` checks at every tensor the forward saves for backward and
every one the backward reads back (autograd's saved-tensor hooks, on the training thread) and
lends at the first such point after the last group was generated. Otherwise the loan could
begin up to a whole micro-batch after the workers' last call.

Only the threads that ran on the borrower's cores when the loan began move (and those started
during the loan on the widened set, such as new OpenMP workers): a thread that chose its own
cores (a background checkpoint writer allowed on every core) keeps them. Thread counts must be
set from the thread that runs the work (OpenMP's thread count is per thread), so both calls
belong on that thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from periodic_rl.rollout.processes import CoreLoan
from periodic_rl.rollout.timing import LOAN_LANE

__all__ = ["LOAN_LANE", "CoreLoan", "lend_once_ready"]


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
