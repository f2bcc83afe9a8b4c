"""GroupStream: whole groups in completion order, blocking, closing, producer errors."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from periodic_rl.rollout.stream import GroupStream, StreamClosed


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
