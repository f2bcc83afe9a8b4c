"""GroupStream: whole groups in completion order, blocking, closing, producer errors, and a
consumer that cancels (the Ray rollouts then stop generating)."""

from __future__ import annotations

import sys
import threading
import time
import types
from dataclasses import dataclass

import pytest

from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.stream import GroupStream, StreamClosed
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig
from periodic_rl.rollout.workers.rollouts import RayRollouts


@dataclass
class Group:
    index: int
    completion_ids: list[list[int]]


def group(index: int, n: int = 2) -> Group:
    return Group(index, [[index]] * n)


def test_whole_groups_in_arrival_order():
    stream: GroupStream[Group] = GroupStream()
    for i, n in enumerate([2, 3, 1, 2]):
        stream.put(group(i, n))
    assert stream.ready_completions() == 8
    first = stream.get_micro_batch(4)  # 2 + 3 >= 4: never split a group
    assert [g.index for g in first] == [0, 1]
    assert [g.index for g in stream.get_micro_batch(1)] == [2]
    stream.close()
    assert [g.index for g in stream.get_micro_batch(100)] == [3]  # closed: what is left
    assert stream.get_micro_batch(1) is None
    assert stream.get_micro_batch(1) is None
    assert (stream.num_put, stream.num_taken) == (4, 4)


def test_blocks_until_enough_completions():
    stream: GroupStream[Group] = GroupStream()
    stream.put(group(0))
    got: list = []
    consumer = threading.Thread(target=lambda: got.append(stream.get_micro_batch(4)))
    consumer.start()
    time.sleep(0.1)
    assert consumer.is_alive() and not got  # 2 < 4 completions: still waiting
    stream.put(group(1))
    consumer.join(timeout=5)
    assert [g.index for g in got[0]] == [0, 1]


def test_producer_thread_and_consumer_see_every_group_once():
    stream: GroupStream[Group] = GroupStream()

    def produce() -> None:
        for i in range(50):
            stream.put(group(i, n=1 + i % 3))
            if i % 7 == 0:
                time.sleep(0.001)
        stream.close()

    threading.Thread(target=produce).start()
    seen = [g.index for batch in stream.micro_batches(5) for g in batch]
    assert seen == list(range(50))


def test_producer_error_reraises_in_consumer():
    stream: GroupStream[Group] = GroupStream()

    class RewardFailed(RuntimeError):
        pass

    def produce() -> None:
        try:
            stream.put(group(0))
            raise RewardFailed("reward function crashed")
        except BaseException as error:
            stream.error(error)

    threading.Thread(target=produce).start()
    with pytest.raises(RewardFailed, match="crashed"):
        while stream.get_micro_batch(100) is not None:
            pass
    with pytest.raises(RewardFailed):
        stream.drain()
    with pytest.raises(StreamClosed):
        stream.put(group(1))


def test_drain_timeout_and_size_function():
    stream: GroupStream[tuple[str, int]] = GroupStream(size=lambda item: item[1])
    stream.put(("a", 3))
    with pytest.raises(TimeoutError):
        stream.get_micro_batch(5, timeout=0.05)
    with pytest.raises(TimeoutError):
        stream.drain(timeout=0.05)
    stream.put(("b", 2))
    assert stream.get_micro_batch(5, timeout=1) == [("a", 3), ("b", 2)]
    stream.put(("c", 1))
    stream.close()
    assert stream.drain() == [("c", 1)]
    with pytest.raises(ValueError):
        stream.get_micro_batch(0)


# ---- cancellation: the consumer stops early ---------------------------------------------------


def test_cancel_drops_queued_groups_and_ignores_later_ones():
    stream: GroupStream[Group] = GroupStream()
    stream.put(group(0))
    stream.put(group(1))
    stream.cancel()
    assert stream.cancelled and stream.cancel_event.is_set() and stream.closed
    assert stream.ready_completions() == 0 and len(stream) == 0
    assert stream.put(group(2)) is False  # the producer's late groups go nowhere, no error
    stream.error(RuntimeError("the producer failed after the consumer left"))
    assert stream.get_micro_batch(1) is None  # nobody is told about it
    stream.cancel()  # idempotent


def test_cancel_wakes_a_waiting_consumer():
    stream: GroupStream[Group] = GroupStream()
    got: list = []
    consumer = threading.Thread(target=lambda: got.append(stream.get_micro_batch(4)))
    consumer.start()
    stream.cancel()
    consumer.join(timeout=30)
    assert not consumer.is_alive() and got == [None]


class FakeRef:
    def __init__(self, groups):
        self.groups = groups


class FakeRay(types.ModuleType):
    """Ray's three calls the generation loop of RayRollouts uses, on fake workers: a call completes
    when it is the oldest in flight (``wait``); ``on_wait`` runs inside each wait."""

    def __init__(self):
        super().__init__("ray")
        self.exceptions = types.ModuleType("ray.exceptions")
        self.exceptions.RayActorError = type("RayActorError", (Exception,), {})
        self.cancelled: list[FakeRef] = []
        self.waits = 0
        self.on_wait = None
        self.nothing_ready = False

    def wait(self, refs, num_returns=1, timeout=None):
        self.waits += 1
        if self.waits > 100:
            raise AssertionError("generation kept waiting: the cancellation was not seen")
        if self.on_wait is not None:
            self.on_wait()
        if self.nothing_ready:  # every call still running when the poll times out
            return [], list(refs)
        return list(refs[:1]), list(refs[1:])

    def get(self, ref):
        return ref.groups

    def cancel(self, ref):
        self.cancelled.append(ref)


class CountingWorker:
    """A worker actor that counts the calls it is sent."""

    def __init__(self):
        self.calls: list[FakeRef] = []
        self.generate = types.SimpleNamespace(remote=self._remote)

    def _remote(self, jobs, sampling, version):
        groups = [
            GeneratedGroup(job.index, [[1, 2]] * job.n, version, "fp", worker=0, seed=job.seed)
            for job in jobs
        ]
        self.calls.append(FakeRef(groups))
        return self.calls[-1]


@pytest.fixture
def fake_rollouts(monkeypatch):
    """A started one-worker RayRollouts (one group per call, two calls in flight) on fake Ray."""
    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", ray.exceptions)
    rollouts = RayRollouts(EngineSpec(kind="hf", model="unused"), 1, groups_per_call=1)
    worker = CountingWorker()
    rollouts._slots[0].actor = worker
    rollouts._started = True
    return rollouts, worker, ray


JOBS = [GroupJob(index=i, prompt_ids=[1], n=2, seed=i) for i in range(8)]
SAMPLING = SamplingConfig(max_new_tokens=2)


def test_cancelled_generate_dispatches_nothing_more_and_drops_what_is_in_flight(fake_rollouts):
    rollouts, worker, ray = fake_rollouts
    cancel = threading.Event()
    groups = rollouts.generate(JOBS, SAMPLING, 0, cancel=cancel)
    assert next(groups).index == 0
    sent = len(worker.calls)  # two in flight, plus the one that kept the worker busy
    cancel.set()
    assert list(groups) == []
    assert len(worker.calls) == sent < len(JOBS)
    assert ray.cancelled == worker.calls[1:]  # every call not yet returned
    assert rollouts._slots[0].in_flight == 0  # the next generate starts from an idle worker


def test_cancel_during_a_wait_ends_generation_without_a_result(fake_rollouts):
    rollouts, worker, ray = fake_rollouts
    cancel = threading.Event()
    ray.nothing_ready, ray.on_wait = True, cancel.set  # cancelled while every call runs
    assert list(rollouts.generate(JOBS, SAMPLING, 0, cancel=cancel)) == []
    assert ray.waits == 1 and len(worker.calls) == 2 and ray.cancelled == worker.calls
