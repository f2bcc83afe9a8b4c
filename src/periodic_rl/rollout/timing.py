"""Where the time of an iteration goes: named spans on lanes, a summary, a Chrome trace.

The point of periodic asynchrony is that the trainer trains while the workers generate. Whether
that happens is a question about intervals: a span is ``(name, lane, start, end)`` on a lane such
as ``"trainer"`` or ``"worker-0"``, and the summary measures unions and intersections of them.
Unions (not sums) make a duplicated or nested span harmless: recording the same push twice does
not double the push time.

Naming convention read by :meth:`SpanRecorder.summary`:

- lanes starting with ``"worker-"`` carry generation calls (any span name);
- on the ``"trainer"`` lane, spans named in :data:`WAIT_NAMES` are idle time, spans named in
  :data:`PUSH_NAMES` are weight pushes, every other span is training;
- spans named in :data:`PUSH_NAMES` count as push time on any lane;
- spans named :data:`MICRO_BATCH_NAME` on the trainer lane are counted (micro-batches per
  iteration), and training that overlaps the lane :data:`LOAN_LANE` ran on borrowed cores too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

TRAINER_LANE = "trainer"
WORKER_LANE_PREFIX = "worker-"
#: The lane of the trainer's loans of idle worker cores (:mod:`periodic_rl.cpu_tuning.core_loan`).
LOAN_LANE = "trainer cores lent"
WAIT_NAMES = frozenset({"wait"})
PUSH_NAMES = frozenset({"weight push"})
#: The trainer's span of one micro-batch's forward and backward (counted per iteration).
MICRO_BATCH_NAME = "train micro-batch"

Interval = tuple[float, float]


@dataclass(frozen=True)
class Span:
    """One timed interval. Times are ``time.time()`` seconds (comparable across processes of
    one machine; across machines only as far as their clocks agree)."""

    name: str
    lane: str
    start: float
    end: float
    iteration: int | None = None
    args: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


def worker_lane(worker: int) -> str:
    """The lane name of rollout worker ``worker``."""
    return f"{WORKER_LANE_PREFIX}{worker}"


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The disjoint, sorted union of ``intervals``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def measure(intervals: Iterable[Interval]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    return float(sum(end - start for start, end in union(intervals)))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Intersection of two sets of intervals, as a disjoint sorted list."""
    left, right = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        if end > start:
            out.append((start, end))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


class SpanRecorder:
    """A thread-safe list of spans, grouped into iterations.

    The trainer's thread, the rollout producer thread and the Ray rollouts all add spans; call
    :meth:`new_iteration` at the start of each iteration so that :meth:`summary` can describe one
    iteration at a time (spans added afterwards carry that iteration number).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._labels: dict[str, str] = {}
        self.iteration: int | None = None

    def label_lane(self, lane: str, label: str) -> None:
        """Show ``lane`` as ``label`` in charts and traces (e.g. the node a worker runs on); the
        spans keep the lane's name, which :meth:`summary` reads."""
        with self._lock:
            self._labels[lane] = label

    def lane_labels(self) -> dict[str, str]:
        """The label of each labelled lane (:meth:`label_lane`)."""
        with self._lock:
            return dict(self._labels)

    def new_iteration(self, iteration: int) -> None:
        """Tag the spans recorded from now on with ``iteration``."""
        with self._lock:
            self.iteration = iteration

    def add(
        self,
        name: str,
        lane: str,
        start: float,
        end: float,
        iteration: int | None = None,
        **args: Any,
    ) -> Span:
        """Record a span (``iteration`` defaults to the current one); returns it."""
        if end < start:
            raise ValueError(f"span {name!r} on {lane!r} ends before it starts")
        with self._lock:
            span = Span(
                name, lane, start, end, self.iteration if iteration is None else iteration, args
            )
            self._spans.append(span)
        return span

    @contextmanager
    def span(self, name: str, lane: str, **args: Any) -> Iterator[None]:
        """``with recorder.span("train micro-batch", "trainer"): ...`` records the block."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, lane, start, time.time(), **args)

    def spans(self, iteration: int | None = None) -> list[Span]:
        """All spans, or those of ``iteration``, in recording order."""
        with self._lock:
            spans = list(self._spans)
        return spans if iteration is None else [s for s in spans if s.iteration == iteration]

    def iterations(self) -> list[int]:
        """Iteration numbers that have spans, in first-seen order."""
        return list(dict.fromkeys(s.iteration for s in self.spans() if s.iteration is not None))

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def summary(self, iteration: int | None = None, spans: list[Span] | None = None) -> dict:
        """Seconds spent per activity in one iteration (default: the current one, or every span
        when no iteration was ever started).

        Keys: ``wall_time`` (first start to last end), ``generation_time`` (some worker
        generating), ``worker_busy_time`` (summed over workers), ``worker_idle_time`` (summed
        over workers, within the generation window), ``training_time``, ``trainer_idle_time``
        (waiting for rollouts), ``push_time``, ``cores_lent_time`` (the workers' idle cores in
        the trainer's use: ``lend_idle_cores``), ``overlap_ratio`` (fraction of generation time
        during which the trainer was training; 0 without generation), ``num_workers``.
        """
        if spans is None:
            chosen = self.iteration if iteration is None else iteration
            spans = self.spans(chosen)
        return summarize(spans)

    def to_chrome_trace(self, iteration: int | None = None) -> dict:
        """Trace-event JSON (load it in ``chrome://tracing`` or https://ui.perfetto.dev): one
        thread per lane, one complete ("X") event per span, times in microseconds."""
        spans = self.spans(iteration)
        origin = min((s.start for s in spans), default=0.0)
        lanes = ordered_lanes(s.lane for s in spans)
        labels = self.lane_labels()
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "periodic_rl"}}
        ]
        for tid, lane in enumerate(lanes, start=1):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": 1,
                    "tid": tid,
                    "args": {"name": labels.get(lane, lane)},
                }
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": 1,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        tids = {lane: tid for tid, lane in enumerate(lanes, start=1)}
        for s in spans:
            args = {k: _jsonable(v) for k, v in s.args.items()}
            if s.iteration is not None:
                args["iteration"] = s.iteration
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.lane,
                    "pid": 1,
                    "tid": tids[s.lane],
                    "ts": (s.start - origin) * 1e6,
                    "dur": s.duration * 1e6,
                    "args": args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def summarize(spans: list[Span]) -> dict[str, float]:
    """The numbers of :meth:`SpanRecorder.summary` for an explicit list of spans."""
    worker_lanes = sorted({s.lane for s in spans if s.lane.startswith(WORKER_LANE_PREFIX)})
    per_worker = {
        lane: [(s.start, s.end) for s in spans if s.lane == lane] for lane in worker_lanes
    }
    generation = [iv for ivs in per_worker.values() for iv in ivs]
    trainer = [s for s in spans if s.lane == TRAINER_LANE]
    training = [(s.start, s.end) for s in trainer if s.name not in WAIT_NAMES | PUSH_NAMES]
    waiting = [(s.start, s.end) for s in trainer if s.name in WAIT_NAMES]
    pushes = [(s.start, s.end) for s in spans if s.name in PUSH_NAMES]
    lent = [(s.start, s.end) for s in spans if s.lane == LOAN_LANE]

    generation_time = measure(generation)
    generation_union = union(generation)
    window = generation_union[-1][1] - generation_union[0][0] if generation_union else 0.0
    worker_busy = {lane: measure(ivs) for lane, ivs in per_worker.items()}
    overlap = measure(intersection(generation, training))
    return {
        "wall_time": (max(s.end for s in spans) - min(s.start for s in spans)) if spans else 0.0,
        "generation_time": generation_time,
        "worker_busy_time": sum(worker_busy.values()),
        "worker_idle_time": sum(window - busy for busy in worker_busy.values()),
        "training_time": measure(training),
        "trainer_idle_time": measure(waiting),
        "push_time": measure(pushes),
        "cores_lent_time": measure(lent),
        "training_lent_time": measure(intersection(training, lent)),
        "micro_batches": float(sum(1 for s in trainer if s.name == MICRO_BATCH_NAME)),
        "overlap_ratio": overlap / generation_time if generation_time > 0 else 0.0,
        "num_workers": float(len(worker_lanes)),
    }


def ordered_lanes(lanes: Iterable[str]) -> list[str]:
    """Trainer first, then workers by number, then the rest alphabetically."""

    def key(lane: str) -> tuple[int, int, str]:
        if lane == TRAINER_LANE:
            return (0, 0, lane)
        suffix = lane.removeprefix(WORKER_LANE_PREFIX)
        if lane.startswith(WORKER_LANE_PREFIX) and suffix.isdigit():
            return (1, int(suffix), lane)
        return (2, 0, lane)

    return sorted(set(lanes), key=key)


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
