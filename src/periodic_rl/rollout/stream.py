"""`GroupStream`: the one place where the rollout side hands finished groups to the trainer.

A producer (a background thread iterating ``RayRollouts.generate`` and scoring each group)
calls :meth:`~GroupStream.put` per finished group and :meth:`~GroupStream.close` at the end, or
:meth:`~GroupStream.error` when it fails. The trainer calls :meth:`~GroupStream.get_micro_batch`
and back-propagates each micro-batch as soon as it is there. Groups are never split (group
advantages need the whole group) and leave in the order they arrived, i.e. completion order.

A trainer that stops early (its training step raised) calls :meth:`~GroupStream.cancel`: the
groups still queued are dropped, later ``put`` calls are ignored, and the producer, which
watches :attr:`~GroupStream.cancel_event` (and hands it to ``RayRollouts.generate``), stops
asking for more groups instead of generating the rest of the iteration.

The stream is generic over its items: anything with a ``completion_ids`` list (``GeneratedGroup``,
``RolloutGroup``), or any item with a ``size`` function. That, and the five methods, is the whole
contract, so a distributed store (PipelineRL-style) can stand in for it later.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class StreamClosed(RuntimeError):
    """An item was put into a stream that was already closed."""


def completion_count(item: Any) -> int:
    """Default item size: the number of completions of a group."""
    return len(item.completion_ids)


class GroupStream(Generic[T]):
    """A thread-safe FIFO of whole groups, taken out in micro-batches of completions.

    Args:
        size: how many completions an item counts for (default: ``len(item.completion_ids)``).
    """

    def __init__(self, size: Callable[[T], int] = completion_count) -> None:
        self._size = size
        self._items: deque[tuple[T, int]] = deque()
        self._ready = 0  # completions in the queue
        self._closed = False
        self._cancelled = threading.Event()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self.num_put = 0
        self.num_taken = 0
        self.summary: Any = None  # what the producer reports about the whole stream, before close

    # ---- producer side ---------------------------------------------------------------------
    def put(self, item: T) -> bool:
        """Append a finished group; ``False`` (dropped) once the consumer cancelled. Raises
        :class:`StreamClosed` after close or error."""
        size = int(self._size(item))
        if size < 0:
            raise ValueError(f"item size must be >= 0, got {size}")
        with self._cond:
            if self._cancelled.is_set():
                return False
            if self._closed:
                raise StreamClosed("put() on a closed GroupStream")
            self._items.append((item, size))
            self._ready += size
            self.num_put += 1
            self._cond.notify_all()
        return True

    def close(self) -> None:
        """No more items will come; consumers drain what is left. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def error(self, exc: BaseException) -> None:
        """The producer failed: the consumer's next (or current) get re-raises ``exc`` (unless
        it cancelled)."""
        with self._cond:
            if self._error is None and not self._cancelled.is_set():  # nobody reads it then
                self._error = exc
            self._closed = True
            self._cond.notify_all()

    # ---- consumer side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """The consumer takes nothing more: drop the queued groups, ignore later ones, and tell
        the producer to stop (:attr:`cancel_event`). Idempotent; after a normal close it only
        marks the stream cancelled."""
        with self._cond:
            self._cancelled.set()
            self._closed = True
            self._items.clear()
            self._ready = 0
            self._cond.notify_all()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        """Set by :meth:`cancel`; producers poll it (or wait on it) to stop early."""
        return self._cancelled

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        """Groups waiting in the stream now."""
        with self._cond:
            return len(self._items)

    def ready_completions(self) -> int:
        """Completions waiting in the stream now."""
        with self._cond:
            return self._ready

    def get_micro_batch(self, min_completions: int, timeout: float | None = None) -> list[T] | None:
        """The next whole groups worth at least ``min_completions`` completions.

        Blocks until that many are ready, or the stream is closed (then returns what is left,
        possibly fewer). Returns ``None`` once the stream is closed and drained. Re-raises the
        producer's exception if it failed. Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        if min_completions < 1:
            raise ValueError(f"min_completions must be >= 1, got {min_completions}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._ready >= min_completions or (self._closed and self._items):
                    return self._take(min_completions)
                if self._closed:
                    return None
                if not self._wait(deadline):
                    raise TimeoutError(
                        f"no micro-batch of {min_completions} completions within {timeout} s"
                    )

    def drain(self, timeout: float | None = None) -> list[T]:
        """Wait for the producer to close the stream and return every remaining group."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                if not self._wait(deadline):
                    raise TimeoutError(f"stream not closed within {timeout} s")
            self._raise_if_failed()
            items = [item for item, _ in self._items]
            self.num_taken += len(items)
            self._items.clear()
            self._ready = 0
            return items

    def micro_batches(self, min_completions: int) -> Iterator[list[T]]:
        """Iterate :meth:`get_micro_batch` until the stream is drained."""
        while (batch := self.get_micro_batch(min_completions)) is not None:
            yield batch

    # ---- internals --------------------------------------------------------------------------
    def _take(self, min_completions: int) -> list[T]:
        batch: list[T] = []
        taken = 0
        while self._items and taken < min_completions:
            item, size = self._items.popleft()
            batch.append(item)
            taken += size
        self._ready -= taken
        self.num_taken += len(batch)
        return batch

    def _wait(self, deadline: float | None) -> bool:
        """Wait for a notification; ``False`` when the deadline had already passed (callers
        re-check their condition after every wake-up, so a late notification is not lost)."""
        if deadline is None:
            self._cond.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(remaining)
        return True

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
