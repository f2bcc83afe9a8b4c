"""PipelineTimeline: per-iteration and whole-run Chrome traces and Gantt PNGs."""

from __future__ import annotations

import json

from callback_runs import STEPS
from matplotlib.image import imread

from periodic_rl.callbacks import PipelineTimeline


def _timeline_dir(run):
    return run.root / "tb" / "version_0" / "timeline"


def _lanes(trace):
    return {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def test_chosen_iterations_and_the_whole_run_are_written(full_run):
    names = {p.name for p in _timeline_dir(full_run).iterdir()}
    expected = {f"iteration-{k}.{ext}" for k in range(STEPS) for ext in ("trace.json", "png")}
    assert names == expected | {"all.trace.json", "all.png"}


def test_iteration_trace_has_the_lanes_and_spans(full_run):
    trace = json.loads((_timeline_dir(full_run) / "iteration-1.trace.json").read_text())
    assert _lanes(trace) == {"trainer", "worker-0"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} == {
        "generate",
        "wait",
        "train micro-batch",
        "optimizer step",
        "weight push",
    }
    assert all(e["args"]["iteration"] == 1 for e in spans)
    assert min(e["ts"] for e in spans) == 0.0


def test_whole_run_trace_covers_every_iteration(full_run):
    trace = json.loads((_timeline_dir(full_run) / "all.trace.json").read_text())
    iterations = {e["args"].get("iteration") for e in trace["traceEvents"] if e["ph"] == "X"}
    assert set(range(STEPS)) <= iterations


def test_pngs_open_with_a_sane_size(full_run):
    for name in ("iteration-1.png", "all.png"):
        image = imread(_timeline_dir(full_run) / name)
        height, width, channels = image.shape
        assert 150 <= height <= 1000 and 800 <= width <= 1500 and channels in (3, 4)
        assert image[..., :3].std() > 0.05  # not a blank canvas


def test_default_iterations_are_the_first_two():
    timeline = PipelineTimeline()
    assert [k for k in range(5) if timeline.wants(k)] == [0, 1]
    every = PipelineTimeline(every_n_iterations=3)
    assert [k for k in range(7) if every.wants(k)] == [0, 3, 6]
