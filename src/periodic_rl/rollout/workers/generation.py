"""Streamed generation of :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts`: prompt groups
cut into calls, dispatched to the least-loaded workers, and yielded as each call finishes.

A worker holds at most ``max_calls_in_flight`` calls and gets new work only when one of its
calls completes, so faster workers take more. A call lost with a dead worker is sent again with
the same jobs and seeds; a worker past ``call_timeout_s`` is restarted like a dead one (both by
the class this is mixed into). Every job's group is yielded exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from periodic_rl.rollout.backend import JobSource
from periodic_rl.rollout.calls import plan_calls, take_jobs
from periodic_rl.rollout.timing import SpanRecorder, worker_lane
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig
from periodic_rl.rollout.workers.slots import Call, SlotOwner, hung_slots


class StreamedGeneration(SlotOwner):
    """The generation half of :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts` (a mixin:
    the class it is mixed into owns the state it uses, and restarts workers)."""

    _closed: bool
    num_workers: int
    groups_per_call: int
    max_calls_in_flight: int
    redispatched_calls: int
    spans: SpanRecorder
    poll_s: float

    def _start_restart_copy(self) -> None:
        raise NotImplementedError

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
        """Generate every job on the workers; yield each group once, in completion order.

        ``groups_per_call`` overrides the constructor's chunk size for this call (evaluation, which
        does not stream, batches whole shares of the jobs per worker). ``ramp_groups`` (the
        groups of one trainer micro-batch) makes the first and last calls that small
        (:func:`plan_calls`).

        Stopping early: once ``cancel`` is set (from any thread) no further call is dispatched
        and the iterator ends within ``poll_s``; closing the iterator (``.close()``, or leaving
        a ``for`` loop over it) does the same at once. Either way the calls still in flight
        are cancelled on their workers (a call already running finishes there, in order, and
        its result is dropped), so none of them reaches a later ``generate``.

        Jobs added to ``more_jobs`` while the generation runs (dynamic sampling's spares) are
        taken whenever the loop looks for work (before each wait for a call), cut into calls of
        ``groups_per_call`` and dispatched after the calls already pending; the iterator ends
        once ``more_jobs`` is closed and every job is generated. Restarts and redispatches
        treat them like the others.

        Checks (workers started, last push good, ``version`` current, unique job indices) run
        at the call, before the first group is asked for.
        """
        self._require_started()
        if not self._weights_ok:
            raise RuntimeError("the last weight push failed; push weights before generating")
        if self.version is not None and version != self.version:
            raise ValueError(f"generate for version {version}, workers hold {self.version}")
        if len({job.index for job in jobs}) != len(jobs):
            raise ValueError("job indices must be unique within one generate call")
        size = groups_per_call or self.groups_per_call
        calls = plan_calls(list(jobs), size, self.num_workers, ramp_groups)
        return self._generate(
            calls, sampling, version, cancel or threading.Event(), more_jobs, size
        )

    def _generate(
        self,
        calls: list[list[GroupJob]],
        sampling: SamplingConfig,
        version: int,
        cancel: threading.Event,
        more_jobs: JobSource | None = None,
        size: int = 1,
    ) -> Iterator[GeneratedGroup]:
        import ray
        from ray.exceptions import RayActorError

        expected_indices = {job.index for call in calls for job in call}
        pending = deque(calls)
        in_flight: dict[Any, Call] = {}
        yielded: set[int] = set()
        try:
            while not cancel.is_set():
                more = take_jobs(more_jobs, pending, expected_indices, size)
                if not (pending or in_flight or more):
                    break
                self._dispatch(pending, in_flight, sampling, version)
                self._start_restart_copy()  # the last push's, now that the workers are busy
                if not (pending or in_flight):  # only the job source can bring work now
                    more_jobs.wait(self.poll_s)
                    continue
                starting = {s.ready: s for s in self._slots if s.ready is not None}
                waitables = [*in_flight, *starting]
                ready, _ = ray.wait(waitables, num_returns=1, timeout=self.poll_s)
                if self._closed:
                    raise RuntimeError("the Ray rollouts were shut down during generate")
                if cancel.is_set():
                    return  # the finally drops what is in flight
                for slot, waited in hung_slots(self._slots, in_flight, self.call_timeout_s):
                    self._restart_hung(slot, waited, "call")  # its calls come back failed
                if not ready:
                    continue
                ref = ready[0]
                if ref in starting:
                    self._settle(starting[ref], expected=self.fingerprint)
                    continue
                call = in_flight.pop(ref)
                slot = self._slots[call.slot]
                try:
                    groups: list[GeneratedGroup] = ray.get(ref)
                except RayActorError as error:
                    pending.appendleft(call.jobs)  # same jobs, same seeds, another try
                    self.redispatched_calls += 1
                    self._restart(slot, call.incarnation, error)
                    continue
                if call.incarnation == slot.incarnation:
                    slot.in_flight -= 1
                    slot.last_done = time.monotonic()
                    slot.failures = 0
                if not cancel.is_set():
                    self._dispatch(pending, in_flight, sampling, version)  # keep it busy first
                self._record(groups)
                for group in groups:
                    if group.index in yielded or group.index not in expected_indices:
                        raise RuntimeError(f"group {group.index} came back twice or unasked")
                    yielded.add(group.index)
                    yield group
        finally:
            for ref, call in in_flight.items():  # abandoned early (consumer stopped, error)
                slot = self._slots[call.slot]
                if call.incarnation == slot.incarnation:
                    slot.in_flight -= 1
                try:
                    ray.cancel(ref)
                except Exception:  # noqa: BLE001 - best effort; the result is dropped anyway
                    pass

    def _dispatch(
        self,
        pending: deque[list[GroupJob]],
        in_flight: dict[Any, Call],
        sampling: SamplingConfig,
        version: int,
    ) -> None:
        """Hand pending calls to the least-loaded workers that have room."""
        while pending:
            free = [
                s
                for s in self._slots
                if s.ready is None
                and s.actor is not None
                and s.in_flight < self.max_calls_in_flight
            ]
            if not free:
                return
            slot = min(free, key=lambda s: (s.in_flight, s.index))
            chunk = pending.popleft()
            ref = slot.actor.generate.remote(chunk, sampling, version)
            in_flight[ref] = Call(slot.index, slot.incarnation, chunk, time.monotonic())
            slot.in_flight += 1

    def _record(self, groups: list[GeneratedGroup]) -> None:
        if groups:  # one span per call: its groups share the call's timestamps
            g = groups[0]
            tokens = sum(len(c) for group in groups for c in group.completion_ids)
            self.spans.add(
                "generate", worker_lane(g.worker), g.started, g.finished, groups=len(groups),
                tokens=tokens,
            )  # fmt: skip
