"""The trainer borrows the pinned workers' cores between an iteration's generation and its push,
and the workers borrow the trainer's while they load the push (``lend_idle_cores``): which
threads move there and back, and in a run with real Ray workers, that every trainer loan starts
after the iteration's last generation and ends before its push, that every load ran on both
sides' cores, and that the update is the same as without loans.

Each test pins this process (the trainer); its cores and torch threads are restored after it.
"""

import os
import threading

import pytest
import torch
from rl_helpers import ORDER_TOLERANCE, RecordingModule, max_diff, train

from periodic_rl.cpu_tuning import CPUWorkerTuning
from periodic_rl.cpu_tuning.core_loan import LOAN_LANE, CoreLoan, lend_once_ready
from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.timing import WORKER_LANE_PREFIX
from periodic_rl.rollout.workers.worker import RolloutWorker
from periodic_rl.weight_sync.transport import to_payload

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


@needs_two_cores
def test_a_loan_begins_inside_the_backward_that_was_training_when_generation_ended():
    """Generation ends while a micro-batch trains: the cores are lent at the next tensor that
    micro-batch's backward reads back, not at its end; another thread's autograd lends
    nothing; the gradients are those of a run without the lend points."""
    os.sched_setaffinity(0, {CORES[0]})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
    inputs = torch.randn(8, 16)
    model(inputs).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    other = torch.nn.Linear(16, 16)
    loan, generated = CoreLoan(), threading.Event()
    with lend_once_ready(loan, CORES[1:2], generated.is_set):
        loss = model(inputs).square().sum()
        assert not loan.lent  # the forward saved its tensors before generation ended
        generated.set()
        elsewhere = threading.Thread(target=lambda: other(inputs).sum().backward())
        elsewhere.start()
        elsewhere.join()
        assert not loan.lent
        loss.backward()
        assert loan.lent and loan.loans == 1  # inside the backward, still in the block
        assert os.sched_getaffinity(0) == {CORES[0], CORES[1]} and torch.get_num_threads() == 2
    assert loan.give_back() is not None
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-6, atol=1e-7)


def test_no_loan_of_cores_the_trainer_has():
    loan = CoreLoan()
    assert not loan.lend(os.sched_getaffinity(0)) and not loan.lent


class LoadCores(RecordingModule):
    """Also keeps, after each iteration's push, the cores each worker loaded it on."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.load_cores: list[list[int]] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        backend = self.trainer.strategy.rollouts.backend
        self.load_cores.append([t["load_cores"] for t in backend.worker_load_timings()])


@needs_two_cores
def test_a_worker_loads_on_borrowed_cores_and_hands_them_back(tiny_llama_path):
    """A worker on one core, given the other for a load, loads on both, then runs on its own
    core with its own thread count again."""
    worker = RolloutWorker(0, EngineSpec("hf", tiny_llama_path), tuning=CPUWorkerTuning())
    payload = to_payload(worker.engine.model.state_dict())
    os.sched_setaffinity(0, {CORES[1]})
    torch.set_num_threads(1)
    worker.load_weights(payload, version=1, borrow=[CORES[0]])
    assert worker.last_load["load_cores"] == 2
    assert os.sched_getaffinity(0) == {CORES[1]} and torch.get_num_threads() == 1
    worker.load_weights(payload, version=2)  # nothing to borrow
    assert worker.last_load["load_cores"] == 1
    worker.shutdown()


def pinned(lend: bool, **strategy) -> dict:
    """An overlapped run of one worker on all cores but the first and the trainer on the first,
    one group per call (this process back on every core before it pins itself)."""
    os.sched_setaffinity(0, set(CORES))
    return {
        "engine": "hf",
        "num_workers": 1,
        "groups_per_call": 1,
        "overlap": True,
        "worker_cores": [CORES[1:]],
        "trainer_cores": [CORES[0]],
        "lend_idle_cores": lend,
        **strategy,
    }


@needs_two_cores
def test_loans_fall_between_generation_and_push_and_change_no_update(tiny_llama_path, local_ray):
    """Overlapped on 1 + 1 cores, one group per call and micro-batch: the trainer borrows the
    worker's core once per iteration, only after the worker's last call of the iteration, and
    hands it back before the push; the weights match a run that never borrowed."""

    def run(lend: bool) -> tuple:
        return train(tiny_llama_path, steps=3, strategy=pinned(lend), module_cls=LoadCores)

    plain, lent = run(False), run(True)
    assert plain[1].load_cores == [[1]] * 3  # each push loaded on the worker's own core
    assert lent[1].load_cores == [[2]] * 3  # ... and on the waiting trainer's
    spans = lent[2].spans
    iterations = spans.iterations()
    assert lent[2].tuning.loan.loans == len(iterations) == 3
    assert plain[2].tuning.loan.loans == 0
    assert os.sched_getaffinity(0) == {CORES[0]}  # given back: the run ends on its own core
    for iteration in iterations:
        own = spans.spans(iteration)
        (loan,) = [s for s in own if s.lane == LOAN_LANE]
        generated = max(s.end for s in own if s.lane.startswith(WORKER_LANE_PREFIX))
        (push,) = [s for s in own if s.name == "weight push" and s.lane == "trainer"]
        assert generated <= loan.start <= loan.end <= push.start, iteration
    assert max_diff(plain[0], lent[0]) <= ORDER_TOLERANCE


@needs_two_cores
def test_with_bounded_staleness_loans_fall_while_the_workers_wait_and_change_no_update(
    tiny_llama_path, local_ray
):
    """max_staleness 1 on 1 + 1 cores: the worker generates ahead, then waits for the weights of
    the next version; the trainer borrows its core only while it waits (no span of the worker
    overlaps a loan), and the update matches a run that never borrowed."""

    def run(lend: bool) -> tuple:
        return train(tiny_llama_path, steps=4, strategy=pinned(lend, max_staleness=1))

    plain, lent = run(False), run(True)
    assert plain[2].tuning.loan.loans == 0
    assert lent[2].tuning.loan.loans >= 1
    assert os.sched_getaffinity(0) == {CORES[0]}  # given back: the run ends on its own core
    spans = lent[2].spans.spans()  # all of them, whichever iteration they were recorded in
    loans = [s for s in spans if s.lane == LOAN_LANE]
    worker = [s for s in spans if s.lane.startswith(WORKER_LANE_PREFIX)]
    assert loans and worker
    overlapping = [
        (w, loan) for w in worker for loan in loans if w.start < loan.end and loan.start < w.end
    ]
    assert overlapping == []
    assert max_diff(plain[0], lent[0]) <= ORDER_TOLERANCE
