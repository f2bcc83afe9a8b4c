"""SpanRecorder: summary numbers from hand-made spans, iterations, Chrome trace export."""

from __future__ import annotations

import json
import threading

import pytest

from periodic_rl.rollout.timing import (
    LOAN_LANE,
    Span,
    SpanRecorder,
    intersection,
    measure,
    summarize,
    union,
    worker_lane,
)


def test_interval_algebra():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert measure([(0, 1), (0, 1), (0.5, 1.5)]) == pytest.approx(1.5)
    assert intersection([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert intersection([(0, 1)], []) == []


def overlapped_iteration() -> SpanRecorder:
    """Two workers generate over [0, 10]; the trainer waits, trains, waits, trains, pushes.

    worker-0: [0, 4] [5, 10]       worker-1: [0, 6]
    trainer:  wait [0, 4], train [4, 7], wait [7, 8], train [8, 11], push [11, 12]
    """
    rec = SpanRecorder()
    rec.new_iteration(3)
    rec.add("generate", worker_lane(0), 0, 4)
    rec.add("generate", worker_lane(0), 5, 10)
    rec.add("generate", worker_lane(1), 0, 6)
    rec.add("wait", "trainer", 0, 4)
    rec.add("train micro-batch", "trainer", 4, 7)
    rec.add("wait", "trainer", 7, 8)
    rec.add("train micro-batch", "trainer", 8, 11)
    rec.add("weight push", "trainer", 11, 12)
    rec.add("weight push", "weights", 11, 12)  # the same push recorded twice: counted once
    return rec


def test_summary_of_an_overlapped_iteration():
    rec = overlapped_iteration()
    assert rec.summary()["cores_lent_time"] == 0
    rec.add("cores lent", LOAN_LANE, 10, 12)  # from the last generation through the push
    s = rec.summary()
    assert s["wall_time"] == pytest.approx(12)
    assert s["generation_time"] == pytest.approx(10)
    assert s["worker_busy_time"] == pytest.approx(9 + 6)
    assert s["worker_idle_time"] == pytest.approx((10 - 9) + (10 - 6))
    assert s["training_time"] == pytest.approx(6)
    assert s["trainer_idle_time"] == pytest.approx(5)
    assert s["push_time"] == pytest.approx(1)
    assert s["cores_lent_time"] == pytest.approx(2)
    assert s["training_lent_time"] == pytest.approx(1)  # [10, 11] of the training [8, 11]
    assert s["micro_batches"] == 2
    # Training during generation: [4, 7] and [8, 10] -> 5 of 10 s.
    assert s["overlap_ratio"] == pytest.approx(0.5)
    assert s["num_workers"] == 2


def test_summary_of_a_synchronous_iteration_has_no_overlap():
    spans = [
        Span("generate", "worker-0", 0, 5),
        Span("wait", "trainer", 0, 5),
        Span("train micro-batch", "trainer", 5, 9),
    ]
    s = summarize(spans)
    assert s["overlap_ratio"] == 0
    assert s["training_time"] == pytest.approx(4)
    assert summarize([])["overlap_ratio"] == 0


def test_iterations_are_kept_apart():
    rec = overlapped_iteration()
    rec.new_iteration(4)
    rec.add("generate", worker_lane(0), 20, 21)
    assert rec.iterations() == [3, 4]
    assert rec.summary()["generation_time"] == pytest.approx(1)  # the current iteration
    assert rec.summary(3)["generation_time"] == pytest.approx(10)
    assert len(rec.spans()) == 10
    assert rec.add("x", "trainer", 0, 1, iteration=7).iteration == 7
    with pytest.raises(ValueError):
        rec.add("bad", "trainer", 2, 1)


def test_span_context_manager_and_threads():
    rec = SpanRecorder()

    def work(i: int) -> None:
        for _ in range(100):
            with rec.span("generate", worker_lane(i), call=i):
                pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rec.spans()) == 400
    assert rec.spans()[0].args["call"] in range(4)


def test_chrome_trace():
    trace = overlapped_iteration().to_chrome_trace()
    json.dumps(trace)  # serialisable as is
    events = trace["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert list(names) == ["trainer", "worker-0", "worker-1", "weights"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 9
    push = next(e for e in complete if e["cat"] == "weights")
    assert push["ts"] == pytest.approx(11e6) and push["dur"] == pytest.approx(1e6)
    assert push["tid"] == names["weights"] and push["args"]["iteration"] == 3
