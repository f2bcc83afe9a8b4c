"""The trainer borrows the pinned workers' cores between an iteration's generation and its push
(``lend_idle_cores``): which threads move there and back, and in a run with real Ray workers,
that every loan starts after the iteration's last generation, ends before its push, and leaves
the update as it is without loans.

Each test pins this process (the trainer); its cores and torch threads are restored after it.
"""

import os
import threading

import pytest
import torch
from rl_helpers import ORDER_TOLERANCE, max_diff, train

from periodic_rl.rollout.core_loan import LOAN_LANE, CoreLoan
from periodic_rl.rollout.timing import WORKER_LANE_PREFIX

pytestmark = pytest.mark.usefixtures("restore_trainer_cores")

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="lends a second core")


class Parked(threading.Thread):
    """A thread that waits until released (optionally on cores of its own choosing)."""

    def __init__(self, cores: set[int] | None = None) -> None:
        super().__init__(daemon=True)
        self.cores, self.ready, self.release = cores, threading.Event(), threading.Event()

    def run(self) -> None:
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)
        self.ready.set()
        self.release.wait()

    def started(self) -> "Parked":
        self.start()
        self.ready.wait()
        return self

    @property
    def affinity(self) -> set[int]:
        return os.sched_getaffinity(self.native_id)


@needs_two_cores
def test_a_loan_widens_the_trainers_threads_and_gives_them_back():
    own, extra = {CORES[0]}, {CORES[1]}
    os.sched_setaffinity(0, own)
    torch.set_num_threads(1)
    pinned, chosen = Parked().started(), Parked(cores=extra).started()
    loan = CoreLoan()
    try:
        assert loan.lend(extra)
        assert os.sched_getaffinity(0) == own | extra and torch.get_num_threads() == 2
        assert pinned.affinity == own | extra
        assert chosen.affinity == extra  # chose its own cores: left alone
        during = Parked().started()  # started during the loan, on the widened cores
        assert not loan.lend(extra)  # one loan at a time
        start, end = loan.give_back()
        assert start <= end and loan.lent_s == pytest.approx(end - start)
        assert os.sched_getaffinity(0) == own and torch.get_num_threads() == 1
        assert pinned.affinity == own and during.affinity == own
        assert chosen.affinity == extra
        assert loan.give_back() is None and loan.loans == 1
    finally:
        for thread in (pinned, chosen):
            thread.release.set()


def test_no_loan_of_cores_the_trainer_has():
    loan = CoreLoan()
    assert not loan.lend(os.sched_getaffinity(0)) and not loan.lent


@needs_two_cores
def test_loans_fall_between_generation_and_push_and_change_no_update(tiny_llama_path, local_ray):
    """Overlapped on 1 + 1 cores, one group per call and micro-batch: the trainer borrows the
    worker's core once per iteration, only after the worker's last call of the iteration, and
    hands it back before the push; the weights match a run that never borrowed."""

    def run(lend: bool) -> tuple:
        os.sched_setaffinity(0, set(CORES))
        strategy = {
            "engine": "hf",
            "num_workers": 1,
            "groups_per_call": 1,
            "overlap": True,
            "worker_cores": [CORES[1:]],
            "trainer_cores": [CORES[0]],
            "lend_idle_cores": lend,
        }
        return train(tiny_llama_path, steps=3, strategy=strategy)

    plain, lent = run(False), run(True)
    spans = lent[2].spans
    iterations = spans.iterations()
    assert lent[2].rollouts.core_loan.loans == len(iterations) == 3
    assert plain[2].rollouts.core_loan.loans == 0
    assert os.sched_getaffinity(0) == {CORES[0]}  # given back: the run ends on its own core
    for iteration in iterations:
        own = spans.spans(iteration)
        (loan,) = [s for s in own if s.lane == LOAN_LANE]
        generated = max(s.end for s in own if s.lane.startswith(WORKER_LANE_PREFIX))
        (push,) = [s for s in own if s.name == "weight push" and s.lane == "trainer"]
        assert generated <= loan.start <= loan.end <= push.start, iteration
    assert max_diff(plain[0], lent[0]) <= ORDER_TOLERANCE
